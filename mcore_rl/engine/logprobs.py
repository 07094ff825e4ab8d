"""Per-token log-probs, entropy and values from a model's raw outputs, without gathering the vocabulary.

The output layer is column-parallel: each tensor-parallel rank holds logits for one contiguous slice of the
(padded) vocabulary. `vocab_parallel_logprobs` computes

    logprob(y) = l_y - logsumexp_v l_v,        entropy = logsumexp_v l_v - sum_v p_v l_v,    l = logits / T

with one all-reduce of the row max (MAX), one of the row sum of exp(l - max) (SUM), one of the target logit
(SUM, only the rank holding the target contributes) and, for the entropy, one of sum_v exp(l_v - max) l_v (SUM):
four [b, s] all-reduces over the TP group, never a [b, s, V] one. Entries of the padded vocabulary
(ids >= the tokenizer's vocab size) are masked out (exp gives exactly 0). T is the sampling temperature, so the
result matches what the rollout engine computes for the sampled tokens. The backward is written out
(softmax minus one-hot, and -p (l - E_p[l]) for the entropy) so only the softmax (and, with entropy, the logits)
is kept for backward, like Megatron's vocab_parallel_cross_entropy, and the backward reuses those buffers.

Alignment convention (used by logprobs, entropy and values alike): outputs have the layout of input_ids, and
entry i belongs to token i: it is computed from position i-1's hidden state, i.e. log p(token_i | tokens_<i),
the entropy of the distribution token_i was drawn from, and the value of the state just before token_i.
Entry 0 of every sequence (nothing predicts it) and padding are 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# Stands in for -inf on padded vocabulary entries: exp() of it minus any finite max is exactly 0, and unlike -inf
# it keeps p * l finite (0) in the entropy.
_MASKED_LOGIT = -1e30


def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobs(torch.autograd.Function):
    """Memory: besides the input, forward keeps the softmax (one [..., V/tp] fp32 tensor) and, with entropy, the
    scaled logits; backward works in place on them (so it must not run twice, as with Megatron's own
    vocab-parallel cross entropy)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, temperature, with_entropy, group):
        # logits: [..., Vl] this rank's vocabulary slice [vocab_start, vocab_start + Vl); target: [...] global ids
        num_local = logits.size(-1)
        scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        owned = scaled.data_ptr() != logits.data_ptr()  # a copy of ours, free to modify in place
        if temperature != 1.0:
            scaled = scaled.div_(temperature) if owned else scaled / temperature
            owned = True
        num_valid = min(max(vocab_size - vocab_start, 0), num_local)
        if num_valid < num_local:  # padded vocabulary entries live at the end of the last rank's slice
            if not owned:
                scaled, owned = scaled.clone(), True
            scaled[..., num_valid:] = _MASKED_LOGIT
        row_max = scaled.max(dim=-1).values
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        local_target = target - vocab_start
        in_slice = (local_target >= 0) & (local_target < num_local)
        local_target = local_target.clamp(0, num_local - 1)
        picked = scaled.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(picked.masked_fill(~in_slice, 0.0), dist.ReduceOp.SUM, group)

        if owned and not with_entropy:  # the scaled logits are not needed again
            exp = scaled.sub_(row_max.unsqueeze(-1)).exp_()
        else:
            exp = (scaled - row_max.unsqueeze(-1)).exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        lse = sum_exp.log() + row_max
        logprobs = picked - lse
        probs = exp.div_(sum_exp.unsqueeze(-1))
        entropy = None
        if with_entropy:
            expected = _all_reduce((probs * scaled).sum(dim=-1), dist.ReduceOp.SUM, group)
            entropy = lse - expected
            ctx.save_for_backward(probs, local_target, in_slice, scaled, expected)
        else:
            ctx.save_for_backward(probs, local_target, in_slice)
        ctx.scaled_owned = owned
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.out_dtype = logits.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        if ctx.with_entropy:
            probs, local_target, in_slice, scaled, expected = ctx.saved_tensors
        else:
            probs, local_target, in_slice = ctx.saved_tensors
        if ctx.with_entropy and grad_entropy is not None:
            # d entropy / d l_v = -p_v (l_v - E_p[l]);  d logprob / d l_v = onehot_v - p_v
            factor = scaled if ctx.scaled_owned else scaled.clone()
            factor.sub_(expected.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_logprobs is not None:
                factor.add_(grad_logprobs.unsqueeze(-1))
            grad = probs.mul_(factor).neg_()
            del factor
        elif grad_logprobs is not None:
            grad = probs.mul_(grad_logprobs.unsqueeze(-1)).neg_()
        else:
            grad = probs.zero_()
        if grad_logprobs is not None:
            onehot_grad = grad_logprobs.masked_fill(~in_slice, 0.0).unsqueeze(-1)
            grad.scatter_add_(-1, local_target.unsqueeze(-1), onehot_grad)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.out_dtype), None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, target: Tensor, vocab_size: int, *, temperature: float = 1.0,
                            with_entropy: bool = False, group=None) -> tuple[Tensor, Tensor | None]:
    """log p(target) (and the entropy) from this rank's slice of the logits; differentiable.

    logits: [..., V / tp] any float dtype (computed in fp32, or fp64 for fp64 input).
    target: [...] int64 token ids < vocab_size.
    vocab_size: the real vocabulary; ids >= it are padding and get probability 0.
    group: the tensor-parallel group (None without torch.distributed or for a world of one). This rank's slice
    starts at tp_rank * (V / tp).
    Returns float32 (fp64 for fp64 input) [...] tensors: logprobs, and entropy (None unless asked).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(group) if _group_size(group) > 1 else 0
    vocab_start = rank * logits.size(-1)
    return _VocabParallelLogprobs.apply(logits, target, vocab_start, vocab_size, float(temperature),
                                        with_entropy, group)


def next_token_targets(input_ids: Tensor) -> Tensor:
    """targets[..., i] = input_ids[..., i + 1] (the token position i predicts); the last column wraps around
    and is discarded by `align_to_tokens`."""
    return torch.roll(input_ids, shifts=-1, dims=-1)


def align_to_tokens(per_position: Tensor, valid_mask: Tensor, seq_starts: list[int] | None = None) -> Tensor:
    """Shift per-position predictions [b, s] right by one so entry i belongs to token i (module docstring).

    Entry 0 of each row, of each packed sequence (seq_starts, for a [1, t] packed row) and padding become 0.
    """
    shifted = torch.nn.functional.pad(per_position[..., :-1], (1, 0))
    keep = valid_mask.clone()
    keep[..., 0] = False
    if seq_starts:
        keep[0, torch.as_tensor(seq_starts, device=keep.device)] = False
    return torch.where(keep, shifted, torch.zeros((), dtype=shifted.dtype, device=shifted.device))
