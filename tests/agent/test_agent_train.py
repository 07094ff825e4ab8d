"""One short end-to-end run of tools/train_ppo.py (torchrun, 2 processes, Megatron on gloo, SGLang on CPU) with
an agent task: the tiny tool-calling model of tiny_agent.py, its tools by path. Checks the agent metrics are
logged, the trainer's log-probs equal the engine's on the model's tokens (rollout/logprob_diff_max, 1e-4 in
fp32 as in single-turn runs: tool tokens are masked out of it) and the run completes.

Run: nice -n 10 .venv/bin/python -m pytest tests/agent/test_agent_train.py -q    (~4 min on the CPU machines)
"""

import json

import pytest

from tests.agent.tiny_agent import SCRIPTS, make_agent_model
from tests.trainer.conftest import read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow


def test_grpo_with_agent_task(tmp_path):
    model, _ = make_agent_model(tmp_path / "model", steps=300)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": u, "answer": "x"}) + "\n" for u in SCRIPTS))
    out = tmp_path / "run"
    tools = ",".join(f"{{path: tests.agent.tiny_agent:{c}}}" for c in ("Add", "Boom", "Sleepy"))
    run_train(2, tiny_overrides(model, str(data), str(out)) + [
        "trainer.total_steps=2", "trainer.export_hf=false", "trainer.prompts_per_step=6",
        "algorithm.n_samples_per_prompt=2", "rollout.max_new_tokens=80", "rollout.temperature=0.7",
        "model.max_seq_len=512",
        "+agent=calculator", f"agent.tools=[{tools}]", "agent.max_turns=3", "agent.max_response_tokens=300",
        "agent.reply_format='<|end|><|tool|>{reply}<|end|><|assistant|>'"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, r
        assert r["agent/tool_calls"] > 0 and r["agent/turns/max"] >= 2
        assert r["agent/trajectory_length/mean"] > r["agent/response_length/mean"] > 0
        # no grad_norm > 0 check: the memorising model often samples one trajectory per group (GRPO advantage 0)
        assert r.get("actor/pg_loss") is not None
        for key in ("agent/end/answer", "agent/end/max_turns", "agent/malformed_calls"):
            assert r.get(key) is not None, key
    print({k: v for k, v in rows[0].items() if k.startswith(("agent/", "rollout/logprob"))})
