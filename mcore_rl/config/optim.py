"""Optimizer and learning-rate schedule of one trained model (actor or critic), as the engine consumes them.

Adam(W) through Megatron-Core's optimizer (distributed optimizer with fp32 master weights by default) and
Megatron's OptimizerParamScheduler. The schedule counts optimizer steps: optimizer step k (0-based) runs at

    k < lr_warmup_steps:  lr_warmup_init + (lr - lr_warmup_init) * k / lr_warmup_steps
    afterwards:           lr (constant), or decayed to min_lr at step lr_decay_steps (cosine / linear)

which is Megatron's convention (with the default lr_warmup_init=0 the first warmup step has lr 0).

The actor's and critic's run configs (config/rl.py ActorConfig, CriticConfig) are OptimConfigs with their own
fields added, so every field here can be set from YAML as `actor.<field>` / `critic.<field>`, and the errors name
the section the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY_STYLES = ("constant", "cosine", "linear")
FAST_OPTIMIZER = ("auto", "on", "off")


@dataclass
class OptimConfig:
    _SECTION = "optim"  # the config section errors name (ActorConfig: actor, CriticConfig: critic)
    _REQUIRE_DECAY_STEPS = True  # run configs leave lr_decay_steps to the trainer (the run length)

    lr: float = 1e-6
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Floor of the cosine / linear decay, in [0, lr] (unused with lr_decay_style=constant)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; Megatron skips biases and norm weights."""
    adam_beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean, in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam's decay rate of the squared gradient's running mean, in [0, 1); lower (e.g. 0.95) reacts faster to
    changes of gradient scale, as many RL recipes use."""
    adam_eps: float = 1e-8
    """Adam's epsilon added to the denominator (> 0): bounds the step of parameters with tiny gradients."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over all TP / PP / DP shards) to this; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from lr_warmup_init to lr (0 = start at lr)."""
    lr_warmup_init: float = 0.0
    """Learning rate of the first warmup step (in [0, lr]; with the default 0 the first warmup step has lr 0)."""
    lr_decay_style: str = "constant"
    """constant | cosine | linear (from the end of warmup to lr_decay_steps)."""
    lr_decay_steps: int | None = None
    """Optimizer step at which the decay reaches min_lr; needed for cosine / linear. In a run config null means
    the end of the run (trainer.total_steps x optimizer updates a step), filled in by the trainer."""
    use_distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam state over data-parallel ranks (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even when the weights are bf16."""
    fast_optimizer: str = "auto"
    """auto | on | off. Without Transformer Engine / apex: torch's fused AdamW kernel and single-call foreach
    versions of Megatron's pure-Python multi-tensor fallbacks (grad norm without a host sync per tensor;
    engine/fast_optim.py). auto = on when the model is on a GPU; off = Megatron's optimizer as shipped."""

    def __post_init__(self):
        sec = self._SECTION
        if self.lr <= 0:
            raise ValueError(f"{sec}.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"{sec}.min_lr ({self.min_lr}) must be in [0, lr ({self.lr})]")
        if self.weight_decay < 0:
            raise ValueError(f"{sec}.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{sec}.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"{sec}.adam_eps must be positive, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"{sec}.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"{sec}.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"{sec}.lr_warmup_init ({self.lr_warmup_init}) must be in [0, lr ({self.lr})]")
        if self.fast_optimizer not in FAST_OPTIMIZER:
            raise ValueError(f"{sec}.fast_optimizer must be one of {FAST_OPTIMIZER}, got {self.fast_optimizer!r}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"{sec}.lr_decay_style must be one of {DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None and self._REQUIRE_DECAY_STEPS:
                raise ValueError(
                    f"{sec}.lr_decay_style={self.lr_decay_style} needs {sec}.lr_decay_steps (the step at which "
                    "the learning rate reaches min_lr)"
                )
            if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
                raise ValueError(
                    f"{sec}.lr_decay_steps ({self.lr_decay_steps}) must be larger than {sec}.lr_warmup_steps "
                    f"({self.lr_warmup_steps})"
                )
