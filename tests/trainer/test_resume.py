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


def test_resume_at_another_world_size(tiny_model, arith_data, tmp_path):
    """Saved by 2 processes (DP 2), resumed by 1 (DP 1: fewer ranks than rank files), then by 2 again (more ranks
    than rank files). Sampled rollouts with per-sample seeds, the default (per-rank) optimizer format, which
    reshards over DP. The resumed steps continue the LR schedule and the data exactly; weights differ from the
    uninterrupted run only by fp32 reduction order (DP 1 sums the micro batches' gradients in another order), so
    the logged losses and rewards of steps 3-4 agree within 1e-3 relative."""
    common = ["rollout.temperature=1.0", "rollout.deterministic=true", "trainer.export_hf=false",
              "trainer.save_every=2", "trainer.keep_last=3"]
    full, elastic = tmp_path / "full", tmp_path / "elastic"
    run_train(2, tiny_overrides(tiny_model, arith_data, str(full)) + common + ["trainer.total_steps=4"])
    shrunk = run_train(1, tiny_overrides(tiny_model, arith_data, str(elastic)) + common + [
        "trainer.total_steps=4", f"trainer.resume={full / 'checkpoints' / 'step_0000002'}"])
    text = shrunk.stdout + shrunk.stderr
    assert "saved at world size 2 (tp 1 x pp 1 x dp 2), at world size 1 (tp 1 x pp 1 x dp 1)" in text, text[-3000:]
    a = {r["step"]: r for r in read_metrics(full)}
    b = {r["step"]: r for r in read_metrics(elastic)}
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert b[step]["actor/lr"] == a[step]["actor/lr"]
        assert b[step]["rollout/sample_weight_version"] == a[step]["rollout/sample_weight_version"] == step - 1
        for key in ("actor/pg_loss", "reward/mean", "response_length/mean", "actor/entropy"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-3, abs=1e-6), (step, key)
    grown = run_train(2, tiny_overrides(tiny_model, arith_data, str(elastic)) + common + [
        "trainer.total_steps=5", "trainer.resume=auto"])
    text = grown.stdout + grown.stderr
    assert "saved at world size 1 (tp 1 x pp 1 x dp 1), at world size 2 (tp 1 x pp 1 x dp 2)" in text, text[-3000:]
    assert [r["step"] for r in read_metrics(elastic)] == [3, 4, 5]
