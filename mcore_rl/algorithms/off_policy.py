"""Off-policy corrections for the rollout-engine / trainer mismatch (registered by name).

The rollout engine samples with its own kernels and, in asynchronous training, with weights that may be several
updates old: it is the behaviour policy pi_rollout, and `rollout_logprobs` are its log-probs as SGLang returned
them. The trainer recomputes `old_logprobs` (pi_old) under the weights it trains from. A policy loss built on
pi_theta / pi_old then sees samples from the wrong distribution; each correction here turns the per-token ratio

    rho_t = exp(old_logprobs_t - rollout_logprobs_t)                       (pi_old / pi_rollout)

into per-token weights to pass to the policy loss as `token_weights`, so that the update is reweighted (or the
samples that are too far off are dropped). Call them through `compute_correction(name, **kwargs)` (routing rules
in `registry.py`). Every correction takes keyword arguments only:

    old_logprobs:     [B, T] float  the trainer's log-probs of the sampled tokens (no grad)
    rollout_logprobs: [B, T] float  the rollout engine's log-probs of the same tokens
    response_mask:    [B, T] 0/1    may have holes inside a row (multi-turn tool tokens); padding may hold anything

and returns (weights [B, T] in at least float32, zero where response_mask is 0; metrics: a dict of 0-d tensors):

    ratio_mean      mean of rho_t over valid tokens
    ratio_max       max of rho_t over valid tokens (0 when there are none)
    truncated_frac  fraction of valid tokens whose weight was capped
    masked_frac     fraction of valid tokens whose weight was zeroed, alone or with their whole sequence
    mismatch_kl     KL(pi_rollout || pi_old) on the rollout's samples, k3 estimator (`kl.estimate_kl`), token mean

The sequence-level corrections add seq_ratio_mean and seq_ratio_max over the sequences with a valid token. Log
ratios (token or sequence) are clamped above at 20 before exp, as in policy_loss.py, so huge gaps stay finite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kl import estimate_kl
from .masking import masked_fill_padding, masked_mean, masked_sum
from .policy_loss import _MAX_LOG_RATIO, _check_shapes, truncated_importance_weights
from .registry import register_correction

SEQ_RATIOS = ("geometric", "product")


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (the largest weight a token or sequence may get, e.g. 2.0); got {cap}")


def _check_band(low: float, high: float) -> None:
    if not 0.0 <= low < 1.0 < high:
        raise ValueError(
            f"the band must satisfy 0 <= low < 1 < high (ratios pi_old / pi_rollout inside it are kept, e.g. "
            f"low=0.5, high=2.0); got low={low}, high={high}"
        )


def _check_seq_ratio(seq_ratio: str) -> None:
    if seq_ratio not in SEQ_RATIOS:
        raise ValueError(
            f"seq_ratio must be 'geometric' (exp of the mean token log ratio) or 'product' (exp of the sum); "
            f"got {seq_ratio!r}"
        )


def _prepare(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(old, rollout) in at least float32 with zeros on padding, and the bool mask."""
    _check_shapes(response_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    mask = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    old = masked_fill_padding(old_logprobs.to(dtype), mask)
    return old, masked_fill_padding(rollout_logprobs.to(dtype), mask), mask


def _exp_ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    # x >= 0 here, so entries filled with 0 never win the max
    return masked_fill_padding(x, mask).amax() if x.numel() > 0 else x.new_zeros(())


def _metrics(old: Tensor, rollout: Tensor, mask: Tensor, truncated: Tensor, masked: Tensor,
             ratio: Tensor | None = None) -> dict[str, Tensor]:
    """ratio: the token ratios rho_t when the caller has them already."""
    ratio = _exp_ratio(old - rollout) if ratio is None else ratio
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": _masked_max(ratio, mask),
        "truncated_frac": masked_mean(truncated.to(ratio.dtype), mask),
        "masked_frac": masked_mean(masked.to(ratio.dtype), mask),
        "mismatch_kl": masked_mean(estimate_kl(rollout, old, "k3"), mask),
    }


