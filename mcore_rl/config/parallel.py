"""Parallel layout: tensor, pipeline, expert and data parallel sizes (data parallel is what is left of the world)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size: attention heads, query groups and the vocabulary are split this many ways."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule; needs pp > 1); null for the plain 1F1B schedule."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): the experts of every MoE layer are split this many ways.
    Must divide the number of experts and world size / (etp x pp). Expert parallelism takes its ranks from the
    data-parallel (and tensor-parallel) ranks of the dense layers: attention stays data parallel over them."""
    etp: int | None = None
    """Expert tensor-parallel size: each expert's matrices are split this many ways; null = parallel.tp."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs Transformer Engine or apex norms; ignored at tp=1)."""
    seed: int = 1234
    """Seed of torch and Megatron's model-parallel RNG tracker (dropout, initialisation of weights not in the
    checkpoint, e.g. the critic's value head). The run's only trainer seed: SGLang's sampling is seeded by
    rollout.random_seed, the prompt order by data.seed."""
    distributed_timeout_minutes: int = 30
    """torch.distributed timeout, in minutes: how long a collective may wait for a stuck peer before the run
    fails. Raise it when a rank legitimately waits long (e.g. for a slow rollout or checkpoint on another rank)."""
    watchdog_s: float = 3600.0
    """A worker stops (exit status 1) when one phase of a step (rollout, forward, update, weight sync, checkpoint,
    step end) has lasted this many seconds, with a line naming its rank, the phase and the step: a collective that
    waits for a rank that no longer answers ends here instead of hanging (mcore_rl/parallel/watchdog.py). Must
    exceed the longest legitimate phase, a rank's wait for rank 0's rollout included. 0 = off."""

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if name == "etp" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if not self.watchdog_s >= 0:
            raise ValueError(f"parallel.watchdog_s must be >= 0 seconds (0 = off), got {self.watchdog_s}")
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            raise ValueError(
                f"parallel.vpp ({self.vpp}) needs pipeline parallelism (parallel.pp > 1, got {self.pp}) "
                "and must be >= 1; set parallel.vpp=null otherwise"
            )
