"""Core attention through torch.nn.functional.scaled_dot_product_attention, plugged in by ModuleSpec.

Megatron-Core's local DotProductAttention materialises the [b*heads, s, s] score matrix: at 1.5B dims and seq
2048 it runs out of memory on an H200, and at 0.5B it is 2.3x slower than SDPA (../shared/FACTS.md). SDPA
picks a flash / memory-efficient kernel on GPU and a fused kernel on CPU.

Supports grouped-query attention, causal masking, an optional sliding window (Mistral), and packed
sequences (THD format: Megatron passes `packed_seq_params` with cu_seqlens; each sequence attends only to
itself). Attention dropout is applied through SDPA's dropout_p under Megatron's RNG tracker.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule


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
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPA attention does not support context parallelism; use model.attention=te")
        tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        # HF puts the sliding window on the config; the builder copies it here (None = full causal).
        self.window = getattr(config, "mcore_rl_sliding_window", None)

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
        """query: [t, nh, d], key/value: [t, ng, d] holding several sequences back to back."""
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        bounds = cu.tolist()  # one host sync per layer per micro batch, small next to the attention itself
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
            outs.append(self._attend(q, k, v)[0].permute(1, 0, 2))
        out = torch.cat(outs, dim=0)
        if out.size(0) < query.size(0):  # padding after the last sequence attends to nothing
            pad = query.new_zeros(query.size(0) - out.size(0), *out.shape[1:])
            out = torch.cat([out, pad], dim=0)
        return out.reshape(out.size(0), -1)
