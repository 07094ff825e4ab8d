"""Actor, critic, reference and algorithm settings of an RL run (see conf/{actor,critic,ref,algorithm}/).

The actor and the critic are OptimConfigs (config/optim.py) with their training fields added: `actor.lr`,
`actor.lr_warmup_init`, `critic.use_distributed_optimizer` ... are the optimizer's own fields. Names of registered
functions (advantage estimators, policy losses, KL estimators) are checked here, when the config is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_rl.config.names import (advantage_estimators, check_choice, kl_estimators, off_policy_corrections,
                                   policy_losses)
from mcore_rl.config.optim import OptimConfig

OLD_LOGPROBS = ("auto", "recompute", "rollout")


@dataclass
class ActorConfig(OptimConfig):
    _SECTION = "actor"
    _REQUIRE_DECAY_STEPS = False

    ppo_epochs: int = 1
    """Passes over each step's rollouts (each pass makes one optimizer update per mini-batch); > 1 reuses the
    samples for more updates, at the cost of being further off-policy."""
    mini_batch_size: int = 0
    """Samples (prompts x n_samples_per_prompt) per optimizer update; 0 = the whole step's rollouts in one update.
    Must be 0 with `tasks` (each update takes every task's whole step batch)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro batch of the actor's update (dynamic batching); a longer single sequence
    gets a micro batch of its own. Lower it when the update runs out of memory, raise it for throughput."""
    forward_max_tokens_per_micro_batch: int = 0
    """Token budget of the micro batches of the forward-only passes (old and reference log-probs, values);
    0 = twice max_tokens_per_micro_batch. A forward pass keeps no activations for a backward, so larger micro
    batches fit, and fewer of them spend less host time launching kernels per token: at Qwen2.5-0.5B dims on
    an H200 the reference forward of 24.6k tokens in two micro batches was 56 ms of GPU work in 140 ms."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio pi / pi_old is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The ratio is clipped above at 1 + clip_ratio_high. clip-higher (DAPO, e.g. 0.28): a larger high clip lets
    unlikely tokens gain probability."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (Ye et al. 2020; e.g. 3.0, must be > 1): the loss of a token with
    A < 0 is at most -clip_ratio_c x A. null disables."""
    policy_loss: str = "ppo"
    """Registered policy loss (mcore_rl.algorithms.list_policy_losses()): ppo (clipped ratio), gspo (sequence-level
    ratio), pg (plain policy gradient, no ratio)."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number (algorithms/aggregation.py): token-mean (over all response
    tokens; DAPO), seq-mean-token-sum, seq-mean-token-mean (original GRPO) or seq-mean-token-sum-norm (each
    sequence's sum / rollout.max_new_tokens; Dr. GRPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss (0: entropy is only logged)."""
    kl_loss_coef: float = 0.0
    """KL to the reference as a loss term (GRPO style); 0 disables. See algorithm.kl_in_reward for the other way."""
    kl_loss_estimator: str = "k3"
    """KL estimator of that loss term: k1, k2 or k3 (algorithms/kl.py)."""
    tis_cap: float | None = None
    """Truncated importance sampling of the train/rollout mismatch: each token's loss is weighted by
    min(pi_old / pi_rollout, tis_cap) (e.g. 2.0); null = off. Not with old_logprobs=rollout. The same as
    off_policy_correction={name: token_tis, cap: tis_cap}."""
    off_policy_correction: dict[str, Any] = field(default_factory=dict)
    """Reweight or drop tokens and sequences by rho = pi_old / pi_rollout (the trainer's log-probs against the
    rollout engine's, the behaviour policy): {name: <correction>, ...its arguments}, a registered correction of
    mcore_rl/algorithms/off_policy.py: token_tis {cap}, token_mask {low, high, weight_by_ratio}, seq_mask {low,
    high, seq_ratio: geometric|product}, seq_tis {cap, seq_ratio}. {} = none (unless tis_cap). Logged as
    off_policy/* (ratio mean and max, truncated and masked fractions, rollout/trainer mismatch KL). Not with
    old_logprobs=rollout (rho would be 1), nor together with tis_cap. docs/algorithms.md."""
    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs (log pi_old) come from:
    recompute: a forward pass of the actor over the step's samples before the updates (always correct);
    auto: skip that pass when the update is exactly on-policy, i.e. one optimizer step over the whole rollout
      batch (ppo_epochs = 1 and one mini-batch) and nothing needs log pi_old before it (algorithm.kl_in_reward with
      a reference does); then log pi_old is the update's own log-probs, detached (ratio 1, the same gradient
      as the recomputed ratio, ~1/3 fewer actor FLOPs a step). Otherwise recompute;
    rollout: SGLang's log-probs of the samples (slime's --use-rollout-logprobs): no forward pass, the ratio is
      taken against the behaviour policy itself, including the engine/trainer numerics gap (bf16). Also with
      `tasks` (where auto means recompute: the KL monitor and the per-task metrics read log pi_old before the
      combined update); not with tis_cap (the TIS weight would be 1)."""

    @property
    def forward_tokens_per_micro_batch(self) -> int:
        """The budget forward-only passes use (forward_max_tokens_per_micro_batch, resolved)."""
        return self.forward_max_tokens_per_micro_batch or 2 * self.max_tokens_per_micro_batch

    def __post_init__(self):
        from mcore_rl.algorithms.aggregation import LOSS_AGG_MODES

        super().__post_init__()
        check_choice("actor.policy_loss", self.policy_loss, policy_losses())
        check_choice("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_choice("actor.kl_loss_estimator", self.kl_loss_estimator, kl_estimators())
        if self.entropy_coef < 0 or self.kl_loss_coef < 0:
            raise ValueError(f"actor.entropy_coef ({self.entropy_coef}) and actor.kl_loss_coef ({self.kl_loss_coef}) "
                             "must be >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"actor.tis_cap must be > 0 (or null to disable), got {self.tis_cap}")
        if self.ppo_epochs < 1:
            raise ValueError(f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.mini_batch_size < 0:
            raise ValueError(f"actor.mini_batch_size must be >= 0, got {self.mini_batch_size}")
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"actor.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.forward_max_tokens_per_micro_batch < 0:
            raise ValueError("actor.forward_max_tokens_per_micro_batch must be >= 0 (0 = twice "
                             f"max_tokens_per_micro_batch), got {self.forward_max_tokens_per_micro_batch}")
        check_choice("actor.old_logprobs", self.old_logprobs, OLD_LOGPROBS)
        if self.old_logprobs == "rollout" and self.tis_cap is not None:
            raise ValueError(f"actor.tis_cap ({self.tis_cap}) reweights by pi_old / pi_rollout, which is 1 with "
                             "actor.old_logprobs=rollout: set actor.tis_cap=null or actor.old_logprobs to auto or "
                             "recompute")
        if self.off_policy_correction:
            self._check_correction()

    def correction(self) -> tuple[str, dict[str, Any]] | None:
        """The off-policy correction to apply, (name, arguments), or None: off_policy_correction, or tis_cap as
        token_tis."""
        if self.off_policy_correction:
            args = dict(self.off_policy_correction)
            return str(args.pop("name")), args
        return ("token_tis", {"cap": self.tis_cap}) if self.tis_cap is not None else None

    def _check_correction(self) -> None:
        import inspect

        from mcore_rl.algorithms import get_correction

        spec = self.off_policy_correction
        if not hasattr(spec, "keys") or "name" not in spec:
            raise ValueError("actor.off_policy_correction must be a dict with a name (e.g. {name: seq_mask, low: 0.5, "
                             f"high: 2.0}}), got {spec!r}")
        args = dict(spec)
        name = args.pop("name")
        check_choice("actor.off_policy_correction.name", name, off_policy_corrections())
        if self.tis_cap is not None:
            raise ValueError(f"actor.tis_cap ({self.tis_cap}) and actor.off_policy_correction ({name}) both reweight "
                             "by pi_old / pi_rollout: keep one (tis_cap is off_policy_correction={name: token_tis, "
                             "cap: ...})")
        if self.old_logprobs == "rollout":
            raise ValueError(f"actor.off_policy_correction ({name}) weighs by pi_old / pi_rollout, which is 1 with "
                             "actor.old_logprobs=rollout: set actor.old_logprobs to auto or recompute")
        fn = get_correction(name)
        params = inspect.signature(fn).parameters
        settable = [p for p in params if p not in ("old_logprobs", "rollout_logprobs", "response_mask")]
        unknown = sorted(set(args) - set(settable))
        if unknown:
            raise ValueError(f"actor.off_policy_correction: {name} takes {', '.join(settable)}; unknown: "
                             f"{', '.join(unknown)}")
        # the correction's own argument checks (band, cap, seq_ratio), now rather than at the first update
        import torch

        z = torch.zeros(1, 1)
        try:
            fn(old_logprobs=z, rollout_logprobs=z, response_mask=torch.ones(1, 1), **args)
        except (ValueError, TypeError) as e:
            raise ValueError(f"actor.off_policy_correction ({name}): {e}") from None


@dataclass
class CriticConfig(OptimConfig):
    _SECTION = "critic"
    _REQUIRE_DECAY_STEPS = False

    enabled: bool = False
    """Build and train a critic (the actor's backbone with a scalar value head, initialised from the same HF
    checkpoint). algorithm.adv_estimator=gae needs it (critic=default in the defaults list); false = no critic."""
    lr: float = 1e-5
    """Peak learning rate of the critic (it learns faster than the actor)."""
    cliprange_value: float = 0.5
    """PPO value clipping: the new value stays within this of the rollout's value (algorithms/value_loss.py)."""
    value_loss_coef: float = 1.0
    """Multiplier of the critic's value loss (> 0)."""
    ppo_epochs: int = 1
    """Passes of the critic over each step's rollouts (one update per mini-batch of actor.mini_batch_size)."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro batch of the critic's update; lower it when the critic runs out of
    memory."""

    def __post_init__(self):
        super().__post_init__()
        if self.ppo_epochs < 1:
            raise ValueError(f"critic.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"critic.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.cliprange_value <= 0 or self.value_loss_coef <= 0:
            raise ValueError(f"critic.cliprange_value ({self.cliprange_value}) and critic.value_loss_coef "
                             f"({self.value_loss_coef}) must be > 0")


@dataclass
class RefConfig:
    enabled: bool = True
    """Allow a frozen reference model (the actor's initial weights). It is built only when something reads it:
    actor.kl_loss_coef > 0, algorithm.kl_in_reward with kl_coef > 0, multitask.kl_target, or a dpo task. false
    saves its memory and forward pass; those settings then fail at config build."""
    compute_at: str = "auto"
    """When the reference log-probs are computed. `forward`: in the step's forward passes, before the advantages.
    `update`: just before the actor's update, over the update's own micro batches. With the reference's passes
    replayed from CUDA graphs (model.forward_cuda_graphs) the host queues each replay in microseconds, and the GPU
    runs it in the idle time of the update, whose kernel launches keep the host busy: the reference pass then
    costs the step little wall time. `update` needs a reference that feeds the KL loss alone: the update's own
    log-probs as log pi_old (actor.old_logprobs auto with one update a step) and no KL in the reward. auto:
    `update` where that holds and the reference runs from graphs, else `forward`."""

    def __post_init__(self):
        check_choice("ref.compute_at", self.compute_at, ("auto", "forward", "update"))


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    """A label for logs and recipes (grpo, ppo, dr_grpo ...) and the name of the single task of a run without
    `tasks`; what runs is set by the fields below, not by this name."""
    adv_estimator: str = "grpo"
    """Registered advantage estimator (mcore_rl.algorithms.list_advantage_estimators()): gae (needs a critic),
    grpo, dr_grpo, rloo, reinforce, reinforce_plus_plus, reinforce_plus_plus_baseline."""
    n_samples_per_prompt: int = 4
    """Responses sampled per prompt (a GRPO group); >= 2 for grpo, dr_grpo and rloo, which compare the samples
    of one prompt. Samples a step = prompts a step x this."""
    gamma: float = 1.0
    """Discount per token of the token-level estimators (gae, reinforce_plus_plus); 1 = no discount, as is usual
    for a reward given at the end of the response."""
    lam: float = 1.0
    """GAE's lambda (gae only): 1 = Monte-Carlo returns minus the value (low bias), lower = leans on the critic
    (less variance)."""
    norm_adv_by_std: bool = True
    """grpo: divide each group's centred rewards by the group's standard deviation (false: Dr. GRPO style)."""
    kl_in_reward: bool = False
    """Subtract kl_coef x KL(per token) to the reference from the token rewards (PPO/RLHF style). Only estimators
    that take token rewards use it (gae, reinforce_plus_plus); with the others it is an error. See
    actor.kl_loss_coef for KL as a loss term."""
    kl_coef: float = 0.0
    """Coefficient of that KL penalty (the initial one, when kl_adaptive)."""
    kl_estimator: str = "k1"
    """KL estimator of the reward penalty: k1, k2 or k3 (algorithms/kl.py)."""
    kl_adaptive: bool = False
    """Adapt kl_coef towards kl_target (Ziegler et al. 2019's controller) instead of keeping it fixed."""
    kl_target: float = 6.0
    """kl_adaptive: the sequence KL the controller steers to."""
    kl_horizon: int = 10000
    """kl_adaptive: samples over which the controller closes the gap (larger = slower changes)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (they carry no GRPO signal); the step trains on the rest
    (it is skipped when fewer samples than data-parallel ranks remain). Logged as dapo/dropped_groups."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last this-many tokens before rollout.max_new_tokens, over which a
    length penalty ramps in and is added to the reward (0 = off)."""
    overlong_penalty: float = 1.0
    """DAPO: the penalty reached at max_new_tokens, ramping linearly over the last overlong_buffer tokens."""

    def __post_init__(self):
        check_choice("algorithm.adv_estimator", self.adv_estimator, advantage_estimators())
        check_choice("algorithm.kl_estimator", self.kl_estimator, kl_estimators())
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        if self.overlong_buffer < 0:
            raise ValueError(f"algorithm.overlong_buffer must be >= 0 (0 = off), got {self.overlong_buffer}")
        if self.kl_adaptive and (self.kl_target <= 0 or self.kl_horizon < 1):
            raise ValueError(f"algorithm.kl_adaptive needs kl_target > 0 and kl_horizon >= 1, got "
                             f"{self.kl_target} and {self.kl_horizon}")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"algorithm.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.adv_estimator in ("grpo", "dr_grpo", "rloo") and self.n_samples_per_prompt < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator} compares samples of one prompt: set "
                f"algorithm.n_samples_per_prompt >= 2 (got {self.n_samples_per_prompt})"
            )
