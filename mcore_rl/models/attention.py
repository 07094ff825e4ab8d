"""Core attention through torch.nn.functional.scaled_dot_product_attention, plugged in by ModuleSpec.

Megatron-Core's local DotProductAttention materialises the [b*heads, s, s] score matrix: at 1.5B dims and seq
2048 it runs out of memory on an H200, and at 0.5B it is 2.3x slower than SDPA (measured on an H200; see
docs/performance.md for the setup). SDPA picks a flash / memory-efficient kernel on GPU and a fused kernel on CPU.

Supports grouped-query attention, causal masking, an optional sliding window (Mistral), and packed
sequences (THD format: Megatron passes `packed_seq_params` with cu_seqlens; each sequence attends only to
itself) in one kernel call per layer (see `_forward_packed`). Attention dropout is applied through SDPA's
dropout_p under Megatron's RNG tracker.

The builder passes the sliding window and the packed-sequence implementation (ModelConfig.packed_attention) as
ModuleSpec params (models/specs.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

from mcore_rl.models.rope import packed_index


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        sliding_window: int | None = None,
        packed_impl: str = "auto",
    ):
        super().__init__(config=config)
        if packed_impl not in PACKED_IMPLS:
            raise ValueError(f"model.packed_attention must be one of {PACKED_IMPLS}, got {packed_impl!r}")
        if config.context_parallel_size != 1:
            raise ValueError("SDPA attention does not support context parallelism; use model.attention=te")
        tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.window = sliding_window  # None = full causal (the HF config's sliding_window, Mistral)
        self.packed_impl = packed_impl

    def _attend(self, q, k, v):
        """q: [b, nh, s, d]; k, v: [b, ng, s, d]. Causal (optionally windowed) attention."""
        s = q.size(2)
        dropout = self.dropout_p if self.training else 0.0
        enable_gqa = self.num_heads != self.num_groups
        if self.window is not None and s > self.window:
            idx = torch.arange(s, device=q.device)
            diff = idx[:, None] - idx[None, :]
            mask = (diff >= 0) & (diff < self.window)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale, enable_gqa=enable_gqa
            )
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout, scale=self.scale, enable_gqa=enable_gqa
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPA attention does not take an attention bias")
        with tensor_parallel.get_cuda_rng_tracker().fork():
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._forward_packed(query, key, value, packed_seq_params)
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._attend(q, k, v)
        # [b, n, s, d] -> [s, b, n*d]
        b, n, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)

    def _forward_packed(self, query, key, value, packed_seq_params):
        """query: [t, nh, d], key/value: [t, ng, d] holding several sequences back to back.

        All sequences go through one kernel call per layer (`packed_impl`). Sequences of one length are reshaped to
        a [n_seq, len] batch for one causal SDPA call ("padded" without padding; on an H200 SDPA's cuDNN kernel
        was faster than the flash varlen kernel: 12.9 against 16.9 ms of backward a step at 0.5B dims). Other
        packs: on CUDA in fp16 / bf16 without dropout or sliding window, the flash-attention varlen kernel over
        cu_seqlens ("varlen"); otherwise the pack is gathered into a padded [n_seq, max_len] batch for one causal
        SDPA call and scattered back ("padded"; exact, since a causal query never sees the padding after its
        own sequence). "loop" (one SDPA
        call per sequence) is the old path, kept for comparison. The host-side sequence bounds come with the micro
        batch (MicroBatch.to keeps them) or are read once per micro batch (cached on the PackedSeqParams object),
        not once per layer.
        """
        layout = _packed_layout(packed_seq_params, query.device)
        t = query.size(0)
        impl = self.packed_impl
        dropout = self.dropout_p if self.training else 0.0
        if layout.static:  # a CUDA graph's fixed layout (engine/graphed_forward.py): no bounds on the host
            impl = "varlen"
        elif impl == "auto":  # equal lengths: a reshape, the same batched SDPA call (cuDNN on H100/H200) as unpacked
            varlen_ok = _varlen_supported(query) and self.window is None and dropout == 0.0
            impl = "varlen" if varlen_ok and not layout.uniform else "padded"
        if impl == "loop":
            out = self._packed_loop(query, key, value, layout.bounds)
        elif impl == "varlen":
            out = self._packed_varlen(query, key, value, layout)
        elif impl == "padded":
            out = self._packed_padded(query, key, value, layout)
        else:
            raise AssertionError(impl)  # checked in __init__
        if out.size(0) < t:  # padding after the last sequence attends to nothing
            out = torch.cat([out, out.new_zeros(t - out.size(0), *out.shape[1:])], dim=0)
        return out.reshape(t, -1)

    def _packed_loop(self, query, key, value, bounds):
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
            outs.append(self._attend(q, k, v)[0].permute(1, 0, 2))
        return torch.cat(outs, dim=0)

    def _packed_padded(self, query, key, value, layout):
        n, L, total = layout.num_seqs, layout.max_len, layout.total
        if layout.uniform:  # n sequences of the same length back to back: a plain reshape, no copy
            q, k, v = (_head(x, total).reshape(n, L, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))
            out = self._attend(q, k, v).transpose(1, 2)  # [n, L, nh, d]
            return out.reshape(total, *out.shape[2:])
        q, k, v = (x[layout.gather].transpose(1, 2) for x in (query, key, value))  # [n, heads, L, d]
        out = self._attend(q, k, v).transpose(1, 2).reshape(n * L, *q.shape[1:2], q.size(-1))
        return out.index_select(0, layout.valid_index)  # [total, nh, d] in pack order

    def _packed_varlen(self, query, key, value, layout):
        total = layout.total
        q, k, v = (_head(x, total) for x in (query, key, value))
        if self.num_heads != self.num_groups:  # the kernel is called with as many kv heads as query heads
            rep = self.num_heads // self.num_groups
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _VarlenFlash.apply(q.contiguous(), k.contiguous(), v.contiguous(), layout.cu, layout.max_len,
                                  self.scale)


def _head(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of x: x itself when it has n rows. A slice of every row still costs its backward a zeroed
    gradient the size of x and a copy into it, for each of q, k and v in every layer."""
    return x if x.size(0) == n else x[:n]


