"""Per-step metrics: one summary line on the console, metrics.jsonl, TensorBoard, and wandb when enabled.

Only global rank 0 writes. Values are plain floats (reduced across ranks by the caller, once per step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("mcore_rl")

# The keys shown on the console summary line, in order, with a short label.
SUMMARY = (
    ("reward/mean", "reward"),
    ("response_length/mean", "len"),
    ("kl", "kl"),
    ("actor/pg_loss", "pg"),
    ("actor/grad_norm", "gnorm"),
    ("critic/value_loss", "vloss"),
    ("rollout/logprob_diff", "lp_gap"),
    ("timing/step_s", "step_s"),
)

TASK_SUMMARY = ("/reward/mean", "/dpo/loss", "/weight")


class MetricsLogger:
    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool = True, wandb_cfg: dict | None = None,
                 resume_step: int = 0):
        self.enabled = enabled
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(output_dir) / "metrics.jsonl"
        if resume_step and self.path.exists():
            self._truncate_after(resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"), purge_step=resume_step + 1)
        if wandb_cfg is not None:
            try:
                import wandb
            except ImportError:
                log.warning("logger.wandb=true but wandb is not installed: pip install wandb; logging without it")
            else:
                self.wandb = wandb.init(**wandb_cfg)

    def _truncate_after(self, step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop them so metrics.jsonl has each step once."""
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and _step_of(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        try:
            append_whole(self.path, (json.dumps(row) + "\n").encode())
        except OSError as e:
            raise OSError(e.errno, f"could not append step {step} to {self.path}: {e.strerror}; free space in (or "
                          "choose another) trainer.output_dir") from e
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        parts = [f"step {step}"]
        for key, label in SUMMARY:
            if metrics.get(key) is not None:
                parts.append(f"{label} {metrics[key]:.4g}")
        for key in sorted(metrics):  # multi-task runs: each task's headline figures
            if key.startswith("task/") and key.endswith(TASK_SUMMARY) and metrics[key] is not None:
                parts.append(f"{key[len('task/'):]} {metrics[key]:.4g}")
        log.info(" | ".join(parts))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path`, all or nothing: a write that fails part-way (a full disk) is cut off again, so the
    file never ends in half a row."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):  # not a regular file (/dev/full): nothing to cut
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _step_of(line: str) -> float:
    """A row's step; a row cut short by an earlier crash counts as after every step (dropped on resume)."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf


def _clean(v):
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else v
