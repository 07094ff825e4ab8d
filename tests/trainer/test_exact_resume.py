"""Exact resume under sampling (rollout.temperature=1, rollout.deterministic on, as it is by default on CPU):
a run resumed from its step-2 checkpoint logs steps 3 and 4 bit for bit as the uninterrupted run does, and two
straight runs with the same seeds log the same steps. torchrun with 2 processes (gloo), real Megatron-Core and
SGLang, the tiny model, fp32.

Equality is exact (==, no tolerance) on every logged number except wall-clock timings, throughputs, memory and
the engine's own sync count: each sample's SGLang seed is a function of (rollout.random_seed, group_id, index)
(mcore_rl/rollout/seeds.py), so the same step of both runs samples the same tokens from the same weights, and
everything after that (rewards, advantages, the update) is the same fp32 arithmetic on the same inputs.
Three runs: one task (a stopped run resumed with resume=auto in its own folder), two tasks (GRPO + DPO) and PPO
with a critic (GAE), the last two resumed from the uninterrupted run's step-2 checkpoint into a fresh folder.
"""

import pytest

from tests.trainer.conftest import read_metrics, run_train, tiny_overrides
from tests.trainer.test_multitask import overrides as multitask_overrides
from tests.trainer.test_multitask import pairs_data  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

# Wall-clock figures, and the engine's sync count (a resumed engine counts from its own start).
NOT_COMPARED = ("timing/", "throughput/", "memory/", "weight_sync/gb_per_s", "rollout/engine_syncs",
                "rollout/weight_version")
SAMPLED = ["rollout.temperature=1.0", "rollout.deterministic=true", "trainer.save_every=2", "trainer.keep_last=2",
           "trainer.export_hf=false"]


def compared_keys(row: dict) -> list[str]:
    return [k for k in row if not (k.startswith(NOT_COMPARED) or any(f"/{p}" in k for p in NOT_COMPARED))]


def assert_same_steps(expected: list[dict], got: list[dict], steps, label: str) -> int:
    """Every compared metric of `steps` equal; the message names the step, the metric and both values."""
    by_step_a, by_step_b = {r["step"]: r for r in expected}, {r["step"]: r for r in got}
    compared = 0
    for step in steps:
        a, b = by_step_a[step], by_step_b[step]
        assert compared_keys(a) == compared_keys(b), f"step {step}: the {label} logged other metrics"
        for key in compared_keys(a):
            assert a[key] == b[key], f"step {step}: {key} differs: uninterrupted run {a[key]!r}, {label} {b[key]!r}"
            compared += 1
    return compared


def test_single_task_stopped_and_resumed(tiny_model, arith_data, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(2, tiny_overrides(tiny_model, arith_data, str(full)) + SAMPLED + ["trainer.total_steps=4"])
    run_train(2, tiny_overrides(tiny_model, arith_data, str(part)) + SAMPLED + ["trainer.total_steps=2"])
    a = read_metrics(full)
    assert_same_steps(a, read_metrics(part), [1, 2], "second run")
    run_train(2, tiny_overrides(tiny_model, arith_data, str(part)) + SAMPLED + ["trainer.total_steps=4",
                                                                                "trainer.resume=auto"])
    b = read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert assert_same_steps(a, b, [3, 4], "resumed run") > 40
    # it really sampled: the 4 samples of a prompt differ (text-length reward, 12 new tokens at most)
    assert any(r["reward/max"] != r["reward/min"] for r in a)


def _resume_from_step_2(full, out, args: list[str]) -> list[dict]:
    """Launch `args` again, resuming from the uninterrupted run's step-2 checkpoint into a fresh folder."""
    run_train(2, args + [f"trainer.resume={full / 'checkpoints' / 'step_0000002'}"])
    return read_metrics(out)


def test_two_tasks_resumed(tiny_model, arith_data, pairs_data, tmp_path):  # noqa: F811
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = [*SAMPLED, "trainer.total_steps=4", "multitask.combine=alternating", "multitask.weighting=auto",
              "multitask.auto_min_history=2"]
    run_train(2, multitask_overrides(tiny_model, arith_data, pairs_data, full, *common))
    b = _resume_from_step_2(full, resumed, multitask_overrides(tiny_model, arith_data, pairs_data, resumed, *common))
    assert [r["step"] for r in b] == [3, 4]
    assert assert_same_steps(read_metrics(full), b, [3, 4], "resumed run") > 40


def test_ppo_with_critic_resumed(tiny_model, arith_data, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # the gathered optimizer format here (the other tests use the default per-rank one), actor and critic
    common = ["experiment=ppo_critic", "trainer.prompts_per_step=4", "critic.lr=1e-4", "actor.lr=1e-4", *SAMPLED,
              "trainer.total_steps=4", "trainer.checkpoint_reshardable=true"]
    run_train(2, tiny_overrides(tiny_model, arith_data, str(full)) + common)
    b = _resume_from_step_2(full, resumed, tiny_overrides(tiny_model, arith_data, str(resumed)) + common)
    a = read_metrics(full)
    assert [r["step"] for r in b] == [3, 4]
    assert assert_same_steps(a, b, [3, 4], "resumed run") > 40
    assert any(k.startswith("critic/") for k in compared_keys(a[2]))
