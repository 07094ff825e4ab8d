"""Policy-gradient losses (registered by name), the entropy bonus and truncated importance weights.

Registered losses take keyword arguments only and return `(loss, metrics)`: `loss` is the 0-dim tensor to
back-propagate (aggregated by `aggregate_loss`, so pass `loss_agg_mode` and the global normalisers described
in `aggregation.py`), `metrics` a dict of detached 0-dim tensors (token means over this micro batch; the trainer
averages them over micro batches and syncs once per step). Shared arguments:

    logprobs:      [B, T] float  log pi_theta(y_t | ...) of the response tokens, with grad
    old_logprobs:  [B, T] float  log pi_old (the policy that generated or was used at rollout), no grad
    advantages:    [B, T] float  from an estimator in `advantages.py`, no grad
    response_mask: [B, T] 0/1    padding may hold anything (it is replaced before any exp)
    token_weights: [B, T] float  optional per-token multiplier of the loss, no grad (e.g.
                                 `truncated_importance_weights` to correct for rollout/trainer mismatch)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masking import masked_fill_padding, masked_mean, masked_means, masked_sum
from .registry import register_policy_loss

# exp() of a log-ratio beyond this is a numerical accident, not a learning signal; clamping keeps fp32 finite.
_MAX_LOG_RATIO = 20.0


def _check_shapes(response_mask: Tensor, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.shape != response_mask.shape:
            raise ValueError(
                f"{name} must be [B, T] like response_mask {tuple(response_mask.shape)}; got {tuple(t.shape)}"
            )


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    if not 0.0 <= clip_ratio_low <= 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1] (ratio floor 1 - clip_ratio_low); got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0; got {clip_ratio_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1 or None to disable it; got {clip_ratio_c}")


def _clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token -min(r A, clip(r) A), dual-clipped for A < 0; metrics of which tokens are clipped."""
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(surr, surr_clipped)
    if clip_ratio_c is not None:
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -advantages * clip_ratio_c), loss_mat)
    with torch.no_grad():
        r = ratio.detach()
        # tokens whose gradient the clip removes
        high = (r > 1.0 + clip_ratio_high) & (advantages > 0)
        low = (r < 1.0 - clip_ratio_low) & (advantages < 0)
        rows = {"clip_frac": high | low, "clip_frac_high": high, "clip_frac_low": low, "ratio_mean": r}
        if clip_ratio_c is not None:
            rows["dual_clip_frac"] = (advantages < 0) & (r > clip_ratio_c)
        metrics = masked_means(rows, mask, r.dtype)
        # ratio > 0, so padding filled with 0 never wins the max
        metrics["ratio_max"] = masked_fill_padding(r, mask).amax() if r.numel() > 0 else r.new_zeros(())
    return loss_mat, metrics


def _kl_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """KL(pi_old || pi_theta) estimated on the rollout samples: k1 (ppo_kl) and k3 (approx_kl)."""
    with torch.no_grad():
        lr = log_ratio.detach()
        return masked_means({"ppo_kl": -lr, "approx_kl": torch.expm1(lr) - lr}, mask, lr.dtype)


def _weight(loss_mat: Tensor, token_weights: Tensor | None, mask: Tensor) -> Tensor:
    if token_weights is None:
        return loss_mat
    return loss_mat * masked_fill_padding(token_weights.detach().to(loss_mat.dtype), mask)


