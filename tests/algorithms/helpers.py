"""Batches with ragged, padded responses shared by the algorithm tests."""

from __future__ import annotations

import torch

NAN = float("nan")


def mask_from_lengths(lengths: list[int], width: int, holes: dict[int, list[int]] | None = None) -> torch.Tensor:
    """[B, width] int64 mask with `lengths[i]` leading ones; `holes` zeroes given positions (multi-turn tool output)."""
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    for i, positions in (holes or {}).items():
        mask[i, positions] = 0
    return mask


def fill_padding(x: torch.Tensor, mask: torch.Tensor, value: float = NAN) -> torch.Tensor:
    """Copy of x with `value` (NaN by default) wherever mask is 0: padding must never leak into results."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def pad_right(x: torch.Tensor, extra: int, value: float = NAN) -> torch.Tensor:
    """Append `extra` columns of `value` to a [B, T] tensor (a wider padded batch)."""
    return torch.cat([x, torch.full((x.shape[0], extra), value, dtype=x.dtype)], dim=1)
