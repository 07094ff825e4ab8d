"""tools/bench_throughput.py multitask runs end to end on CPU: the multi-task recipe on the tiny random model and
each task alone, 2 steps each. Checks that every figure is present and consistent (the separate sums are the
sums of the single-task figures), that each run did what it is reported as (2 steps; both tasks trained in the
multi-task run, one in each single-task run), and that two separate pipelines hold more memory than one (each
is a process with its own Python, torch and SGLang engine: the sum of two is well above one run's peak, on CPU
as on GPU); no timing is asserted (benchmarks are not tests)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_multitask_bench_reports_time_and_memory(tmp_path):
    from mcore_rl.data.synthetic import make_arithmetic_rows, make_safety_rows, write_jsonl
    from mcore_rl.testing import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "tiny", "qwen2", seed=3)
    arith = write_jsonl(make_arithmetic_rows(16, seed=0, max_digits=1, operators="+"), tmp_path / "a.jsonl")
    pairs = write_jsonl(make_safety_rows(16, seed=0), tmp_path / "p.jsonl")
    out = tmp_path / "bench.json"
    overrides = [f"model.path={model}", "model.dtype=fp32", "model.max_seq_len=256", "rollout.max_new_tokens=8",
                 "rollout.max_total_tokens=4096", "rollout.show_progress=false", f"tasks.0.data.train_files=[{arith}]",
                 f"tasks.1.data.train_files=[{pairs}]", "tasks.0.reward.name=function",
                 "tasks.0.reward.function_path=tests.trainer.reward_fns:text_length", "tasks.0.batch_size=2",
                 "tasks.1.batch_size=2"]
    cmd = [sys.executable, str(ROOT / "tools" / "bench_throughput.py"), "--json", str(out), "multitask",
           "--steps", "2", "--nproc", "1", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    f = json.loads(out.read_text())
    for key in ("step_s", "peak_rss_gb"):
        for run in ("", "arithmetic_", "safety_"):
            v = f[f"multitask.{run}{key}"]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (run, key, v)
        assert f[f"multitask.separate_{key}"] == pytest.approx(f[f"multitask.arithmetic_{key}"]
                                                               + f[f"multitask.safety_{key}"])
    assert f["multitask.step_ratio_vs_separate"] == pytest.approx(f["multitask.step_s"] / f["multitask.separate_step_s"])
    assert f["multitask.memory_ratio_vs_separate"] == pytest.approx(
        f["multitask.peak_rss_gb"] / f["multitask.separate_peak_rss_gb"])
    assert "multitask.step_ratio_vs_separate" in proc.stdout  # the table
    for run, tasks in (("", 2.0), ("arithmetic_", 1.0), ("safety_", 1.0)):
        assert f[f"multitask.{run}steps_logged"] == 2.0, (run, f)
        assert f[f"multitask.{run}tasks_trained"] == tasks, (run, f)
    # one actor and reference instead of two, in one process instead of two: a ratio near 0.5 on CPU (each run's
    # peak is mostly the process itself); a benchmark that measured the same run three times would give 0.5 too,
    # which the task counts above rule out
    assert f["multitask.memory_ratio_vs_separate"] < 0.8, f
