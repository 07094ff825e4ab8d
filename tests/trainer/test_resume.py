"""A run stopped after step 2 and resumed (trainer.resume=auto) logs the same step 3 as an uninterrupted run.

PPO with a critic and an adaptive KL controller, so the checkpoint must carry actor and critic weights, both
optimizers and schedulers, the data position, the KL controller and the RNG states. Generation is greedy
(rollout.temperature=0), so this checks the trainer's state alone; sampled rollouts resume exactly too
(rollout.deterministic, tests/trainer/test_exact_resume.py).
Tolerance 1e-6 absolute on every logged number except timings: same layout, same inputs, fp32, so only a
state that was not restored can make a difference (the per-parameter Adam step bug moved weights by 1e-3).
"""

import shutil

import pytest

from tests.trainer.conftest import read_metrics, run_train, tiny_overrides

pytestmark = pytest.mark.slow


def test_resume_matches_uninterrupted_run(tiny_model, arith_data, tmp_path):
    common = ["experiment=ppo_critic", "trainer.prompts_per_step=4", "algorithm.kl_coef=0.05",
              "algorithm.kl_adaptive=true", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100",
              "rollout.temperature=0", "critic.lr=1e-4", "actor.lr=1e-4", "trainer.export_hf=false",
              "trainer.save_every=1", "trainer.keep_last=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(1, tiny_overrides(tiny_model, arith_data, str(full)) + common + ["trainer.total_steps=3"])
    run_train(1, tiny_overrides(tiny_model, arith_data, str(part)) + common + ["trainer.total_steps=2"])
    # the stopped run keeps its step-2 checkpoint; drop step 1's so resume=auto must follow `latest`
    shutil.rmtree(part / "checkpoints" / "step_0000001")
    run_train(1, tiny_overrides(tiny_model, arith_data, str(part)) + common + ["trainer.total_steps=3",
                                                                                "trainer.resume=auto"])
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3]  # resumed rows replace nothing, duplicate nothing
    compared = 0
    for key, value in a[2].items():
        skip = ("timing/", "throughput/", "memory/", "weight_sync/gb_per_s", "rollout/engine_syncs")
        if key.startswith(skip) or value is None:
            continue
        assert b[2][key] == pytest.approx(value, abs=1e-6), key
        compared += 1
    assert compared > 20
    # the samples' weight version names the policy, not the engine's sync count: equal across the resume
    assert b[2]["rollout/sample_weight_version"] == a[2]["rollout/sample_weight_version"] == 2.0
    assert a[2]["kl_coef"] != pytest.approx(0.05)  # the adaptive controller moved, so its restore mattered
