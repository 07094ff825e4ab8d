"""Run-level settings: steps, batch size, output, checkpoints, resume and logging."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerConfig:
    total_steps: int = 10
    prompts_per_step: int = 8
    """Prompts drawn per RL step; each gets algorithm.n_samples_per_prompt responses."""
    output_dir: str = "outputs/run"
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted after a newer one is complete)."""
    resume: str = "never"
    """never | auto (latest checkpoint in output_dir, if any) | a checkpoint folder."""
    export_hf: bool = True
    """Write the final actor as an HF checkpoint to output_dir/hf."""
    seed: int = 42
    deterministic: bool = False
    """Deterministic torch algorithms (CPU resume tests)."""
    weight_sync: str = "tensor"
    """How weights reach the rollout engine: tensor (colocated), distributed, disk."""
    weight_sync_bucket_mb: int = 512

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.weight_sync not in ("tensor", "distributed", "disk"):
            raise ValueError(f"trainer.weight_sync must be tensor, distributed or disk, got {self.weight_sync!r}")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    wandb: bool = False
    """Log to Weights & Biases when the wandb package is installed (silently off otherwise, with a warning)."""
    wandb_project: str = "mcore-rl"
    run_name: str | None = None
    progress_bar: bool = True
