"""Masked reductions shared by the estimators and losses.

Masks are `[B, T]` tensors of 0/1 (bool, int or float). Every function selects with `torch.where` rather than
multiplying by the mask, so padding may hold anything (garbage, inf, NaN) without leaking into results or
gradients: callers sanitise inputs with `masked_fill_padding` before any exp/log that could overflow there.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_fill_padding(x: Tensor, mask: Tensor, value: float = 0.0) -> Tensor:
    """Replace entries where `mask` is 0 by `value`; the gradient to those entries is zero.

    x: [B, T] any float dtype; mask: [B, T] 0/1. Returns [B, T] of x's dtype.
    """
    # a Python scalar, not a tensor made from it: a new device tensor from a host value is a blocking copy
    return torch.where(mask.bool(), x, value)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over entries where `mask` is 1, over `dim` (all dims when None)."""
    x = masked_fill_padding(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over entries where `mask` is 1; 0 where the mask selects nothing (never NaN)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_means(values: dict[str, Tensor], mask: Tensor, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """`masked_mean` of each [B, T] tensor in `values` (bool ones count as 0/1), in `dtype`, by one masked
    reduction over their stack: a loss's statistics are several such means per micro batch, and each alone is its
    own handful of kernels (a host-bound update launches every one of them). Returns 0-dim tensors, same keys."""
    if not values:
        return {}
    mask = mask.bool()
    stacked = torch.stack([v.to(dtype) for v in values.values()])  # [K, B, T]
    sums = torch.where(mask, stacked, 0.0).sum(dim=(-2, -1))
    means = sums / mask.sum().clamp(min=1).to(dtype)
    return dict(zip(values, means.unbind()))


def device_scalar(value: Tensor | float, like: Tensor, min: float | None = None) -> Tensor:
    """`value` (a number or a tensor) as a 0-dim tensor of `like`'s dtype and device, at least `min` if given. A
    number is filled in on the device: a device tensor made from a host value is a copy the host waits for."""
    if isinstance(value, Tensor):
        out = value.to(like.device, like.dtype)
        return out if min is None else out.clamp(min=min)
    value = float(value) if min is None else max(float(value), min)
    return torch.full((), value, dtype=like.dtype, device=like.device)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the selected entries of `x` (scalar); 0 when fewer than two entries are selected."""
    mean = masked_mean(x, mask)
    count = mask.bool().sum()
    sq = masked_sum((x - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the selected entries of `x` to zero mean and unit (unbiased) variance over the whole batch.

    x: [B, T]; mask: [B, T] 0/1. Returns [B, T], zero on padding. A batch with a single selected entry (or all
    entries equal) whitens to 0 rather than NaN. `shift_mean=False` only rescales (keeps the mean).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return masked_fill_padding(whitened, mask)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last selected token of each row: [B] int64, -1 for rows with no selected token."""
    mask = response_mask.bool()
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:-1], -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).amax(dim=-1)
