"""Rotary embedding of packed (THD) micro batches in one call per layer, without host syncs.

Megatron-Core's unfused RoPE for packed sequences (`rope_utils._apply_rotary_pos_emb_thd`, used when neither
Transformer Engine nor apex provides the fused kernel) reads the sequence lengths to the host
(`cu_seqlens.tolist()`), splits the tokens per sequence and concatenates one frequency slice per sequence, for
queries and keys of every layer: two device-to-host syncs per layer, which stop the host from queueing work ahead
of the GPU, plus a Python loop over the sequences of the pack. The frequencies it builds are, token by token,
`freqs[position of the token in its sequence]` (or `freqs[token index]` when `freqs` covers the whole pack),
so `apply_rotary_pos_emb` here gathers them with one index computed on the device (once per micro batch, cached)
and applies the rotation to the whole pack at once. The cosines and sines are computed once per micro batch, not
per layer. The rotation itself (split, rotate-half, two products, sum, concatenation: about ten kernels forward
and as many backward, per tensor and layer) can be one torch.compile'd kernel each way (ModelConfig.compile_rope).
Eager, it is Megatron's bshd formula op for op: same values bit for bit (tests/models/test_rope.py); compiled, it
rounds once where eager rounds after each op (bf16).

Everything else (no cu_seqlens, fused RoPE, context parallelism) goes to Megatron's function unchanged.
`install(packed, compile)` points Megatron's attention module at this function (or back at Megatron's);
builder.build_model calls it with ModelConfig.packed_rope and compile_rope. Megatron's attention calls one
module-level function, so the choice is process-wide: the last model built sets it.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.models.common.embeddings import rope_utils

COMPILE_MODES = ("off", "on", "auto")
"""ModelConfig.compile_rope: torch.compile the rotation always, never, or for tensors on a GPU."""

_megatron_apply = rope_utils.apply_rotary_pos_emb
_cache: dict = {"key": None, "value": None}
_compiled = None


def packed_index(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `num_tokens` packed tokens, its sequence and its position within it ([t] int64 each; device ops
    only). Tokens past the last bound count as the last sequence's."""
    cu = cu_seqlens.to(torch.long)
    idx = torch.arange(num_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), idx, right=True).clamp_(max=cu.numel() - 1)
    return seq, idx - cu[seq]


def packed_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of each of `num_tokens` packed tokens within its sequence ([t] int64; device ops only)."""
    return packed_index(cu_seqlens, num_tokens)[1]


def _packed_cos_sin(freqs, cu_seqlens, num_tokens: int, dtype, mscale: float, interleaved: bool):
    """cos / sin of every packed token's frequencies in `dtype`, Megatron's rounding: [t, 1, rot_dim], to
    broadcast over a [t, heads, d] tensor, or [t, 1, 1, rot_dim] for the interleaved rotation, which needs Megatron's
    4-d layout. One entry cached: every layer of a micro batch asks for the same (queries and keys too)."""
    key = (cu_seqlens, freqs, num_tokens, dtype, mscale, interleaved)
    cached = _cache["key"]
    if cached is not None and cached[0] is cu_seqlens and cached[1] is freqs and cached[2:] == key[2:]:
        return _cache["value"]
    if freqs.size(0) == num_tokens:  # freqs covers every position of the pack (Megatron's offset mapping)
        packed = freqs[:num_tokens]
    else:
        packed = freqs[packed_positions(cu_seqlens, num_tokens).to(freqs.device)]
    if not interleaved:
        packed = packed.reshape(num_tokens, 1, packed.size(-1))
    value = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
    _cache["key"], _cache["value"] = key, value
    return value


def clear_cache() -> None:
    """Forget the cached cos / sin (engine/graphed_forward.py: a CUDA graph must compute them inside the capture,
    not bake in a tensor cached before it)."""
    _cache["key"] = _cache["value"] = None


def _rotate(t, cos, sin, interleaved: bool):
    """Megatron's `_apply_rotary_pos_emb_bshd` after its cos / sin (no multi-latent attention), op for op."""
    rot_dim = cos.shape[-1]
    x, x_pass = t[..., :rot_dim], t[..., rot_dim:]
    x = (x * cos) + (rope_utils._rotate_half(x, interleaved) * sin)
    return torch.cat((x, x_pass), dim=-1)


def _rotate_fn(device: torch.device, compile: str):
    global _compiled
    if compile == "on" or (compile == "auto" and device.type == "cuda"):
        if _compiled is None:
            _compiled = torch.compile(_rotate, dynamic=True)
        return _compiled
    return _rotate


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None, *,
                         compile: str = "off"):
    """Megatron's `apply_rotary_pos_emb` with the packed, unfused, single-context-rank case done in one call.
    compile: one of COMPILE_MODES (ModelConfig.compile_rope)."""
    if cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention or \
            (cp_group is not None and cp_group.size() > 1) or (cp_group is None and _context_parallel_size() > 1):
        return _megatron_apply(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    interleaved = config.rotary_interleaved
    cos, sin = _packed_cos_sin(freqs, cu_seqlens, t.size(0), t.dtype, mscale, interleaved)
    if interleaved:  # Megatron's interleaved rotate-half indexes a 4-d [s, b, heads, d] tensor
        return _rotate_fn(t.device, compile)(t.unsqueeze(1), cos, sin, True).squeeze(1)
    # the same products on [t, heads, d] directly: no unsqueeze / squeeze (and their backward) per call
    return _rotate_fn(t.device, compile)(t, cos, sin, False)


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def install(packed: bool = True, compile: str = "off") -> None:
    """Make Megatron's attention layers call `apply_rotary_pos_emb` above with `compile` (packed=True), or
    Megatron's own function (packed=False). Idempotent; process-wide (see the module docstring)."""
    from megatron.core.transformer import attention

    if compile not in COMPILE_MODES:
        raise ValueError(f"model.compile_rope must be one of {COMPILE_MODES}, got {compile!r}")
    if not packed:
        attention.apply_rotary_pos_emb = _megatron_apply
    elif compile == "off":
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    else:
        attention.apply_rotary_pos_emb = partial(apply_rotary_pos_emb, compile=compile)
