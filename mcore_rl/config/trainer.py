"""Run-level settings: steps, batch size, output, checkpoints, resume and logging."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainerConfig:
    total_steps: int = 10
    """Training steps of the run (each: rollouts, then the updates); the LR schedule's default decay end
    (actor / critic.lr_decay_steps=null) follows it. A resumed run continues to the same total."""
    prompts_per_step: int = 8
    """Prompts drawn per RL step over all data-parallel ranks; each gets algorithm.n_samples_per_prompt responses.
    Runs without `tasks` only: with tasks, each task draws tasks[i].batch_size."""
    output_dir: str = "outputs/run"
    """Folder of everything the run writes: metrics.jsonl, tensorboard/, checkpoints/, hf/ (the exported actor),
    scratch/ (weight_sync.transport=disk) and Hydra's files. trainer.resume=auto looks here."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted after a newer one is complete)."""
    resume: str = "never"
    """never | auto (the latest complete checkpoint under output_dir/checkpoints, if any; else a fresh start) | a
    checkpoint folder (one with a state.json)."""
    export_hf: bool = True
    """Write the final actor as an HF checkpoint to output_dir/hf."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): bit-reproducible trainer kernels (the CPU resume tests), at
    some speed; ops without a deterministic version then raise. SGLang's sampling is not covered."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals on which the run finishes its current step, saves a checkpoint and exits with status 80
    (mcore_rl.procs.STOPPED_EXIT_CODE); trainer.resume=auto continues from there. SIGTERM is what SLURM and
    Kubernetes send before they kill; add SIGUSR1 for a scheduler that warns ahead of the end of a job (and
    tell torchrun to pass it on: --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1). The step and the
    save must fit in torchrun's --shutdown-timeout (default 30 s) and the scheduler's grace period. [] = off
    (the signal's default action: the run dies, losing the steps since its last checkpoint)."""

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {self.keep_last}")
        import signal

        for name in self.stop_signals:
            if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"trainer.stop_signals: {name!r} is not a signal that can be caught; use names "
                                 "such as SIGTERM, SIGUSR1, SIGUSR2")


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    """Write TensorBoard events to trainer.output_dir/tensorboard (metrics.jsonl is written either way)."""
    wandb: bool = False
    """Log to Weights & Biases when the wandb package is installed (silently off otherwise, with a warning)."""
    wandb_project: str = "mcore-rl"
    """wandb project the run is logged to (with wandb=true)."""
    run_name: str | None = None
    """wandb run name; null lets wandb pick one."""