def _seq_ratio(old: Tensor, rollout: Tensor, mask: Tensor, seq_ratio: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-sequence ratio [B] (1 for a row without valid tokens) and its metrics over non-empty rows."""
    log_ratio = masked_sum(old - rollout, mask, dim=-1)
    if seq_ratio == "geometric":
        log_ratio = log_ratio / mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    ratio = _exp_ratio(log_ratio)
    nonempty = mask.any(dim=-1)
    return ratio, {"seq_ratio_mean": masked_mean(ratio, nonempty), "seq_ratio_max": _masked_max(ratio, nonempty)}


@register_correction("token_tis")
@torch.no_grad()
def token_tis(
    *, old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level truncated importance sampling: w_t = min(rho_t, cap).

    Corrects each token for the rollout/trainer mismatch, truncated so that a rare token the trainer finds much
    likelier than the engine did cannot dominate the update (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", TIS). The weights are `policy_loss.truncated_importance_weights`;
    this adds the metrics. Tensors: see the module docstring. truncated_frac counts rho_t > cap.
    """
    _check_cap(cap)
    old, rollout, mask = _prepare(old_logprobs, rollout_logprobs, response_mask)
    weights = truncated_importance_weights(old, rollout, mask, cap=cap)
    ratio = _exp_ratio(old - rollout)
    return weights, _metrics(old, rollout, mask, ratio > cap, torch.zeros_like(mask), ratio)


@register_correction("token_mask")
@torch.no_grad()
def token_mask(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    low: float = 0.5,
    high: float = 2.0,
    weight_by_ratio: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Two-sided token masking: w_t = 0 if rho_t < low or rho_t > high, else 1 (or rho_t with weight_by_ratio).

    Drops the tokens on which engine and trainer disagree too much in either direction, instead of truncating
    their weight, so that they contribute no gradient at all; with weight_by_ratio the kept tokens are also
    importance-weighted (untruncated, since rho_t <= high). Tensors: see the module docstring. masked_frac counts
    the tokens outside [low, high]; truncated_frac is 0.
    """
    _check_band(low, high)
    old, rollout, mask = _prepare(old_logprobs, rollout_logprobs, response_mask)
    ratio = _exp_ratio(old - rollout)
    outside = (ratio < low) | (ratio > high)
    kept = ratio if weight_by_ratio else torch.ones_like(ratio)
    weights = torch.where(mask & ~outside, kept, torch.zeros_like(ratio))
    return weights, _metrics(old, rollout, mask, torch.zeros_like(mask), outside, ratio)


@register_correction("seq_mask")
@torch.no_grad()
def seq_mask(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    low: float = 0.5,
    high: float = 2.0,
    seq_ratio: str = "geometric",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level masking: w_it = 0 on every token of sequence i if rho_i < low or rho_i > high, else 1.

        rho_i = exp( sum_t log rho_it )                (seq_ratio="product": the sequence's importance ratio)
        rho_i = exp( (1/|y_i|) sum_t log rho_it )      (seq_ratio="geometric": length-normalised, as in GSPO,
                                                        Zheng et al. 2025)

    sums over the valid tokens of the row. Drops whole responses sampled too far from the trainer's policy rather
    than single tokens. The product's log grows with length, so its band should be much wider than the geometric
    mean's. Tensors: see the module docstring. masked_frac counts the tokens of masked sequences; truncated_frac
    is 0.
    """
    _check_band(low, high)
    _check_seq_ratio(seq_ratio)
    old, rollout, mask = _prepare(old_logprobs, rollout_logprobs, response_mask)
    ratio, seq_metrics = _seq_ratio(old, rollout, mask, seq_ratio)
    outside = ((ratio < low) | (ratio > high))[:, None].expand_as(mask)
    weights = (mask & ~outside).to(old.dtype)
    metrics = _metrics(old, rollout, mask, torch.zeros_like(mask), outside)
    metrics.update(seq_metrics)
    return weights, metrics


@register_correction("seq_tis")
@torch.no_grad()
def seq_tis(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    cap: float = 2.0,
    seq_ratio: str = "geometric",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level truncated importance sampling: w_it = min(rho_i, cap) on every valid token of sequence i.

    rho_i is the geometric mean of the token ratios (default) or their product, as in `seq_mask`. One weight per
    response, truncated like TIS (Yao et al. 2025) but at the sequence level; the geometric mean keeps it
    comparable across lengths (GSPO's sequence ratio, Zheng et al. 2025). Tensors: see the module docstring.
    truncated_frac counts the tokens of sequences with rho_i > cap; masked_frac is 0.
    """
    _check_cap(cap)
    _check_seq_ratio(seq_ratio)
    old, rollout, mask = _prepare(old_logprobs, rollout_logprobs, response_mask)
    ratio, seq_metrics = _seq_ratio(old, rollout, mask, seq_ratio)
    weights = masked_fill_padding(ratio.clamp(max=cap)[:, None].expand_as(old), mask)
    truncated = (ratio > cap)[:, None].expand_as(mask)
    metrics = _metrics(old, rollout, mask, truncated, torch.zeros_like(mask))
    metrics.update(seq_metrics)
    return weights, metrics
