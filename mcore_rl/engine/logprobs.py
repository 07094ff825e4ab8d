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

from mcore_rl.engine.batching import to_device

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


# ---- fused path (CUDA + Triton): no fp32 copy of the logits ---------------------------------------------------
# The torch path above materialises fp32 [..., V/tp] tensors (the scaled logits, exp, softmax) and walks them several
# times in forward and backward: at 16k tokens x 151,936 vocabulary that is ~10 GB a tensor and ~130 GB of memory
# traffic a step. The fused path reads the (bf16) logits twice in forward (row max; then sums) and once in
# backward, which writes the gradient directly in the logits' dtype; it keeps the logits themselves (not an fp32
# softmax) for backward. Same all-reduces as the torch path, so it is vocab-parallel too.

FUSED = "auto"
""""auto" (fused kernels when the logits are on CUDA and Triton imports), "off" (always the torch path)."""

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    @triton.jit
    def _row_max_kernel(x_ptr, stride, out_ptr, num_valid, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        acc = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, num_valid, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < num_valid, other=float("-inf")).to(tl.float32) * inv_t
            acc = tl.maximum(acc, x)
        tl.store(out_ptr + row, tl.max(acc, axis=0))

    @triton.jit
    def _row_sums_kernel(x_ptr, stride, max_ptr, sum_ptr, sumxl_ptr, num_valid, inv_t,
                         WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        m = tl.load(max_ptr + row)
        acc = tl.zeros([BLOCK], tl.float32)
        acc_l = tl.zeros([BLOCK], tl.float32)
        for start in range(0, num_valid, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < num_valid
            x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            e = tl.where(valid, tl.exp(x - m), 0.0)
            acc += e
            if WITH_ENTROPY:
                acc_l += e * x
        tl.store(sum_ptr + row, tl.sum(acc, axis=0))
        if WITH_ENTROPY:
            tl.store(sumxl_ptr + row, tl.sum(acc_l, axis=0))

    @triton.jit
    def _backward_kernel(x_ptr, stride, g_ptr, gstride, lse_ptr, glp_ptr, gent_ptr, exp_ptr, tgt_ptr, onehot_ptr,
                         num_cols, num_valid, inv_t, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        # grad_v = [g_lp * (onehot_v - p_v) - g_ent * p_v * (l_v - E_p[l])] / T, 0 on padded vocabulary entries
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        gbase = g_ptr + row * gstride
        lse = tl.load(lse_ptr + row)
        glp = tl.load(glp_ptr + row)
        g_onehot = tl.load(onehot_ptr + row)
        tgt = tl.load(tgt_ptr + row)
        if WITH_ENTROPY:
            gent = tl.load(gent_ptr + row)
            expected = tl.load(exp_ptr + row)
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < num_cols
            valid = cols < num_valid
            x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            p = tl.where(valid, tl.exp(x - lse), 0.0)
            grad = tl.where(cols == tgt, g_onehot, 0.0) - glp * p
            if WITH_ENTROPY:
                grad -= gent * p * (x - expected)
            grad = grad * inv_t
            tl.store(gbase + cols, grad.to(g_ptr.dtype.element_ty), mask=in_row)


def _use_fused(logits: Tensor) -> bool:
    return (FUSED == "auto" and triton is not None and logits.is_cuda
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32))


_BLOCK = 4096


class _FusedVocabParallelLogprobs(torch.autograd.Function):
    """Same maths and all-reduces as _VocabParallelLogprobs, with Triton row kernels over the un-copied logits."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, temperature, with_entropy, group):
        shape = logits.shape[:-1]
        num_local = logits.size(-1)
        x = logits.reshape(-1, num_local)
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.size(0)
        num_valid = min(max(vocab_size - vocab_start, 0), num_local)
        inv_t = 1.0 / temperature
        row_max = torch.empty(rows, dtype=torch.float32, device=x.device)
        _row_max_kernel[(rows,)](x, x.stride(0), row_max, num_valid, inv_t, BLOCK=_BLOCK, num_warps=8)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        # A rank whose slice is all padding has no finite max; the group max is finite.
        sum_exp = torch.empty(rows, dtype=torch.float32, device=x.device)
        sum_xl = torch.empty(rows, dtype=torch.float32, device=x.device) if with_entropy else sum_exp
        _row_sums_kernel[(rows,)](x, x.stride(0), row_max, sum_exp, sum_xl, num_valid, inv_t,
                                  WITH_ENTROPY=with_entropy, BLOCK=_BLOCK, num_warps=8)

        local_target = (target - vocab_start).reshape(-1)
        in_slice = (local_target >= 0) & (local_target < num_valid)
        local_target = local_target.clamp(0, num_local - 1)
        picked = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() * inv_t
        picked = picked.masked_fill(~in_slice, 0.0)
        if with_entropy:
            sums = _all_reduce(torch.stack([picked, sum_exp, sum_xl]), dist.ReduceOp.SUM, group)
            picked, sum_exp, sum_xl = sums[0], sums[1], sums[2]
        else:
            sums = _all_reduce(torch.stack([picked, sum_exp]), dist.ReduceOp.SUM, group)
            picked, sum_exp = sums[0], sums[1]
        lse = sum_exp.log() + row_max
        logprobs = picked - lse
        entropy = expected = None
        if with_entropy:
            expected = sum_xl / sum_exp
            entropy = (lse - expected).reshape(shape)
        ctx.save_for_backward(x, lse, local_target, in_slice, expected)
        ctx.meta = (shape, logits.shape, num_valid, inv_t, with_entropy)
        return logprobs.reshape(shape), entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        x, lse, local_target, in_slice, expected = ctx.saved_tensors
        _, logits_shape, num_valid, inv_t, with_entropy = ctx.meta
        rows, num_cols = x.shape
        if grad_logprobs is None:
            glp = torch.zeros(rows, dtype=torch.float32, device=x.device)
        else:
            glp = grad_logprobs.reshape(-1).float().contiguous()
        use_entropy = with_entropy and grad_entropy is not None
        gent = grad_entropy.reshape(-1).float().contiguous() if use_entropy else glp
        onehot = glp.masked_fill(~in_slice, 0.0)
        grad = torch.empty_like(x)
        _backward_kernel[(rows,)](x, x.stride(0), grad, grad.stride(0), lse, glp, gent,
                                  expected if use_entropy else lse, local_target, onehot, num_cols, num_valid,
                                  inv_t, WITH_ENTROPY=use_entropy, BLOCK=_BLOCK, num_warps=8)
        return grad.reshape(logits_shape), None, None, None, None, None, None


def vocab_parallel_logprobs(logits: Tensor, target: Tensor, vocab_size: int, *, temperature: float = 1.0,
                            with_entropy: bool = False, group=None) -> tuple[Tensor, Tensor | None]:
    """log p(target) (and the entropy) from this rank's slice of the logits; differentiable.

    logits: [..., V / tp] any float dtype (computed in fp32, or fp64 for fp64 input).
    target: [...] int64 token ids < vocab_size.
    vocab_size: the real vocabulary; ids >= it are padding and get probability 0.
    group: the tensor-parallel group (None without torch.distributed or for a world of one). This rank's slice
    starts at tp_rank * (V / tp).
    Returns float32 (fp64 for fp64 input) [...] tensors: logprobs, and entropy (None unless asked).
    On CUDA (with Triton) fused kernels compute the same without fp32 copies of the logits (FUSED).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(group) if _group_size(group) > 1 else 0
    vocab_start = rank * logits.size(-1)
    if _use_fused(logits):
        return _FusedVocabParallelLogprobs.apply(logits, target, vocab_start, vocab_size, float(temperature),
                                                 with_entropy, group)
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
        # index_fill_ takes the value as a scalar; `keep[0, idx] = False` would copy a host tensor of it (a sync)
        keep[0].index_fill_(0, to_device(torch.as_tensor(seq_starts), keep.device), False)
    return torch.where(keep, shifted, 0.0)
