"""RL algorithms as pure tensor functions: advantage estimators, policy/value/KL/preference losses, controllers.

Imports torch only. Estimators, policy losses and off-policy corrections are registered by name; call them through
`compute_advantages(name, **kwargs)`, `compute_policy_loss(name, **kwargs)` and `compute_correction(name, **kwargs)`
(routing rules in `registry.py`).
Loss aggregation under micro-batching and data parallelism is described in `aggregation.py`; see also
docs/algorithms.md.
"""

from .advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    group_statistics,
    grpo_advantages,
    reinforce_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)
from .aggregation import LOSS_AGG_MODES, LossNormalizers, aggregate_loss, compute_global_normalizers
from .dapo import dynamic_sampling_filter, overlong_penalty
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLLRMonitor,
    apply_kl_penalty,
    estimate_kl,
    kl_loss,
)
from .masking import masked_mean, masked_sum, masked_var, masked_whiten
from .off_policy import SEQ_RATIOS, seq_mask, seq_tis, token_mask, token_tis
from .policy_loss import (
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    pg_policy_loss,
    ppo_policy_loss,
    truncated_importance_weights,
)
from .preference import PREFERENCE_LOSS_TYPES, dpo_loss, kto_kl_reference_point, kto_loss
from .registry import (
    compute_advantages,
    compute_correction,
    compute_policy_loss,
    get_advantage_estimator,
    get_correction,
    get_policy_loss,
    list_advantage_estimators,
    list_corrections,
    list_policy_losses,
    register_advantage,
    register_correction,
    register_policy_loss,
)
from .task_scheduler import TaskScheduler
from .value_loss import value_loss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "PREFERENCE_LOSS_TYPES",
    "SEQ_RATIOS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLLRMonitor",
    "TaskScheduler",
    "LossNormalizers",
    "aggregate_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "compute_correction",
    "compute_global_normalizers",
    "compute_policy_loss",
    "discounted_returns",
    "dpo_loss",
    "dr_grpo_advantages",
    "dynamic_sampling_filter",
    "entropy_bonus",
    "entropy_from_logits",
    "estimate_kl",
    "gae_advantages",
    "get_advantage_estimator",
    "get_correction",
    "get_policy_loss",
    "group_statistics",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_loss",
    "kto_kl_reference_point",
    "kto_loss",
    "list_advantage_estimators",
    "list_corrections",
    "list_policy_losses",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pg_policy_loss",
    "ppo_policy_loss",
    "register_advantage",
    "register_correction",
    "register_policy_loss",
    "reinforce_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "scores_to_token_rewards",
    "seq_mask",
    "seq_tis",
    "token_mask",
    "token_tis",
    "truncated_importance_weights",
    "value_loss",
]
