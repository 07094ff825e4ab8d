"""Multi-task runs of tools/train_ppo.py (experiment=multitask_grpo_dpo) on the tiny random model, with real
Megatron-Core, real SGLang and gloo on CPU: a GRPO task (text-length reward, which a random model can move) and
a DPO task on synthetic safety pairs train one actor.

What "both task losses improve" means here. With actor.ppo_epochs=2 each step scores every task's batch before
the first and before the second combined update; the combined update (both tasks' clipped gradients, weighted)
must lower each task's own loss on its batch: `loss/last_epoch < loss/first_epoch` for both tasks, every step.
Across steps the DPO loss must fall from log 2 (the actor starts as the reference). The GRPO task's surrogate
loss is zero-mean by construction, so across steps it is judged by the per-step check above, and by its
rollouts staying consistent with the actor (SGLang log-probs == Megatron's within 1e-4 after every sync,
which the DPO updates change too).
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.parallel import launcher
from tests.trainer.conftest import read_metrics, run_train

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="session")
def pairs_data(tmp_path_factory):
    from mcore_rl.data.synthetic import make_safety_rows, write_jsonl

    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    write_jsonl(make_safety_rows(32, seed=0), path)
    return str(path)


def overrides(model, arith, pairs, out, *extra):
    return ["experiment=multitask_grpo_dpo", f"model.path={model}", "model.dtype=fp32", "model.max_seq_len=256",
            f"trainer.output_dir={out}", "rollout.max_new_tokens=12", "rollout.max_total_tokens=4096",
            "rollout.show_progress=false", "actor.lr=1e-4", "trainer.export_hf=false",
            f"tasks.0.data.train_files=[{arith}]", f"tasks.1.data.train_files=[{pairs}]",
            "tasks.0.reward.name=function", "tasks.0.reward.function_path=tests.trainer.reward_fns:text_length",
            "tasks.0.batch_size=2", "tasks.1.batch_size=4", *extra]


def test_two_tasks_improve_together_with_kl_monitor(tiny_model, arith_data, pairs_data, tmp_path):
    out = tmp_path / "run"
    run_train(2, overrides(tiny_model, arith_data, pairs_data, out, "trainer.total_steps=3", "actor.ppo_epochs=2",
                           "multitask.kl_target=1e-4", "multitask.kl_lr_decay=0.5"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for task in ("arithmetic", "safety"):
            p = f"task/{task}/"
            assert r[p + "trained"] == 1.0 and r[p + "weight"] == 1.0 and r[p + "coef"] == 0.5
            assert r[p + "grad_norm"] > 0 and 0 < r[p + "clip_coef"] <= 1
            assert r[p + "loss/last_epoch"] < r[p + "loss/first_epoch"], (task, r["step"])
        assert r["task/arithmetic/rollout/logprob_diff_max"] < LOGPROB_TOL
        assert r["task/arithmetic/reward/mean"] is not None and r["memory/peak_rss_gb"] > 0
    dpo = [r["task/safety/dpo/loss"] for r in rows]
    assert dpo[0] < math.log(2) and dpo[0] > dpo[1] > dpo[2]  # epoch 1 of step 1 is log 2; the mean is below
    assert rows[0]["task/safety/loss/first_epoch"] == pytest.approx(math.log(2), abs=1e-6)
    # KL monitor: step 1 starts at the reference (KL 0, no decay); afterwards KL > 1e-4 halves the LR each step
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and rows[0]["actor/lr_multiplier"] == 1.0
    assert [r["actor/lr_multiplier"] for r in rows[1:]] == [0.5, 0.25]
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-4, 1e-4, 5e-5])  # the LR each step's update used
    # TensorBoard has the per-task tags
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()["scalars"]
    assert {"task/arithmetic/reward/mean", "task/safety/dpo/loss", "task/safety/weight"} <= set(tags)


def _expected_schedule(rows, names, base, window, min_history, lo, hi, smoothing):
    """Independent re-implementation of the documented rule (docs/algorithms.md), replayed on the logged
    losses: which task trains each step and the weights each step starts with."""
    weights, credits, hist = list(base), [0.0] * len(names), [[] for _ in names]
    picks, logged = [], []
    for r in rows:
        logged.append(list(weights))
        for i in range(len(names)):
            credits[i] += weights[i]
        pick = max(range(len(names)), key=lambda i: (credits[i], -i))
        credits[pick] -= sum(weights)
        picks.append(pick)
        hist[pick] = (hist[pick] + [r[f"task/{names[pick]}/loss"]])[-window:]
        if all(len(h) >= min_history for h in hist):
            stds = [math.sqrt(sum((x - sum(h) / len(h)) ** 2 for x in h) / len(h)) for h in hist]
            mean = sum(stds) / len(stds)
            target = list(base) if mean == 0 else [b * min(max(s / mean, lo), hi) for b, s in zip(base, stds)]
            weights = [smoothing * w + (1 - smoothing) * t for w, t in zip(weights, target)]
    return picks, logged


def test_alternating_auto_weights_follow_the_rule(tiny_model, arith_data, pairs_data, tmp_path):
    out = tmp_path / "alt"
    run_train(1, overrides(tiny_model, arith_data, pairs_data, out, "trainer.total_steps=7",
                           "multitask.combine=alternating", "multitask.weighting=auto", "multitask.auto_window=3",
                           "multitask.auto_min_history=2", "multitask.auto_min_multiplier=0.5",
                           "multitask.auto_max_multiplier=3", "multitask.auto_smoothing=0.5", "tasks.0.weight=2.0"))
    rows = read_metrics(out)
    names = ["arithmetic", "safety"]
    picks, weights = _expected_schedule(rows, names, [2.0, 1.0], 3, 2, 0.5, 3.0, 0.5)
    assert [[r[f"task/{n}/trained"] for n in names].index(1.0) for r in rows] == picks
    assert all(sum(r[f"task/{n}/trained"] for n in names) == 1.0 for r in rows)  # one task a step
    for r, w in zip(rows, weights):
        assert [r[f"task/{n}/weight"] for n in names] == pytest.approx(w, rel=1e-9)
    assert weights[-1] != pytest.approx([2.0, 1.0])  # the rule moved the weights within this run
    # only the task that trained draws data: rollouts only on GRPO steps
    for r, p in zip(rows, picks):
        assert (r.get("task/arithmetic/reward/mean") is not None) == (p == 0)


def test_one_actor_parameter_set(tiny_model, arith_data, pairs_data, tmp_path):
    out = tmp_path / "params"
    launcher.run_torchrun(Path(__file__).parent / "multitask_worker.py", 1, out,
                          *overrides(tiny_model, arith_data, pairs_data, tmp_path / "run"), timeout=900)
    r = json.loads((out / "params.json").read_text())
    assert r["num_tasks_trained"] == 2
    assert r["trainable_is_actor"] and r["num_trainable"] == r["num_actor"]
    assert r["trainable_elements"] == r["actor_elements"]
    assert not r["ref_trainable"], r["ref_trainable"]  # the reference's parameters that would train
    assert not r["ref_shares_actor_storage"]
    assert r["num_engines_with_optimizer"] == 1


def test_resume_restores_scheduler_and_kl_monitor(tiny_model, arith_data, pairs_data, tmp_path):
    """Stopped after step 2 and resumed: steps 3 and 4 equal the uninterrupted run's (1e-6; reasoning in
    test_resume.py). Alternating + auto weights + KL monitor, so the scheduler's credits, loss windows and
    weights and the LR multiplier all decide what steps 3-4 do. Greedy rollouts (sampled ones:
    tests/trainer/test_exact_resume.py)."""
    common = ["multitask.combine=alternating", "multitask.weighting=auto", "multitask.auto_min_history=2",
              "multitask.kl_target=1e-3", "rollout.temperature=0", "trainer.save_every=1", "trainer.keep_last=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_train(1, overrides(tiny_model, arith_data, pairs_data, full, "trainer.total_steps=4", *common))
    run_train(1, overrides(tiny_model, arith_data, pairs_data, part, "trainer.total_steps=2", *common))
    shutil.rmtree(part / "checkpoints" / "step_0000001")
    run_train(1, overrides(tiny_model, arith_data, pairs_data, part, "trainer.total_steps=4", "trainer.resume=auto",
                           *common))
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    compared = 0
    for step in (2, 3):
        # the same metrics, but for the start-up breakdown a run logs at its own first step (step 3 when resumed)
        assert {k for k in a[step] if not k.startswith("timing/startup/")} == \
            {k for k in b[step] if not k.startswith("timing/startup/")}, step
        for key, value in a[step].items():
            if key.startswith(("timing/", "throughput/", "weight_sync/gb_per_s", "rollout/engine_syncs",
                               "memory/")) or "/timing/" in key or "/throughput/" in key or value is None:
                continue
            assert b[step][key] == pytest.approx(value, abs=1e-6), (step + 1, key)
            compared += 1
    assert compared > 30
    assert a[3]["actor/lr_multiplier"] < 1.0  # the monitor had decayed the LR: its restore mattered
    state = json.loads((part / "checkpoints" / "step_0000004" / "state.json").read_text())
    assert state["scheduler"]["names"] == ["arithmetic", "safety"] and set(state["tasks"]) == {"arithmetic", "safety"}
