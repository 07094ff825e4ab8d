"""HF tensors <-> one tensor-parallel shard of a Megatron parameter. Pure tensor functions, no process groups.

`to_shard` only slices its inputs along one dimension (`t[a:b]`, `t[:, a:b]`, `t[:]`) before any other operation,
so it also accepts safetensors' lazy slices and then reads only this rank's part from disk.

Megatron layouts (megatron-core 0.16, SelfAttention.get_query_key_value_tensors, MLP with gated_linear_unit):
* linear_qkv.weight is [ng * (np/ng + 2) * hd, h]: per query group g the np/ng query heads of g, then k_g, then v_g.
  TP rank r holds groups [r*ng/tp, (r+1)*ng/tp), i.e. a contiguous 1/tp of that interleaved tensor.
* linear_fc1.weight on TP rank r is [gate rows of r; up rows of r] ([2*f/tp, h]).
* embedding / output layer rows are the vocabulary zero-padded to a multiple of tp, split evenly.
"""

from __future__ import annotations

import torch

from mcore_rl.bridge.maps import Dims, Kind


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def to_shard(kind: Kind, hf_tensors: list, tp: int, rank: int, dims: Dims) -> torch.Tensor:
    """TP rank `rank`'s shard of the Megatron parameter made from `hf_tensors` (in the rule's HF order)."""
    if kind == Kind.REPLICATED:
        return hf_tensors[0][:]
    if kind == Kind.ROW:
        return _row_shard(hf_tensors[0], tp, rank)
    if kind == Kind.VOCAB:
        return _vocab_shard(hf_tensors[0], tp, rank, dims.vocab)
    if kind == Kind.QKV:
        return _qkv_shard(hf_tensors, tp, rank, dims)
    if kind == Kind.GATE_UP:
        gate, up = hf_tensors
        f = _shape(gate)[0] // tp  # dense ffn, or one expert's
        return torch.cat([gate[rank * f:(rank + 1) * f], up[rank * f:(rank + 1) * f]], dim=0)
    raise AssertionError(f"unknown kind {kind}")


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def _row_shard(t, tp: int, rank: int) -> torch.Tensor:
    n = _shape(t)[1] // tp
    return t[:, rank * n:(rank + 1) * n]


def _vocab_shard(t, tp: int, rank: int, vocab: int) -> torch.Tensor:
    rows = padded_vocab(vocab, tp) // tp
    start, end = rank * rows, (rank + 1) * rows
    part = t[start:min(end, vocab)] if start < vocab else None
    if part is not None and part.shape[0] == rows:
        return part
    width = _shape(t)[1:]
    pad_rows = rows - (0 if part is None else part.shape[0])
    dtype = part.dtype if part is not None else t[0:1].dtype
    pad = torch.zeros(pad_rows, *width, dtype=dtype)
    return pad if part is None else torch.cat([part, pad], dim=0)


def _qkv_shard(hf_tensors: list, tp: int, rank: int, dims: Dims) -> torch.Tensor:
    q, k, v = hf_tensors
    hd = dims.head_dim
    groups = dims.num_groups // tp
    heads = dims.num_heads // tp
    q = q[rank * heads * hd:(rank + 1) * heads * hd]
    k = k[rank * groups * hd:(rank + 1) * groups * hd]
    v = v[rank * groups * hd:(rank + 1) * groups * hd]
    rest = tuple(q.shape[1:])  # (h,) for weights, () for biases
    q = q.reshape(groups, (heads // groups) * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def from_shards(kind: Kind, shards: list[torch.Tensor], dims: Dims) -> list[torch.Tensor]:
    """The HF tensors (in the rule's HF order) from every TP rank's shard of a Megatron parameter, rank order."""
    if kind == Kind.REPLICATED:
        return [shards[0]]
    if kind == Kind.ROW:
        return [torch.cat(shards, dim=1)]
    if kind == Kind.VOCAB:
        return [torch.cat(shards, dim=0)[:dims.vocab]]
    if kind == Kind.QKV:
        full = torch.cat(shards, dim=0)
        rest = tuple(full.shape[1:])
        hd = dims.head_dim
        per_group = dims.num_heads // dims.num_groups
        full = full.reshape(dims.num_groups, (per_group + 2) * hd, *rest)
        q, k, v = torch.split(full, [per_group * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if kind == Kind.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise AssertionError(f"unknown kind {kind}")


def shard_shape(kind: Kind, hf_shapes: list[tuple[int, ...]], tp: int, dims: Dims) -> tuple[int, ...]:
    """Shape of one TP shard of the Megatron parameter, from the HF shapes."""
    first = hf_shapes[0]
    if kind == Kind.REPLICATED:
        return first
    if kind == Kind.ROW:
        return (first[0], first[1] // tp)
    if kind == Kind.VOCAB:
        return (padded_vocab(dims.vocab, tp) // tp, *first[1:])
    if kind in (Kind.QKV, Kind.GATE_UP):
        return (sum(s[0] for s in hf_shapes) // tp, *first[1:])
    raise AssertionError(f"unknown kind {kind}")
