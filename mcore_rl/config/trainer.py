"""Run-level settings: steps, batch size, output, checkpoints, resume and logging."""

from __future__ import annotations

from dataclasses import dataclass, field


ROLLOUT_MODES = ("sync", "one_step_off_policy", "async")


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
    checkpoint_reshardable: bool = False
    """false (default): each rank writes its optimizer shard as it is (Megatron's dp_reshardable), about 4x faster
    to save and never gathered on one rank; the run resumes at the same TP / PP / EP layout, any DP size (another
    layout is refused with an error saying to save with true). true: the optimizer state is gathered on each DP
    group's first rank, in CPU memory, and written per parameter (fully_reshardable), so a resume may change any
    of TP / PP / EP / DP. Both resume bit-exactly at the same layout (tests/trainer/test_exact_resume.py;
    docs/reliability.md).
    Weights reshard either way (tools/convert_hf.py, a reference model from a checkpoint)."""
    resume: str = "never"
    """never | auto (the latest complete checkpoint under output_dir/checkpoints, if any; else a fresh start) | a
    checkpoint folder (one with a state.json)."""
    export_hf: bool = True
    """Write the final actor as an HF checkpoint to output_dir/hf."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): bit-reproducible trainer kernels (the CPU resume tests), at
    some speed; ops without a deterministic version then raise. SGLang's sampling: rollout.deterministic."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals on which the run finishes its current step, saves a checkpoint and exits with status 80
    (mcore_rl.procs.STOPPED_EXIT_CODE); trainer.resume=auto continues from there. SIGTERM is what SLURM and
    Kubernetes send before they kill; add SIGUSR1 for a scheduler that warns ahead of the end of a job (and
    tell torchrun to pass it on: --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1). The step and the
    save must fit in torchrun's --shutdown-timeout (default 30 s) and the scheduler's grace period. [] = off
    (the signal's default action: the run dies, losing the steps since its last checkpoint)."""
    on_nonfinite: str = "stop"
    """What a step does when an update's gradient norm is inf or nan (a diverged loss: too high a learning rate,
    rewards on a scale that overflows). The update is never applied. stop: the run ends with exit status 1 and a
    line naming the step, the model (actor / critic) and its loss and gradient norm; the last checkpoint is
    untouched (trainer.resume=auto continues from it). skip: the update is skipped, counted in
    actor/nonfinite_updates (critic/...), and the run goes on."""

    rollout_mode: str = "sync"
    """When rollouts are generated (docs/async.md). sync: each step generates its batch, trains on it, then
    pushes the weights. one_step_off_policy: the batch of step k+1 is generated with the weights step k trains
    from, while step k trains (each batch one version behind; generation and training overlap). async: the
    rollout engine runs up to trainer.max_staleness batches ahead, and a weight sync interrupts what is in flight
    as trainer.partial_rollouts says. In both asynchronous modes the samples record the weight versions that
    generated them and the loss can correct for the gap (actor.off_policy_correction)."""
    max_staleness: int = 1
    """rollout_mode=async: a sample is trained on only if the weights that generated its oldest token are at most
    this many versions behind the trainer's; the engine starts no batch that would break it, and a sample that
    does (a queue from a checkpoint of a run with a larger bound) is dropped and counted (async/dropped_stale).
    one_step_off_policy is 1."""
    partial_rollouts: str = "finish"
    """rollout_mode=async: what a weight sync does to a generation in flight. finish: the sync waits for it, so
    every sample comes from one version. continue: it is interrupted, the weights are pushed, and each
    unfinished sample goes on from its prefix with the new weights (its tokens then have several versions:
    Sample.versions). one_step_off_policy always finishes."""

    def __post_init__(self):
        if self.rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"trainer.rollout_mode must be one of {ROLLOUT_MODES}, got {self.rollout_mode!r}")
        if self.max_staleness < 1:
            raise ValueError(f"trainer.max_staleness must be >= 1 (a batch generated while the previous one trains "
                             f"is already one version behind), got {self.max_staleness}; for on-policy batches use "
                             "trainer.rollout_mode=sync")
        if self.partial_rollouts not in ("finish", "continue"):
            raise ValueError(f"trainer.partial_rollouts must be finish or continue, got {self.partial_rollouts!r}")
        if self.total_steps < 1:
            raise ValueError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {self.keep_last}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"trainer.on_nonfinite must be stop or skip, got {self.on_nonfinite!r}")
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
    level: str = "info"
    """What the console shows (mcore_rl/console.py). info: our lines (start-up summary, one line per step,
    checkpoints, errors) and progress bars; the libraries' Python warnings, Megatron's INFO records and SGLang's
    log lines below rollout.log_level (error, unless set) are filtered at their source. verbose: everything the
    libraries print, SGLang at info (its ServerArgs dump, model-import notes)."""

    def __post_init__(self):
        from mcore_rl.console import check_level

        check_level(self.level)
