"""GRPO and PPO on a tiny Qwen3-MoE (4 experts, top-2; mcore_rl.testing) through tools/train_ppo.py under torchrun,
with expert parallelism 2 over the two processes, real Megatron-Core (gloo) and real SGLang on CPU, fp32.

* GRPO with the text-length reward (tests/trainer/reward_fns.py: a random model can move it), the load-balancing
  aux loss and routing replay on: the mean reward of the last three of eight steps is above the first three's
  (0.45 -> 0.52 in a run without replay, actor.lr=3e-3), after every weight sync the engine's log-probs of its own
  samples equal the trainer's within 1e-4 (observed 2-3e-7), and the router metrics are logged every step.
* PPO with a critic, greedy rollouts (see test_resume.py for why greedy), stopped after step 2 and resumed: step 3
  equal to the uninterrupted run's within 1e-6 on every logged number but timings. The experts are sharded over
  EP ranks in the checkpoint, so this checks that each rank saves and restores its own experts and their Adam state.
"""

import shutil

import pytest

from tests.trainer.conftest import read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4
MOE = ["parallel.ep=2", "trainer.export_hf=false"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from mcore_rl.testing import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_moe") / "qwen3_moe", "qwen3_moe", seed=3))


def test_grpo_with_expert_parallelism_learns(tiny_moe, arith_data, tmp_path):
    out = tmp_path / "grpo"
    steps = 8
    run_train(2, tiny_overrides(tiny_moe, arith_data, str(out)) + MOE + [
        f"trainer.total_steps={steps}", "trainer.prompts_per_step=4", "algorithm.n_samples_per_prompt=8",
        "rollout.max_new_tokens=16", "actor.lr=3e-3", "model.moe_aux_loss_coeff=0.01",
        "model.moe_routing_replay=true"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["rollout/logprob_diff_max"] < LOGPROB_TOL, r["step"]
        assert r["actor/grad_norm"] > 0
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0, r["step"]
        assert 1.0 <= r["moe/load_imbalance"] <= r["moe/load_imbalance_max"] <= 4 / 2  # E / k: all on k experts
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards


def test_resume_with_experts_sharded_matches_uninterrupted_run(tiny_moe, arith_data, tmp_path):
    common = MOE + ["experiment=ppo_critic", "trainer.prompts_per_step=4", "algorithm.kl_coef=0.05",
                    "rollout.temperature=0", "critic.lr=1e-4", "actor.lr=1e-4", "trainer.save_every=1",
                    "trainer.keep_last=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(2, tiny_overrides(tiny_moe, arith_data, str(full)) + common + ["trainer.total_steps=3"])
    run_train(2, tiny_overrides(tiny_moe, arith_data, str(part)) + common + ["trainer.total_steps=2"])
    shutil.rmtree(part / "checkpoints" / "step_0000001")
    run_train(2, tiny_overrides(tiny_moe, arith_data, str(part)) + common + ["trainer.total_steps=3",
                                                                              "trainer.resume=auto"])
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]
    compared = 0
    for key, value in a[2].items():
        skip = ("timing/", "throughput/", "memory/", "weight_sync/gb_per_s", "rollout/engine_syncs")
        if key.startswith(skip) or value is None:
            continue
        assert b[2][key] == pytest.approx(value, abs=1e-6), key
        compared += 1
    assert compared > 20
    assert a[2]["actor/grad_norm"] > 0 and a[2]["critic/grad_norm"] > 0
