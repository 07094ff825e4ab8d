"""End-to-end runs of tools/train_ppo.py (torchrun, Megatron on gloo, SGLang on CPU) with an agent task: the tiny
tool-calling model of tiny_agent.py, its tools by path.

* GRPO, 2 processes: the agent metrics are logged, the trainer's log-probs equal the engine's on the model's
  tokens (rollout/logprob_diff_max, 1e-4 in fp32 as in single-turn runs: tool tokens are masked out of it), and
  every tool is closed once when the run ends.
* PPO with a critic, greedy: a multi-turn run stopped after step 2 and resumed equals the uninterrupted run at
  step 3 (every logged value within 1e-6), and it learns (the actor's and critic's gradients are not zero).

Run: nice -n 10 .venv/bin/python -m pytest tests/agent/test_agent_train.py -q    (~8 min on the CPU machines)
"""

import json
import shutil

import pytest

from tests.agent.tiny_agent import SCRIPTS
from tests.trainer.conftest import read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow

TOOLS = ",".join(f"{{path: tests.agent.tiny_agent:{c}}}" for c in ("Add", "Boom", "Sleepy"))
AGENT = ["+agent=calculator", "agent.max_turns=3", "agent.max_response_tokens=300", "model.max_seq_len=512",
         "data.max_prompt_length=64",  # 64 + 300 + 80 fits the tiny model's 512 positions
         "rollout.max_new_tokens=80", "agent.reply_format='<|end|><|tool|>{reply}<|end|><|assistant|>'"]


@pytest.fixture(scope="module")
def agent_model(trained_agent_model):
    return trained_agent_model[0]


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("agent_data") / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": u, "answer": "x"}) + "\n" for u in SCRIPTS))
    return str(data)


def test_grpo_with_agent_task(agent_model, agent_data, tmp_path):
    out, closed = tmp_path / "run", tmp_path / "closed.txt"
    tools = f"{TOOLS},{{path: tests.agent.tiny_agent:Recorder, file: '{closed}'}}"
    run_train(2, tiny_overrides(agent_model, agent_data, str(out)) + AGENT + [
        "trainer.total_steps=2", "trainer.export_hf=false", "trainer.prompts_per_step=6",
        "algorithm.n_samples_per_prompt=2", "rollout.temperature=0.7", f"agent.tools=[{tools}]"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        assert r["agent/tool_calls"] > 0 and r["agent/turns/max"] >= 2
        assert r["agent/trajectory_length/mean"] > r["agent/response_length/mean"] > 0
        assert r.get("actor/pg_loss") is not None
        for key in ("agent/end/answer", "agent/end/max_turns", "agent/malformed_calls", "agent/tool_success"):
            assert r.get(key) is not None, key
    # built on global rank 0 only, closed once by Run.close
    assert closed.read_text() == "closed\n"
    print({k: v for k, v in rows[0].items() if k.startswith(("agent/", "rollout/logprob"))})


def test_agent_resume_matches_uninterrupted_run(agent_model, agent_data, tmp_path):
    common = tiny_overrides(agent_model, agent_data, "") + AGENT + [
        "experiment=ppo_critic", "trainer.prompts_per_step=3", "algorithm.n_samples_per_prompt=1",
        "rollout.temperature=0", "actor.lr=1e-4", "critic.lr=1e-4", "trainer.export_hf=false",
        "trainer.save_every=1", f"agent.tools=[{TOOLS}]"]
    common = [o for o in common if not o.startswith("trainer.output_dir=")]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(1, common + [f"trainer.output_dir={full}", "trainer.total_steps=3"])
    run_train(1, common + [f"trainer.output_dir={part}", "trainer.total_steps=2"])
    shutil.rmtree(part / "checkpoints" / "step_0000001")
    run_train(1, common + [f"trainer.output_dir={part}", "trainer.total_steps=3", "trainer.resume=auto"])
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a[2]["agent/tool_calls"] > 0 and a[2]["agent/turns/max"] >= 2  # step 3 really is multi-turn
    compared = 0
    for key, value in a[2].items():
        skip = ("timing/", "throughput/", "memory/", "weight_sync/gb_per_s", "rollout/engine_syncs",
                "agent/tool/add/seconds", "agent/tool/boom/seconds", "agent/tool/sleepy/seconds")
        if key.startswith(skip) or value is None:
            continue
        assert b[2][key] == pytest.approx(value, abs=1e-6), key
        compared += 1
    assert compared > 30
    for r in a:  # it learns: PPO's advantages come from the critic, not from group differences
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0, r
