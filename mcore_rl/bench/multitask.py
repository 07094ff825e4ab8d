"""Multi-task cost: one run training two tasks on one actor against the two tasks run separately.

Three runs of tools/train_ppo.py under torchrun, one after another, on the same recipe and sizes:
the two-task run and each task alone (`multitask.only=[name]`). Each run's metrics.jsonl gives its step time
(median over steps 2.., the first step carries compile and cache warm-up) and its peak memory (trainer rank 0's
peak RSS, and the peak GPU allocation on CUDA). Two separate pipelines hold two actors, two references and two
optimizers at once, so their memory is the sum of the single-task runs'; their time per "step of both" is the sum
of their step times.

    multitask.step_s, multitask.<task>_step_s, multitask.separate_step_s (sum), multitask.step_ratio_vs_separate
    multitask.peak_rss_gb, multitask.separate_peak_rss_gb (sum), multitask.memory_ratio_vs_separate
    multitask.steps_logged, multitask.tasks_trained (and per task): what each run did, from its metrics
    (and the *_peak_gpu_gb figures on CUDA)

The runs need a checkout (tools/train_ppo.py and the recipes under conf/), which the caller names: `repo`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mcore_rl.net import free_port


def _run(repo: Path, nproc: int, overrides: list[str], out: Path, timeout: float) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(repo / "tools" / "train_ppo.py"), *overrides, f"trainer.output_dir={out}",
           "trainer.export_hf=false", "trainer.save_every=0", "logger.tensorboard=false"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"training run failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(rows: list[dict]) -> dict:
    timed = rows[1:] or rows
    out = {"step_s": statistics.median(r["timing/step_s"] for r in timed),
           "peak_rss_gb": max(r.get("memory/peak_rss_gb") or 0.0 for r in rows),
           "steps_logged": float(len(rows)),
           # tasks that trained in some step (task/<name>/trained): a run measured as "one task alone" that
           # trained both, or none, would make the comparison meaningless
           "tasks_trained": float(len({k.split("/")[1] for r in rows for k, v in r.items()
                                       if k.startswith("task/") and k.endswith("/trained") and v}))}
    gpu = [r["memory/peak_gpu_gb"] for r in rows if r.get("memory/peak_gpu_gb") is not None]
    if gpu:
        out["peak_gpu_gb"] = max(gpu)
    return out


def configured_tasks(repo: Path, experiment: str, overrides: list[str]) -> list[str]:
    """The task names the experiment (with the overrides) trains."""
    from hydra import compose, initialize_config_dir

    from mcore_rl.config.root import register, to_object

    register()
    with initialize_config_dir(config_dir=str(Path(repo).resolve() / "conf"), version_base=None):
        cfg = to_object(compose("config", overrides=[f"experiment={experiment}", *overrides]))
    return [t.name for t in cfg.tasks]


def run(repo: str | os.PathLike, experiment: str, steps: int, nproc: int, overrides: list[str],
        timeout: float = 3600) -> dict:
    """Figures of the multi-task run against each task alone (keys in the module docstring). repo: the checkout
    whose tools/train_ppo.py runs and whose conf/ holds the recipe."""
    repo = Path(repo)
    task_names = configured_tasks(repo, experiment, overrides)
    if len(task_names) < 2:
        raise ValueError(f"the multitask benchmark needs at least two tasks, got {task_names}")
    common = [f"experiment={experiment}", f"trainer.total_steps={steps}", *overrides]
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_multitask_") as tmp:
        together = _summary(_run(repo, nproc, common, Path(tmp) / "together", timeout))
        alone = {name: _summary(_run(repo, nproc, common + [f"multitask.only=[{name}]"], Path(tmp) / name, timeout))
                 for name in task_names}
    for key, value in together.items():
        res[f"multitask.{key}"] = value
    for name, figures in alone.items():
        for key, value in figures.items():
            res[f"multitask.{name}_{key}"] = value
    for key in ("step_s", "peak_rss_gb", "peak_gpu_gb"):  # not the counts: they are checked, not summed
        if key in together and all(key in f for f in alone.values()):
            res[f"multitask.separate_{key}"] = sum(f[key] for f in alone.values())
    res["multitask.step_ratio_vs_separate"] = together["step_s"] / res["multitask.separate_step_s"]
    res["multitask.memory_ratio_vs_separate"] = together["peak_rss_gb"] / res["multitask.separate_peak_rss_gb"]
    if "multitask.separate_peak_gpu_gb" in res:
        res["multitask.gpu_memory_ratio_vs_separate"] = together["peak_gpu_gb"] / res["multitask.separate_peak_gpu_gb"]
    res["multitask.steps"] = steps
    res["multitask.nproc"] = nproc
    return res
