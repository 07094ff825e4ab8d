"""Micro batches for the engine: variable-length sequences split by a token budget, then padded or packed.

A sequence is a dict of tensors of one length L: "input_ids" (prompt + response token ids, 1-D) plus any per-token
fields the loss function or the model needs ("loss_mask", "advantages", "old_logprobs", ...; "routed_experts"
[L, num_layers, topk] for routing replay), all aligned with input_ids along their first dimension (entry i belongs
to token i). `make_micro_batches` groups sequences into micro batches of at most `max_tokens`
tokens (first-fit-decreasing into balanced bins) and lays each out either

* padded: `[b, s]`, s = the longest sequence of the micro batch, right-padded (causal attention never looks at
  the padding), or
* packed: `[1, t]`, t = the sum of the lengths, sequences back to back in Megatron's THD format with
  `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`; position ids restart at 0 per sequence.

Each MicroBatch remembers which original sequences it holds (`indices`), so per-token outputs can be put back in
the caller's order with `unpack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


def to_device(t: Tensor, device) -> Tensor:
    """`t` on `device`. A host tensor bound for a GPU goes through pinned memory with a non-blocking copy: a copy
    from pageable memory makes the host wait until the GPU has run everything queued before it, so the host could
    not queue a micro batch's kernels ahead of the GPU. The pinned buffer is kept by torch's host allocator until
    the copy is done, so `t` may change afterwards. Anything else is `t.to(device)`."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class MicroBatch:
    input_ids: Tensor
    """[b, s] padded, or [1, t] packed. int64."""
    position_ids: Tensor
    """Same shape as input_ids; restarts at 0 for every sequence."""
    valid_mask: Tensor
    """Same shape, bool: True on real tokens, False on padding."""
    seq_lengths: list[int]
    """Length of each sequence, in the order they appear in this micro batch."""
    indices: list[int]
    """Position of each of those sequences in the list given to make_micro_batches."""
    fields: dict[str, Tensor] = field(default_factory=dict)
    """Per-token fields of the sequences in the same layout as input_ids, plus their own trailing dimensions
    (padding filled with 0)."""
    packed_seq_params: object | None = None
    """megatron.core.packed_seq_params.PackedSeqParams for packed micro batches, else None."""
    seq_starts: list[int] = field(default_factory=list)
    """Packed: offset of each sequence in the [1, t] row. Padded: 0 for each row."""
    host_loss_mask: Tensor | None = field(default=None, init=False, repr=False)
    """The loss mask as the host had it before `to` moved the fields (None until then; set by `to` alone)."""
    _logit_positions: tuple | None = field(default=None, init=False, repr=False)

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)

    def __getitem__(self, key: str) -> Tensor:
        return self.fields[key]

    def logit_positions(self) -> tuple[tuple[Tensor, Tensor], bool]:
        """`models.lm_head.positions` of the loss mask (the positions whose logits the loss reads), found once, on
        the host: from the host's copy of the mask once the fields are on a GPU, where reading the mask back
        (nonzero) would make the host wait for the kernels queued before it. Host tensors."""
        if self._logit_positions is None:
            from mcore_rl.models import lm_head

            mask = self.host_loss_mask if self.host_loss_mask is not None else self.fields["loss_mask"]
            self._logit_positions = lm_head.positions(mask.cpu())
        return self._logit_positions

    def to(self, device) -> "MicroBatch":
        """Move every tensor (and the cu_seqlens) to `device` in place (the engine does this); returns self.
        Host tensors go to a GPU without blocking the host (`to_device`)."""
        mask = self.fields.get("loss_mask")
        if mask is not None and mask.device.type == "cpu":
            self.host_loss_mask = mask
        self.input_ids = to_device(self.input_ids, device)
        self.position_ids = to_device(self.position_ids, device)
        self.valid_mask = to_device(self.valid_mask, device)
        self.fields = {k: to_device(v, device) for k, v in self.fields.items()}
        p = self.packed_seq_params
        if p is not None:
            # the sequence bounds as the host knows them now, kept beside the moved tensor: the packed attention
            # (models/attention.py) then need not read them back from the device, a sync that would stop the host
            # from queueing the micro batch's kernels ahead of the GPU
            from mcore_rl.models.attention import packed_bounds

            cu = packed_bounds(p)
            host_bounds = cu.tolist() if cu is not None and cu.device.type == "cpu" else None
            # one copy of each distinct tensor: make_micro_batches gives queries and keys the same bounds, and the
            # RoPE and attention caches (models/rope.py, models/attention.py) key on the tensor's identity, so two
            # copies of one tensor would make every layer recompute what the first layer cached
            bounds = {name: getattr(p, name) for name in
                      ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")}
            moved: dict[int, Tensor] = {}  # by the identity of the host tensors, all alive in `bounds`
            for name, t in bounds.items():
                if t is not None:
                    if id(t) not in moved:
                        moved[id(t)] = to_device(t, device)
                    setattr(p, name, moved[id(t)])
            if host_bounds is not None:
                p.mcore_rl_host_bounds = (packed_bounds(p), host_bounds)
        return self


def _lengths(sequences: Sequence[dict[str, Tensor]]) -> list[int]:
    lengths = []
    for i, seq in enumerate(sequences):
        if "input_ids" not in seq:
            raise ValueError(f"sequence {i} has no 'input_ids' (keys: {sorted(seq)})")
        n = seq["input_ids"].numel()
        if n == 0:
            raise ValueError(f"sequence {i} is empty")
        if seq["input_ids"].dim() != 1:
            raise ValueError(f"sequence {i}: input_ids has shape {tuple(seq['input_ids'].shape)}, expected 1-D")
        for key, value in seq.items():
            if value.dim() < 1 or value.size(0) != n:
                raise ValueError(
                    f"sequence {i}: field {key!r} has shape {tuple(value.shape)}, expected ({n},) like input_ids "
                    f"(or ({n}, ...): one entry per token, with dimensions of its own)"
                )
        lengths.append(n)
    return lengths


def split_by_token_budget(lengths: Sequence[int], max_tokens: int, min_bins: int = 1,
                          multiple_of: int = 1) -> list[list[int]]:
    """Group sequence indices into bins of at most `max_tokens` tokens (sum of lengths).

    Longest first, each sequence goes to the least-filled bin it fits in (first-fit-decreasing with balancing), a
    new bin being opened when none fits. At least `min_bins` bins are made and the count is rounded up to a
    multiple of `multiple_of` (the interleaved pipeline schedule needs a multiple of the pipeline size). Within a
    bin, indices keep their original order; bins are ordered by their first index. Deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sequence {i} has {n} tokens, more than the micro-batch token budget max_tokens={max_tokens}; "
            "raise the budget (e.g. actor.max_tokens_per_micro_batch) to at least the longest prompt + response"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(max(min_bins, 1))]
    loads = [0] * len(bins)
    for i in order:
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= max_tokens]
        if fits:
            b = min(fits, key=lambda b: (loads[b], b))
        else:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    while len(bins) % multiple_of:
        bins.append([])
        loads.append(0)
    # Rebalance so that no bin is empty: move the last sequence of the fullest multi-sequence bin.
    for b in range(len(bins)):
        if bins[b]:
            continue
        donors = [d for d in range(len(bins)) if len(bins[d]) > 1]
        if not donors:
            raise ValueError(
                f"{len(lengths)} sequences cannot fill {len(bins)} micro batches (min_bins={min_bins}, "
                f"multiple_of={multiple_of}); give more sequences or lower the number of micro batches"
            )
        d = max(donors, key=lambda d: (loads[d], -d))
        moved = min(bins[d], key=lambda i: (lengths[i], i))
        bins[d].remove(moved)
        loads[d] -= lengths[moved]
        bins[b].append(moved)
        loads[b] += lengths[moved]
    bins = [sorted(b) for b in bins]
    bins.sort(key=lambda b: b[0])
    return bins


def pad_sequences(sequences: Sequence[dict[str, Tensor]], indices: Sequence[int], pad_id: int = 0,
                  pad_to_multiple_of: int = 1) -> MicroBatch:
    """Right-pad the chosen sequences into one [b, s] micro batch."""
    chosen = [sequences[i] for i in indices]
    lengths = _lengths(chosen)
    s = -(-max(lengths) // pad_to_multiple_of) * pad_to_multiple_of
    b = len(chosen)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    pos = torch.zeros((b, s), dtype=torch.long)
    valid = torch.zeros((b, s), dtype=torch.bool)
    fields = {k: torch.zeros((b, s, *v.shape[1:]), dtype=v.dtype) for k, v in chosen[0].items() if k != "input_ids"}
    for row, (seq, n) in enumerate(zip(chosen, lengths)):
        ids[row, :n] = seq["input_ids"]
        pos[row, :n] = torch.arange(n)
        valid[row, :n] = True
        for k in fields:
            fields[k][row, :n] = seq[k]
    return MicroBatch(ids, pos, valid, lengths, list(indices), fields, None, [0] * b)


def pack_sequences(sequences: Sequence[dict[str, Tensor]], indices: Sequence[int], pad_id: int = 0,
                   pad_to_multiple_of: int = 1) -> MicroBatch:
    """Concatenate the chosen sequences into one [1, t] THD micro batch.

    With pad_to_multiple_of > 1 the row is padded at the end to a multiple of it; the padding is its own segment
    in cu_seqlens (so rotary embeddings and attention treat it as a separate sequence) and valid_mask is False there.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    chosen = [sequences[i] for i in indices]
    lengths = _lengths(chosen)
    total = sum(lengths)
    t = -(-total // pad_to_multiple_of) * pad_to_multiple_of
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.full((1, t), pad_id, dtype=torch.long)
    ids[0, :total] = torch.cat([s["input_ids"].long() for s in chosen])
    pos = torch.zeros((1, t), dtype=torch.long)
    pos[0, :total] = torch.cat([torch.arange(n) for n in lengths])
    valid = torch.zeros((1, t), dtype=torch.bool)
    valid[0, :total] = True
    fields = {}
    for k, v in chosen[0].items():
        if k == "input_ids":
            continue
        f = torch.zeros((1, t, *v.shape[1:]), dtype=v.dtype)
        f[0, :total] = torch.cat([s[k] for s in chosen])
        fields[k] = f
    bounds = starts + ([t] if t > total else [])
    if t > total:
        pos[0, total:] = torch.arange(t - total)
    cu = torch.tensor(bounds, dtype=torch.int32)
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return MicroBatch(ids, pos, valid, lengths, list(indices), fields, params, starts[:-1])


def pad_micro_batch(mb: MicroBatch, length: int, rows: int = 1, pad_id: int = 0) -> MicroBatch:
    """A copy of `mb` padded to `length` tokens per row (and `rows` rows, padded layout): the interleaved
    pipeline schedule needs every micro batch to have one shape. Packed: the padding is one more segment in
    cu_seqlens. Padding is invalid (valid_mask False, fields 0), so outputs there are 0."""
    b, s = mb.input_ids.shape
    if s > length or b > rows:
        raise ValueError(f"cannot pad a [{b}, {s}] micro batch to [{rows}, {length}]")
    if mb.packed and rows != 1:
        raise ValueError("a packed micro batch has one row")

    def grow(t: Tensor, value) -> Tensor:
        out = torch.full((rows, length, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
        out[:b, :s] = t
        return out

    ids = grow(mb.input_ids, pad_id)
    pos = grow(mb.position_ids, 0)
    if length > s:
        pos[:, s:] = torch.arange(length - s, device=pos.device) if mb.packed else 0
    fields = {k: grow(v, 0) for k, v in mb.fields.items()}
    params = mb.packed_seq_params
    if mb.packed and length > s:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.cat([params.cu_seqlens_q, params.cu_seqlens_q.new_tensor([length])])
        max_len = max(params.max_seqlen_q, length - s)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return MicroBatch(ids, pos, grow(mb.valid_mask, False), list(mb.seq_lengths), list(mb.indices), fields,
                      params, list(mb.seq_starts))


def make_micro_batches(sequences: Sequence[dict[str, Tensor]], max_tokens: int | None = None, *,
                       micro_batch_size: int | None = None, packed: bool = True, pad_id: int = 0,
                       min_micro_batches: int = 1, multiple_of: int = 1,
                       pad_to_multiple_of: int = 1, keep_together: int = 1) -> list[MicroBatch]:
    """Split `sequences` into micro batches and lay them out (see the module docstring).

    Give `max_tokens` (dynamic batching: token budget per micro batch, counted without padding) or
    `micro_batch_size` (fixed number of sequences, in the given order; padded layout only makes sense there but
    packing works too). `min_micro_batches` / `multiple_of` shape the number of micro batches (e.g. at least
    the pipeline size, a multiple of it for the interleaved schedule). `keep_together=k` keeps every run of k
    consecutive sequences (0..k-1, k..2k-1, ...) in one micro batch, e.g. a DPO pair (chosen, rejected) whose
    loss needs both; the token budget then applies to the run.
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError(
            "give exactly one of max_tokens (token budget) or micro_batch_size (sequences per micro batch)"
        )
    if not sequences:
        raise ValueError("no sequences to batch")
    lengths = _lengths(sequences)
    if keep_together > 1:
        if len(sequences) % keep_together:
            raise ValueError(f"{len(sequences)} sequences do not split into runs of keep_together={keep_together}")
        if micro_batch_size is not None and micro_batch_size % keep_together:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) must be a multiple of keep_together "
                             f"({keep_together})")
    if max_tokens is not None:
        k = keep_together
        units = [sum(lengths[i:i + k]) for i in range(0, len(lengths), k)]
        bins = split_by_token_budget(units, max_tokens, min_micro_batches, multiple_of)
        bins = [[u * k + j for u in b for j in range(k)] for b in bins]
    else:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        bins = [list(range(i, min(i + micro_batch_size, len(sequences))))
                for i in range(0, len(sequences), micro_batch_size)]
        if len(bins) < min_micro_batches or len(bins) % multiple_of:
            raise ValueError(
                f"{len(bins)} micro batches of {micro_batch_size} sequences, but at least {min_micro_batches} "
                f"and a multiple of {multiple_of} are needed; change micro_batch_size or the number of sequences"
            )
    layout = pack_sequences if packed else pad_sequences
    return [layout(sequences, b, pad_id, pad_to_multiple_of) for b in bins]


def unpack(outputs: Sequence[Tensor], micro_batches: Sequence[MicroBatch]) -> list[Tensor]:
    """Per-token outputs of each micro batch (same layout as its input_ids) -> one 1-D tensor per original
    sequence, in the original order."""
    num = sum(len(mb.indices) for mb in micro_batches)
    result: list[Tensor | None] = [None] * num
    for out, mb in zip(outputs, micro_batches):
        for j, (i, n, start) in enumerate(zip(mb.indices, mb.seq_lengths, mb.seq_starts)):
            row = out[0, start:start + n] if mb.packed else out[j, :n]
            result[i] = row
    missing = [i for i, r in enumerate(result) if r is None]
    if missing:
        raise ValueError(f"micro batches do not cover sequences {missing[:10]}")
    return result
