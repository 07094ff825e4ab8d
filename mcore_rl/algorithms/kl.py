"""KL(pi_theta || pi_ref) estimators, their use in the reward or the loss, and KL controllers.

Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html), per token on
samples y ~ pi_theta, with log r = ref_logprobs - logprobs:

    k1 = -log r                    unbiased, high variance, can be negative
    k2 = (log r)^2 / 2             biased, low variance, >= 0; as a loss its gradient is the exact
                                   gradient of KL(pi_theta || pi_ref) (on-policy samples)
    k3 = (r - 1) - log r           unbiased, low variance, >= 0 ("low_var_kl" in verl; GRPO's loss term)

Where the KL goes:
* in the reward (InstructGPT / REINFORCE++): `apply_kl_penalty` subtracts kl_coef * k from token rewards;
* in the loss (GRPO): `kl_loss` returns the aggregated estimate, to be added as kl_coef * kl_loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masking import device_scalar, masked_fill_padding, masked_mean, masked_sum

KL_ESTIMATORS = ("k1", "k2", "k3")

# k3 exponentiates the log-ratio; beyond this it is a numerical accident (exp(89) overflows fp32).
_MAX_LOG_RATIO = 20.0
# Ziegler et al.'s bound on the proportional error of the adaptive KL controller.
_MAX_KL_ERROR = 0.2


def estimate_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", *, clamp: float | None = None) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) (k1 / k2 / k3, formulas in the module docstring).

    logprobs: [B, T] float (samples drawn from pi_theta); ref_logprobs: [B, T] float. Returns [B, T] with the
    grad of logprobs. For k3 the log-ratio is clamped to [-20, 20] before exp; `clamp` additionally bounds the
    result to [-clamp, clamp] (verl clamps k3 to 10), trading bias for robustness to rare extreme tokens.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{estimator}'; known: {', '.join(KL_ESTIMATORS)}")
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 or None; got {clamp}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    log_r = ref_logprobs.to(logprobs.dtype) - logprobs
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    else:
        log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.expm1(log_r) - log_r
    return kl if clamp is None else kl.clamp(-clamp, clamp)


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kl_coef: float | Tensor,
    estimator: str = "k1",
    *,
    clamp: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty in the reward (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2): r_t - kl_coef * k_t.

    token_rewards: [B, T] float (e.g. `scores_to_token_rewards`); logprobs: [B, T] float (log-probs of the policy
    that sampled, i.e. old_logprobs); ref_logprobs: [B, T]; response_mask: [B, T] 0/1; kl_coef: float or 0-dim
    tensor (e.g. `controller.value`). Returns (rewards [B, T], zero on padding; metrics: "kl" (token mean),
    "kl_seq" (mean over non-empty sequences of the per-sequence sum; what `AdaptiveKLController.update` and
    Ziegler's target refer to), "kl_coef").
    """
    for name, t in (("token_rewards", token_rewards), ("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        if t.shape != response_mask.shape:
            raise ValueError(
                f"{name} must be [B, T] like response_mask {tuple(response_mask.shape)}; got {tuple(t.shape)}"
            )
    mask = response_mask.bool()
    logprobs = masked_fill_padding(logprobs, mask)
    ref_logprobs = masked_fill_padding(ref_logprobs.to(logprobs.dtype), mask)
    kl = masked_fill_padding(estimate_kl(logprobs, ref_logprobs, estimator, clamp=clamp), mask)
    kl_coef = device_scalar(kl_coef, kl)
    rewards = masked_fill_padding(token_rewards.to(kl.dtype) - kl_coef * kl, mask)
    nonempty = mask.any(dim=-1)
    metrics = {
        "kl": masked_mean(kl, mask),
        "kl_seq": masked_mean(masked_sum(kl, mask, dim=-1), nonempty),
        "kl_coef": kl_coef,
    }
    return rewards, metrics


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty in the loss (Shao et al. 2024, GRPO, eqs. 3-4 use k3): aggregate_loss(k(logprobs, ref)).

    logprobs: [B, T] float, with grad; ref_logprobs: [B, T] float; response_mask: [B, T] 0/1. Aggregated like the
    policy loss (same mode and global normalisers). Add `kl_coef * loss` to the policy loss.
    Returns (loss 0-dim, metrics: "kl" = token mean of the estimate).
    """
    mask = response_mask.bool()
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs must be [B, T] like response_mask {tuple(mask.shape)}; got {tuple(logprobs.shape)}")
    logprobs = masked_fill_padding(logprobs, mask)
    ref_logprobs = masked_fill_padding(ref_logprobs.detach().to(logprobs.dtype), mask)
    kl = estimate_kl(logprobs, ref_logprobs, estimator, clamp=clamp)
    loss = aggregate_loss(
        kl, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        max_response_length=max_response_length,
    )
    return loss, {"kl": masked_mean(kl.detach(), mask)}


def _finite_float(name: str, value: float | Tensor) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value} (the policy or the reference has diverged)")
    return value


def _load(obj: Any, state: dict[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{type(obj).__name__}.load_state_dict: missing {missing}; got keys {sorted(state)}")
    for k in keys:
        setattr(obj, k, type(getattr(obj, k))(state[k]))


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op. Same interface as `AdaptiveKLController`."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0; got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self, state, ("value",))


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

        e_t       = clip(KL_t / target_kl - 1, -0.2, 0.2)
        beta_t+1  = beta_t * (1 + e_t * n_steps / horizon)

    KL_t is the measured KL of the batch (Ziegler: the per-sequence sum, `apply_kl_penalty(...)[1]["kl_seq"]`),
    n_steps the number of samples (episodes) in it, horizon the number of samples over which the error is
    driven to 0 (Ziegler: 10000). Call `update` once per step, after the metrics are synced to the host.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0; got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0; got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0; got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        current_kl = _finite_float("current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0; got {n_steps}")
        if n_steps * _MAX_KL_ERROR >= self.horizon:
            raise ValueError(
                f"n_steps ({n_steps}) must be < horizon / {_MAX_KL_ERROR} = {self.horizon / _MAX_KL_ERROR:g}, or the "
                "KL coefficient can be multiplied by a factor <= 0; increase horizon (Ziegler et al.: 10000)"
            )
        error = min(max(current_kl / self.target_kl - 1.0, -_MAX_KL_ERROR), _MAX_KL_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self, state, ("value",))


class KLLRMonitor:
    """Learning-rate decay when the measured KL to the reference (or old) policy exceeds `kl_target`.

    Rule: `update(kl)` multiplies `lr_multiplier` by `decay_factor` each time kl > kl_target, never below
    `min_lr_multiplier`; it never increases it again. The trainer scales the scheduler's LR by the returned
    multiplier. `decayed` tells whether the last update decayed; `num_exceeded` counts updates with kl > target.
    A non-finite KL raises ValueError (a diverged run should stop, not be damped silently).
    """

    def __init__(self, kl_target: float, decay_factor: float = 0.5, min_lr_multiplier: float = 0.01):
        if kl_target <= 0:
            raise ValueError(f"kl_target must be > 0; got {kl_target}")
        if not 0.0 < decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in (0, 1]; got {decay_factor}")
        if not 0.0 <= min_lr_multiplier <= 1.0:
            raise ValueError(f"min_lr_multiplier must be in [0, 1]; got {min_lr_multiplier}")
        self.kl_target = float(kl_target)
        self.decay_factor = float(decay_factor)
        self.min_lr_multiplier = float(min_lr_multiplier)
        self.lr_multiplier = 1.0
        self.num_exceeded = 0
        self.decayed = False

    def update(self, measured_kl: float | Tensor) -> float:
        """Apply the rule for one measurement; returns the LR multiplier to use from now on."""
        measured_kl = _finite_float("measured_kl", measured_kl)
        self.decayed = False
        if measured_kl > self.kl_target:
            self.num_exceeded += 1
            new = max(self.lr_multiplier * self.decay_factor, self.min_lr_multiplier)
            self.decayed = new < self.lr_multiplier
            self.lr_multiplier = new
        return self.lr_multiplier

    def state_dict(self) -> dict[str, Any]:
        return {"lr_multiplier": self.lr_multiplier, "num_exceeded": self.num_exceeded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self, state, ("lr_multiplier", "num_exceeded"))
