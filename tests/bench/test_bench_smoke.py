"""tools/bench_throughput.py runs end to end on CPU: `all` on the tiny random model (dense, and the tiny Qwen3-MoE
of the MoE figures) with minimal sizes, in one subprocess (one SGLang engine shared by rollout, weight_sync in
every layout, and e2e). Checks only that every
figure the docs name is present, finite and positive; benchmarks are not tests, so no timing is asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.net import free_port

ROOT = Path(__file__).resolve().parents[2]

KEYS = [
    "train.ratio_vs_raw", "train.tokens_per_s", "train.raw_tokens_per_s", "train.packed_vs_padded",
    "rollout.tokens_per_s", "rollout.raw_tokens_per_s", "rollout.ratio_vs_raw",
    "weight_sync.seconds", "weight_sync.copy_seconds", "weight_sync.gb_per_s", "weight_sync.ratio_vs_copy",
    "weight_sync.hf.seconds", "weight_sync.hf.ratio_vs_copy", "weight_sync.hf.export_seconds_per_gb",
    "weight_sync.engine.seconds", "weight_sync.engine.ratio_vs_copy", "weight_sync.engine.export_seconds_per_gb",
    "weight_sync.shared.seconds", "weight_sync.shared.ratio_vs_copy",
    "e2e.step_s", "e2e.raw_parts_s", "e2e.ratio_vs_raw_parts", "e2e.rollout_s", "e2e.ref_logprobs_s",
    "e2e.update_s", "e2e.sync_s", "e2e.raw_rollout_s", "e2e.raw_update_s", "e2e.raw_sync_s",
    "e2e.raw_forward_s", "e2e.raw_parts_same_work_s", "e2e.ratio_same_work",
]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_all_writes_every_figure(tmp_path, model):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_throughput.py"), "--json", str(out), "all",
           "--model", model, "--train-model", model, "--seq-len", "32", "--tokens", "128", "--iters", "1",
           "--train-warmup", "1", "--prompts", "2", "--n", "2", "--prompt-len", "4", "--max-new-tokens", "4",
           "--repeats", "1", "--warmup", "1", "--max-total-tokens", "2048", "--sync-layout", "all"]
    # the dense run computes the reference log-probs in the update (the trainer's ref.compute_at=update); the MoE
    # one keeps auto, which computes them before it (no graphs)
    in_update = model == "tiny"
    cmd += ["--ref-compute-at", "update"] if in_update else []
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    figures = json.loads(out.read_text())
    assert figures["e2e.ref_in_update"] is in_update
    if in_update:  # the update's time holds the reference's pass
        assert figures["e2e.ref_logprobs_s"] == 0
    bad = {k: figures.get(k) for k in KEYS if not (in_update and k == "e2e.ref_logprobs_s")
           if not isinstance(figures.get(k), (int, float)) or not math.isfinite(figures[k]) or figures[k] <= 0}
    assert not bad, f"missing, non-finite or non-positive figures: {bad}"
    assert figures["weight_sync.tp"] == 1 and figures["e2e.new_tokens"] == 2 * 2 * 4
    # what the layer spec resolved to is recorded (CPU: SDPA, and Megatron's sequential experts for the MoE)
    assert figures["train.core_attention"] == "SDPAttention"
    assert figures["train.experts"] == ("SequentialMLP" if model == "tiny-moe" else "dense")
    # every layout measured; at TP=1 the trainer (auto) picks the shared one, in weight_sync and in e2e alike
    assert figures["weight_sync.layout"] == "shared" and figures["e2e.sync_layout"] == "shared"
    assert figures["weight_sync.export_seconds_per_gb"] is None  # the shared layout exports nothing
    # e2e's step is one update from the whole batch: --old-logprobs auto (the default) skips that forward
    assert figures["e2e.old_logprobs_mode"] == "skip" and figures["e2e.old_logprobs_s"] == 0
    # the same work on the raw side: one forward pass (the reference's), outside raw_parts_s (one repeat, so the
    # medians are the single values)
    assert figures["e2e.raw_forward_passes"] == 1
    assert figures["e2e.raw_parts_same_work_s"] == pytest.approx(figures["e2e.raw_parts_s"]
                                                                 + figures["e2e.raw_forward_s"])
    assert "rollout.ratio_vs_raw" in proc.stdout  # the table


def test_e2e_one_step_off_policy_writes_its_figures(tmp_path):
    """e2e --rollout-mode one_step_off_policy (the next batch generated on a thread while the step trains), with
    --profile: one more step of each side under torch.profiler, per-phase times and the operator tables; and
    --forward-cuda-graphs both: eager and graphed steps interleaved (here, without a GPU, the graphs' fixed layout
    run eagerly), each with its own figures against the same raw parts."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_throughput.py"), "--json", str(out), "e2e",
           "--model", "tiny", "--prompts", "2", "--n", "2", "--prompt-len", "4", "--max-new-tokens", "4",
           "--repeats", "2", "--warmup", "1", "--max-total-tokens", "2048", "--rollout-mode", "one_step_off_policy",
           "--profile", str(tmp_path / "prof"), "--forward-cuda-graphs", "both", "--old-logprobs", "recompute",
           "--sync-debug"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    figures = json.loads(out.read_text())
    assert figures["e2e.rollout_mode"] == "one_step_off_policy"
    assert figures["e2e.new_tokens"] == 2 * 2 * 4
    for key in ("e2e.step_s", "e2e.ratio_vs_raw_parts", "e2e.update_s", "e2e.sync_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures.get(key))
    assert figures["e2e.sync_wait_s"] >= 0 and figures["e2e.rollout_s"] >= 0
    assert not any(k.startswith("e2e.sync_debug.") for k in figures)  # --sync-debug counts CUDA syncs: GPU only
    # both: the graphed steps' own figures, against the same raw parts; both sides ran both forward passes
    assert figures["e2e.forward_cuda_graphs"] == "both" and figures["e2e.graphs.captures"] == 0  # none on CPU
    # old log-probs recomputed: the reference feeds more than the loss, so auto computes it before the update
    assert figures["e2e.ref_in_update"] is False and figures["e2e.graphs.ref_in_update"] is False
    for prefix in ("e2e.", "e2e.graphs."):
        for part in ("step", "old_logprobs", "ref_logprobs", "update", "sync"):
            assert math.isfinite(figures[f"{prefix}{part}_s"]) and figures[f"{prefix}{part}_s"] > 0, (prefix, part)
        assert figures[f"{prefix}ratio_vs_raw_parts"] == pytest.approx(figures["e2e.raw_parts_s"]
                                                                       / figures[f"{prefix}step_s"])
        assert figures[f"{prefix}ratio_same_work"] == pytest.approx(figures["e2e.raw_parts_same_work_s"]
                                                                    / figures[f"{prefix}step_s"])
    # reference and recomputed old log-probs: two raw forward passes in the same-work figure
    assert figures["e2e.raw_forward_passes"] == 2 and figures["e2e.raw_forward_s"] > 0
    assert figures["e2e.raw_parts_same_work_s"] > figures["e2e.raw_parts_s"]
    # the profiled step: every phase of both sides timed (no GPU here, so no kernel time)
    for key in ("rollout", "update", "sync", "raw_rollout", "raw_update", "raw_sync", "raw_forward"):
        assert figures[f"e2e.profile.{key}.wall_s"] > 0, key
        assert figures[f"e2e.profile.{key}.device_busy_s"] == 0, key
    tables = (tmp_path / "prof" / "e2e_profile.txt").read_text()
    assert "==== ours" in tables and "==== raw" in tables and "e2e.update: wall" in tables


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_checkpoint_writes_its_figures(tmp_path, model):
    """checkpoint: both optimizer formats and torch.save of the same tensors timed; sizes of what each wrote (the
    checkpoints hold what torch.save holds, plus Megatron's metadata and, in fp32, model and main params alike)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "tools" / "bench_throughput.py"), "--json", str(out), "checkpoint",
           "--model", model, "--dtype", "fp32", "--repeats", "1", "--dir", str(tmp_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    figures = json.loads(out.read_text())
    for key in ("checkpoint.save_s", "checkpoint.reshardable.save_s", "checkpoint.torch_save_s",
                "checkpoint.ratio_vs_torch_save", "checkpoint.reshardable.ratio_vs_torch_save", "checkpoint.gb_per_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures.get(key))
    # every parameter and Adam moment is in each checkpoint: at least torch.save's bytes (4 bytes an element)
    assert figures["checkpoint.torch_save_bytes"] >= 4 * 3 * figures["checkpoint.params"]
    for key in ("checkpoint.bytes", "checkpoint.reshardable.bytes"):
        assert figures[key] >= figures["checkpoint.torch_save_bytes"], (key, figures)
    assert list(tmp_path.glob("bench_ckpt_*")) == []  # the scratch folder is removed
