"""Weight sync: how the actor's weights reach the rollout engine after each update (mcore_rl.weight_sync,
docs/rollout.md). `weight_sync:` at the top of the run config; conf/weight_sync/default.yaml is the Hydra group.
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORTS = ("tensor", "distributed", "disk")
LAYOUTS = ("auto", "hf", "engine", "shared")


@dataclass
class WeightSyncConfig:
    transport: str = "tensor"
    """How the weights travel. tensor: the engine shares this host and process group's first GPU (colocated), and
    takes tensors handed over in-process (CUDA IPC / shared memory). distributed: the engine runs on its own GPUs
    and receives the buckets by broadcast over a process group with trainer rank 0. disk: the actor is written as
    an HF folder under trainer.output_dir/scratch and the engine reloads it (slow; a fallback)."""
    layout: str = "auto"
    """What a colocated sync (transport=tensor) hands the engine. engine: SGLang's own parameters (fused
    qkv_proj / gate_up_proj, padded vocabulary) copied as they are (verified for Llama / Mistral / Qwen2 / Qwen3;
    needs rollout.tp_size=1, an unquantized model and an engine we launch). hf: HF names, mapped by SGLang's
    model.load_weights (any model, slower). shared: the engine keeps handles to the trainer's own parameters (CUDA
    IPC) and copies them into its layout at each sync: no export, no buckets (needs what engine needs plus an
    actor at parallel.tp=1 and parallel.pp=1). auto: shared, else engine, else hf, whichever is possible first
    (logged once with the reason). Other transports always use hf."""
    bucket_mb: int = 512
    """Bound of one bucket of exported tensors (MiB): larger buckets mean fewer calls into the engine and more
    memory held during a sync. A single parameter larger than this gets a bucket of its own."""

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"weight_sync.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout in ("engine", "shared") and self.transport != "tensor":
            raise ValueError(f"weight_sync.layout={self.layout} is for colocated syncs and needs "
                             f"weight_sync.transport=tensor, got transport={self.transport}: set "
                             "weight_sync.layout=auto (hf for this transport) or hf")
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb must be >= 1, got {self.bucket_mb}")

    @property
    def engine_loaders(self) -> bool:
        """Whether the rollout engine must be started with our weight loaders (RolloutEngine(weight_loaders=...)):
        the engine and shared layouts need them; hf does without."""
        return self.layout != "hf"
