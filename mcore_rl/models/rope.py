"""Rotary embedding of packed (THD) micro batches in one call per layer, without host syncs.

Megatron-Core's unfused RoPE for packed sequences (`rope_utils._apply_rotary_pos_emb_thd`, used when neither
Transformer Engine nor apex provides the fused kernel) reads the sequence lengths to the host
(`cu_seqlens.tolist()`), splits the tokens per sequence and concatenates one frequency slice per sequence, for
queries and keys of every layer: two device-to-host syncs per layer, which stop the host from queueing work ahead
of the GPU, plus a Python loop over the sequences of the pack. The frequencies it builds are, token by token,
`freqs[position of the token in its sequence]` (or `freqs[token index]` when `freqs` covers the whole pack),
so `apply_rotary_pos_emb` here gathers them with one index computed on the device (once per micro batch, cached)
and applies Megatron's own bshd kernel to the pack. Same values, bit for bit (tests/models/test_rope.py).

Everything else (no cu_seqlens, fused RoPE, context parallelism) goes to Megatron's function unchanged.
`install()` points Megatron's attention module at this function; builder.build_model calls it.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

_megatron_apply = rope_utils.apply_rotary_pos_emb
_cache: dict = {"key": None, "freqs": None}


def packed_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of each of `num_tokens` packed tokens within its sequence ([t] int64; device ops only)."""
    cu = cu_seqlens.to(torch.long)
    idx = torch.arange(num_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), idx, right=True).clamp_(max=cu.numel() - 1)
    return idx - cu[seq]


def _packed_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    key = (cu_seqlens, freqs, num_tokens)
    cached = _cache["key"]
    if cached is not None and cached[0] is cu_seqlens and cached[1] is freqs and cached[2] == num_tokens:
        return _cache["freqs"]
    if freqs.size(0) == num_tokens:  # freqs covers every position of the pack (Megatron's offset mapping)
        packed = freqs[:num_tokens]
    else:
        packed = freqs[packed_positions(cu_seqlens, num_tokens).to(freqs.device)]
    _cache["key"], _cache["freqs"] = key, packed
    return packed


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron's `apply_rotary_pos_emb` with the packed, unfused, single-context-rank case done in one call."""
    if cu_seqlens is None or config.apply_rope_fusion or (cp_group is not None and cp_group.size() > 1) or \
            (cp_group is None and _context_parallel_size() > 1):
        return _megatron_apply(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    packed = _packed_freqs(freqs, cu_seqlens, t.size(0))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), packed, rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention, mscale=mscale,
    ).squeeze(1)


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def install() -> None:
    """Make Megatron's attention layers call `apply_rotary_pos_emb` above (idempotent)."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