PACKED_IMPLS = ("auto", "varlen", "padded", "loop")
"""How packed (THD) micro batches are attended (ModelConfig.packed_attention): "auto" (varlen on CUDA when possible,
else padded), "varlen", "padded" or "loop"."""


class _PackedLayout:
    """Host and device views of one micro batch's cu_seqlens, built once and reused by every layer."""

    static = False
    """True for a CUDA graph's layout (static_layout), which knows only cu, the padded total and a length bound."""

    def __init__(self, cu: torch.Tensor, device, bounds: list[int] | None = None):
        """bounds: cu's values where the host knows them already (engine/batching.MicroBatch.to keeps them);
        else they are read from cu, the one host sync per micro batch."""
        bounds = [int(b) for b in (cu.tolist() if bounds is None else bounds)]
        self.cu_source = cu
        self.bounds = bounds
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        lengths = [n for n in lengths if n > 0]
        self.num_seqs = len(lengths)
        self.max_len = max(lengths)
        self.total = bounds[-1]
        self.uniform = bounds[0] == 0 and len(set(lengths)) == 1 and len(lengths) == len(bounds) - 1
        self.cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32, device=device) \
            if bounds[0] != 0 or len(lengths) != len(bounds) - 1 else cu.to(device=device, dtype=torch.int32)
        self._padded = None

    def _padded_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather, valid_index) for the padded path, built on the device from cu on first use (the varlen path
        never needs them): gather [n, L] picks each padded slot's token (positions past a sequence's end repeat
        its last token: finite values, never seen by real queries); valid_index [total] is each packed token's
        slot in the flattened [n * L] batch."""
        if self._padded is None:
            cu = self.cu.long()  # from 0, without empty sequences
            start, length = cu[:-1] + self.bounds[0], cu[1:] - cu[:-1]
            col = torch.arange(self.max_len, device=cu.device)
            gather = start[:, None] + torch.minimum(col[None, :], length[:, None] - 1)
            seq, pos = packed_index(cu, self.total - self.bounds[0])
            self._padded = gather, seq * self.max_len + pos
        return self._padded

    @property
    def gather(self) -> torch.Tensor:
        return self._padded_views()[0]

    @property
    def valid_index(self) -> torch.Tensor:
        return self._padded_views()[1]


def static_layout(cu: torch.Tensor, total: int, max_len: int) -> _PackedLayout:
    """The layout of a CUDA graph's packed micro batch (engine/graphed_forward.py): `cu` (int32, on the device) is
    rewritten between replays, so nothing is read from it on the host; `total` tokens, every sequence at most
    `max_len` long, empty sequences allowed. Only the varlen kernel runs it. Set it as the PackedSeqParams'
    `_mcore_rl_layout`."""
    layout = _PackedLayout.__new__(_PackedLayout)
    layout.static = True
    layout.cu_source = layout.cu = cu
    layout.bounds = None
    layout.num_seqs = cu.numel() - 1
    layout.total = total
    layout.max_len = max_len
    layout.uniform = False
    return layout


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def packed_bounds(params) -> torch.Tensor | None:
    """The sequence bounds the packed attention reads from Megatron's PackedSeqParams: the padded ones where
    present, else the plain ones. MicroBatch.to keeps the host's values of this same tensor."""
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


def _packed_layout(params, device) -> _PackedLayout:
    cu = packed_bounds(params)
    cached = getattr(params, "_mcore_rl_layout", None)
    if cached is None or cached.cu_source is not cu:
        known = getattr(params, "mcore_rl_host_bounds", None)  # (cu, its values), from MicroBatch.to
        cached = _PackedLayout(cu, device, known[1] if known is not None and known[0] is cu else None)
        params._mcore_rl_layout = cached
    return cached


def _varlen_supported(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and hasattr(torch.ops.aten,
                                                                              "_flash_attention_forward")


class _VarlenFlash(torch.autograd.Function):
    """Causal flash attention over packed sequences (aten's flash-attention varlen kernel, forward and backward).
    q, k, v: [total, heads, d] with equal head counts; cu: int32 [n + 1] sequence bounds starting at 0."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_state,
            unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None