@register_policy_loss("ppo")
def ppo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    token_weights: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip and optional dual clip.

        r_t = exp(logprobs - old_logprobs)
        l_t = -min(r_t A_t, clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high) A_t)
        l_t = min(l_t, -clip_ratio_c A_t)   where A_t < 0          (dual clip)

    Dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL" (clip_ratio_c = 3).
    clip_ratio_high > clip_ratio_low is DAPO's "clip-higher" (Yu et al. 2025, sec. "Clip-Higher"; 0.2 / 0.28).
    Tensors: see the module docstring, all [B, T]. Returns (loss 0-dim, metrics: clip_frac, clip_frac_high,
    clip_frac_low, dual_clip_frac (if enabled), ratio_mean, ratio_max, ppo_kl, approx_kl).
    """
    _check_shapes(response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                  token_weights=token_weights)
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    mask = response_mask.bool()
    logprobs = masked_fill_padding(logprobs, mask)
    old_logprobs = masked_fill_padding(old_logprobs.detach().to(logprobs.dtype), mask)
    advantages = masked_fill_padding(advantages.detach().to(logprobs.dtype), mask)
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    loss_mat, metrics = _clipped_surrogate(
        torch.exp(log_ratio), advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    loss = aggregate_loss(
        _weight(loss_mat, token_weights, mask), mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )
    metrics.update(_kl_metrics(log_ratio, mask))
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    token_weights: Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025), in its GSPO-token form.

        s_i     = exp( (1/|y_i|) sum_t (logprobs_it - old_logprobs_it) )        (geometric mean of token ratios)
        s_it    = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]                  (value s_i, grad s_i * grad log pi)
        l_it    = -min(s_it A_it, clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high) A_it)

    With A_it = A_i constant over the response (outcome estimators) and loss_agg_mode "seq-mean-token-mean"
    (the default here, the paper's 1/G sum_i) this equals GSPO's sequence objective in value and gradient.
    Defaults are the paper's clip ranges (3e-4, 4e-4); note the ratio is sequence-level, so these are much
    smaller than PPO's. Tensors: see the module docstring, all [B, T]. Returns (loss, metrics as for "ppo" plus
    seq_ratio_mean, without dual clip).
    """
    _check_shapes(response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                  token_weights=token_weights)
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    mask = response_mask.bool()
    logprobs = masked_fill_padding(logprobs, mask)
    old_logprobs = masked_fill_padding(old_logprobs.detach().to(logprobs.dtype), mask)
    advantages = masked_fill_padding(advantages.detach().to(logprobs.dtype), mask)
    log_ratio = logprobs - old_logprobs
    num_tokens = mask.sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / num_tokens  # [B]
    log_s = (seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    loss_mat, metrics = _clipped_surrogate(torch.exp(log_s), advantages, mask, clip_ratio_low, clip_ratio_high, None)
    loss = aggregate_loss(
        _weight(loss_mat, token_weights, mask), mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )
    metrics.update(_kl_metrics(log_ratio, mask))
    with torch.no_grad():
        nonempty = mask.any(dim=-1)
        metrics["seq_ratio_mean"] = masked_mean(seq_log_ratio.detach().exp(), nonempty)
    return loss, metrics


@register_policy_loss("pg")
def pg_policy_loss(
    *,
    logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    old_logprobs: Tensor | None = None,
    token_weights: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Vanilla policy gradient / REINFORCE (Williams 1992): l_t = -A_t * logprobs_t.

    Unbiased only on-policy (one update per rollout); for off-policy data pass importance weights as
    `token_weights`. old_logprobs (optional) only feeds the ppo_kl / approx_kl metrics.
    Tensors: see the module docstring, all [B, T]. Returns (loss 0-dim, metrics).
    """
    _check_shapes(response_mask, logprobs=logprobs, advantages=advantages, old_logprobs=old_logprobs,
                  token_weights=token_weights)
    mask = response_mask.bool()
    logprobs = masked_fill_padding(logprobs, mask)
    advantages = masked_fill_padding(advantages.detach().to(logprobs.dtype), mask)
    loss = aggregate_loss(
        _weight(-advantages * logprobs, token_weights, mask), mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )
    metrics: dict[str, Tensor] = {}
    if old_logprobs is not None:
        old = masked_fill_padding(old_logprobs.detach().to(logprobs.dtype), mask)
        metrics.update(_kl_metrics(logprobs - old, mask))
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution softmax(logits): H = logsumexp(z) - sum_v softmax(z)_v z_v.

    logits: [..., V] (divide by the sampling temperature first). Returns [...] in at least float32, with grad.
    Materialises one [..., V] softmax; chunk over the sequence for long contexts.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def entropy_bonus(
    response_mask: Tensor,
    *,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Aggregated policy entropy, to be maximised: total_loss = pg_loss - entropy_coef * entropy_bonus(...).

    Give exactly one of entropy: [B, T] float (per-token entropy, e.g. from a vocab-parallel kernel) or
    logits: [B, T, V] float. response_mask: [B, T] 0/1. Aggregated like the policy loss (same mode and global
    normalisers, so it is exact under micro-batching). Returns a 0-dim tensor with grad.
    """
    if (entropy is None) == (logits is None):
        raise ValueError("entropy_bonus needs exactly one of entropy= ([B, T]) or logits= ([B, T, V])")
    if entropy is None:
        entropy = entropy_from_logits(logits)
    _check_shapes(response_mask, entropy=entropy)
    return aggregate_loss(
        entropy, response_mask, loss_agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, max_response_length=max_response_length,
    )


@torch.no_grad()
def truncated_importance_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> Tensor:
    """Truncated importance sampling weights for the rollout-engine / trainer mismatch.

        w_t = min(exp(old_logprobs_t - rollout_logprobs_t), cap)
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", TIS.)

    old_logprobs: [B, T] float (trainer's log-probs of the behaviour policy); rollout_logprobs: [B, T] float (as
    returned by SGLang); response_mask: [B, T] 0/1. Returns [B, T], zero on padding; pass as token_weights.
    `off_policy.token_tis` returns these weights with metrics, beside the other registered corrections.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0; got {cap}")
    _check_shapes(response_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    mask = response_mask.bool()
    log_w = masked_fill_padding(old_logprobs - rollout_logprobs.to(old_logprobs.dtype), mask)
    return masked_fill_padding(torch.exp(log_w.clamp(max=_MAX_LOG_RATIO)).clamp(max=cap), mask)
