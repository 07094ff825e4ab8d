"""Reduce a per-token loss `[B, T]` to the scalar that is back-propagated, exactly under micro-batching and DP.

Modes (`B'` = sequences with at least one response token, `n_i` = response tokens of sequence i, `L` = a constant
maximum response length):

    token-mean               sum_{i,t} l_it / sum_i n_i                      (DAPO "token-level" loss)
    seq-mean-token-sum       (1/B') sum_i sum_t l_it
    seq-mean-token-mean      (1/B') sum_i (1/n_i) sum_t l_it                 (original GRPO / GSPO)
    seq-mean-token-sum-norm  (1/B') sum_i (1/L) sum_t l_it                   (Dr. GRPO, Liu et al. 2025)

Micro-batching and data parallelism. The denominators (`sum_i n_i`, `B'`) belong to the whole mini-batch (every
micro batch on every DP rank that contributes to one optimizer step). Pass them as `global_num_tokens` /
`global_num_seqs` (from `compute_global_normalizers`) and `aggregate_loss` returns this micro batch's
*contribution*: the numerator over its own rows divided by the global denominator. Sequences are never split
across micro batches, so `n_i` is always local.

Convention: the contributions of all micro batches on all DP ranks SUM to the full-batch loss. mcore_rl's
engine (mcore_rl/engine/forward_backward.py) sums exactly that way: it neither divides by the number of micro
batches nor averages gradients over DP, so a loss function returns its contribution as it is and the optimizer
sees the gradient of the full-batch loss. (Plain Megatron-Core instead divides each micro batch's loss by
`num_microbatches` and averages gradients over DP; there the contribution would be multiplied by
num_microbatches * dp_size.) Context parallelism is not handled here: the counts and `n_i` assume every rank holds whole
sequences. Without global normalisers every function normalises by its own batch (right for one micro batch).
Padding rows (all-zero mask) are never counted, so padding a batch to a fixed size does not change the loss.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .masking import device_scalar, masked_fill_padding

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(loss_agg_mode: str, max_response_length: int | None) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; known: {', '.join(LOSS_AGG_MODES)}")
    if loss_agg_mode == "seq-mean-token-sum-norm" and (max_response_length is None or max_response_length <= 0):
        raise ValueError(
            f"loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_length > 0 (got {max_response_length}); "
            "pass the rollout's maximum response length, not the padded width of a micro batch, so that "
            "micro batches padded to different widths use the same constant"
        )


def _denominator(value: Tensor | float | int, like: Tensor) -> Tensor:
    # clamp to 1: an all-padding batch gives loss 0 (with zero gradient) instead of 0/0
    return device_scalar(value, like, min=1.0)


def aggregate_loss(
    loss_mat: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss to a scalar with one of `LOSS_AGG_MODES` (formulas in the module docstring).

    loss_mat: [B, T] float; response_mask: [B, T] 0/1 (padding may hold anything, even NaN).
    global_num_tokens: total response tokens of the mini-batch over all micro batches and DP ranks
        (token-mean only; default: this batch's count).
    global_num_seqs: total non-empty sequences of the mini-batch (seq-* modes; default: this batch's count).
    max_response_length: the constant L of seq-mean-token-sum-norm (required for that mode).
    Returns a 0-dim tensor of loss_mat's dtype; 0 (finite, zero gradient) when nothing is selected.
    """
    _check_mode(loss_agg_mode, max_response_length)
    mask = response_mask.bool()
    loss_mat = masked_fill_padding(loss_mat, mask)
    if loss_agg_mode == "token-mean":
        num_tokens = mask.sum() if global_num_tokens is None else global_num_tokens
        return loss_mat.sum() / _denominator(num_tokens, loss_mat)

    seq_num_tokens = mask.sum(dim=-1)
    seq_losses = loss_mat.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / seq_num_tokens.clamp(min=1).to(loss_mat.dtype)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = seq_losses / max_response_length
    num_seqs = (seq_num_tokens > 0).sum() if global_num_seqs is None else global_num_seqs
    return seq_losses.sum() / _denominator(num_seqs, loss_mat)


class LossNormalizers(NamedTuple):
    """Global denominators for `aggregate_loss`: 0-dim int64 tensors."""

    num_tokens: Tensor  # response tokens in the mini-batch
    num_seqs: Tensor  # sequences with at least one response token


def compute_global_normalizers(
    response_masks: Sequence[Tensor], process_group: "torch.distributed.ProcessGroup | None" = None
) -> LossNormalizers:
    """Count response tokens and non-empty sequences over the micro-batch masks of one mini-batch.

    response_masks: this rank's micro-batch masks, each [B_k, T_k] 0/1 (widths may differ).
    process_group: when given (the DP group), the counts are summed over it with one all-reduce, so every rank
        gets the mini-batch totals. Without it, pass the masks of all ranks, or all-reduce the counts yourself.
    Call this once per mini-batch, before the micro-batch loop (one collective, no host sync).
    """
    if len(response_masks) == 0:
        raise ValueError("compute_global_normalizers needs at least one micro-batch mask (got an empty list)")
    device = response_masks[0].device
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for mask in response_masks:
        mask = mask.bool()
        counts[0] += mask.sum()
        counts[1] += (mask.sum(dim=-1) > 0).sum()
    if process_group is not None:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM, group=process_group)
    return LossNormalizers(num_tokens=counts[0], num_seqs=counts[1])
