"""Actor, critic, reference and algorithm settings of an RL run (see conf/{actor,critic,ref,algorithm}/)."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OLD_LOGPROBS = ("auto", "recompute", "rollout")


@dataclass
class OptimSettings:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_decay_style: str = "constant"
    """constant | cosine | linear, from the end of warmup to trainer.total_steps x updates a step."""
    fast_optimizer: str = "auto"
    """auto | on | off: fused AdamW and foreach multi-tensor paths when Transformer Engine / apex are absent
    (config/optim.py OptimConfig.fast_optimizer; auto = on GPUs)."""

    def __post_init__(self):
        if self.fast_optimizer not in ("auto", "on", "off"):
            raise ValueError(f"fast_optimizer must be auto, on or off, got {self.fast_optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_decay_style must be constant, cosine or linear, got {self.lr_decay_style!r}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")


@dataclass
class ActorConfig(OptimSettings):
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batch_size: int = 0
    """Samples (prompt x n) per optimizer step; 0 = the whole step's rollouts in one update."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro batch (dynamic batching); a longer single sequence gets its own."""
    forward_max_tokens_per_micro_batch: int = 0
    """Token budget of the micro batches of the forward-only passes (old and reference log-probs, values);
    0 = twice max_tokens_per_micro_batch. A forward pass keeps no activations for a backward, so larger micro
    batches fit, and fewer of them spend less host time launching kernels per token: at Qwen2.5-0.5B dims on
    an H200 the reference forward of 24.6k tokens in two micro batches was 56 ms of GPU work in 140 ms."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """clip-higher (DAPO): a larger high clip lets unlikely tokens gain probability."""
    clip_ratio_c: float | None = None
    """dual-clip bound for negative advantages (e.g. 3.0); None disables."""
    policy_loss: str = "ppo"
    """ppo | gspo | vanilla (registered names in mcore_rl.algorithms)."""
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    """KL to the reference as a loss term (GRPO style); 0 disables. See algorithm.kl_in_reward for the other way."""
    kl_loss_estimator: str = "k3"
    tis_cap: float | None = None
    """Truncated importance sampling of the train/rollout log-prob gap (cap, e.g. 2.0); None = off."""
    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs (log pi_old) come from:
    recompute: a forward pass of the actor over the step's samples before the updates (always correct);
    auto: skip that pass when the update is exactly on-policy, i.e. one optimizer step over the whole rollout
      batch (ppo_epochs = 1 and one mini-batch) and nothing needs log pi_old before it (algorithm.kl_in_reward with
      a reference does); then log pi_old is the update's own log-probs, detached (ratio 1, the same gradient
      as the recomputed ratio, ~1/3 fewer actor FLOPs a step). Otherwise recompute;
    rollout: SGLang's log-probs of the samples (slime's --use-rollout-logprobs): no forward pass, the ratio is
      taken against the behaviour policy itself, including the engine/trainer numerics gap (bf16). Single-task
      runs only; not with tis_cap (the TIS weight would be 1)."""

    @property
    def forward_tokens_per_micro_batch(self) -> int:
        """The budget forward-only passes use (forward_max_tokens_per_micro_batch, resolved)."""
        return self.forward_max_tokens_per_micro_batch or 2 * self.max_tokens_per_micro_batch

    def __post_init__(self):
        super().__post_init__()
        if self.loss_agg_mode not in LOSS_AGG:
            raise ValueError(f"actor.loss_agg_mode must be one of {LOSS_AGG}, got {self.loss_agg_mode!r}")
        if self.ppo_epochs < 1:
            raise ValueError(f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.mini_batch_size < 0:
            raise ValueError(f"actor.mini_batch_size must be >= 0, got {self.mini_batch_size}")
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"actor.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.forward_max_tokens_per_micro_batch < 0:
            raise ValueError("actor.forward_max_tokens_per_micro_batch must be >= 0 (0 = twice "
                             f"max_tokens_per_micro_batch), got {self.forward_max_tokens_per_micro_batch}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"actor.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.old_logprobs == "rollout" and self.tis_cap is not None:
            raise ValueError(f"actor.tis_cap ({self.tis_cap}) reweights by pi_old / pi_rollout, which is 1 with "
                             "actor.old_logprobs=rollout: set actor.tis_cap=null or actor.old_logprobs to auto or "
                             "recompute")


@dataclass
class CriticConfig(OptimSettings):
    enabled: bool = False
    """A critic is built (same backbone as the actor, scalar head) when the estimator needs values (gae)."""
    lr: float = 1e-5
    cliprange_value: float = 0.5
    value_loss_coef: float = 1.0
    ppo_epochs: int = 1
    max_tokens_per_micro_batch: int = 4096


@dataclass
class RefConfig:
    enabled: bool = True
    """Keep a frozen reference model for the KL term (needed when any KL coefficient is > 0)."""


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """A label for logs: grpo, ppo, rloo, reinforce_pp, dr_grpo ..."""
    adv_estimator: str = "grpo"
    """Registered advantage estimator: gae, grpo, dr_grpo, rloo, reinforce_pp, reinforce."""
    n_samples_per_prompt: int = 4
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    kl_in_reward: bool = False
    """Subtract kl_coef x KL(per token) from the reward (PPO/RLHF style)."""
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    kl_adaptive: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (they carry no GRPO signal)."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: tokens before max_new_tokens where the penalty ramps in (0 = off)."""
    overlong_penalty: float = 1.0

    def __post_init__(self):
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"algorithm.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.adv_estimator in ("grpo", "dr_grpo", "rloo") and self.n_samples_per_prompt < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator} compares samples of one prompt: set "
                f"algorithm.n_samples_per_prompt >= 2 (got {self.n_samples_per_prompt})"
            )
