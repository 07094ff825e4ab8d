"""Optimizer and learning-rate schedule of one trained model (actor or critic), as the engine consumes them.

Adam(W) through Megatron-Core's optimizer (distributed optimizer with fp32 master weights by default) and
Megatron's OptimizerParamScheduler. The schedule counts optimizer steps: optimizer step k (0-based) runs at

    k < lr_warmup_steps:  lr_warmup_init + (lr - lr_warmup_init) * k / lr_warmup_steps
    afterwards:           lr (constant), or decayed to min_lr at step lr_decay_steps (cosine / linear)

which is Megatron's convention (with the default lr_warmup_init=0 the first warmup step has lr 0).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DECAY_STYLES = ("constant", "cosine", "linear")
FAST_OPTIMIZER = ("auto", "on", "off")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Floor of the cosine / linear decay."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; Megatron skips biases and norm weights."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP / PP / DP shards) to this; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr_warmup_init to lr."""
    lr_warmup_init: float = 0.0
    """Learning rate of the first warmup step."""
    lr_decay_style: str = "constant"
    """constant | cosine | linear (from the end of warmup to lr_decay_steps)."""
    lr_decay_steps: int | None = None
    """Optimizer step at which the decay reaches min_lr; needed for cosine / linear (the trainer sets it from
    the run length)."""
    use_distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam state over data-parallel ranks (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even when the weights are bf16."""
    fast_optimizer: str = "auto"
    """auto | on | off. Without Transformer Engine / apex: torch's fused AdamW kernel and single-call foreach
    versions of Megatron's pure-Python multi-tensor fallbacks (grad norm without a host sync per tensor;
    engine/fast_optim.py). auto = on when the model is on a GPU; off = Megatron's optimizer as shipped."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) must be in [0, lr ({self.lr})]")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"optim.adam_eps must be positive, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"optim.lr_warmup_init ({self.lr_warmup_init}) must be in [0, lr ({self.lr})]")
        if self.fast_optimizer not in FAST_OPTIMIZER:
            raise ValueError(f"optim.fast_optimizer must be one of {FAST_OPTIMIZER}, got {self.fast_optimizer!r}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"optim.lr_decay_style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None:
                raise ValueError(
                    f"optim.lr_decay_style={self.lr_decay_style} needs optim.lr_decay_steps (the step at which "
                    "the learning rate reaches min_lr)"
                )
            if self.lr_decay_steps <= self.lr_warmup_steps:
                raise ValueError(
                    f"optim.lr_decay_steps ({self.lr_decay_steps}) must be larger than optim.lr_warmup_steps "
                    f"({self.lr_warmup_steps})"
                )

    @classmethod
    def from_settings(cls, settings, **overrides) -> "OptimConfig":
        """Copy the fields of the same name from another config (e.g. config.rl.ActorConfig), then overrides."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        values.update(overrides)
        return cls(**values)
