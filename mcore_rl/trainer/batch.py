"""Step data built in one place: rollout samples and preference pairs -> the engine's per-token sequences
(step_data.Sequences), and conversions between response space and token space.

Two layouts are used in one step:

* response space: `[B, R]` tensors padded to the longest response, entry t of row i belongs to response token t
  of sample i. The algorithms (advantages, KL penalty, metrics) work here, on the whole step's batch.
* token space: per sample, 1-D tensors over prompt + response (length P + R), entry j belongs to token j, which
  is the layout of the engine's sequences and outputs (mcore_rl.engine.batching). Prompt entries are 0 and
  masked out by `loss_mask`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mcore_rl.trainer.step_data import Sequences
from mcore_rl.types import Sample


def response_mask(samples: Sequence[Sample]) -> Tensor:
    """[B, R] float32 ones over each sample's response tokens, zeros over padding and over the tokens a tool or
    the chat template put into a multi-turn response (Sample.response_mask): they carry no loss, KL or entropy
    and are not in the rollout/trainer log-prob gap."""
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    width = max(1, int(lengths.max()) if len(samples) else 1)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    for i, s in enumerate(samples):
        if s.response_mask is not None:
            mask[i, :len(s.response_mask)] = torch.tensor(s.response_mask, dtype=torch.float32)
    return mask


def to_response_space(per_token: Sequence[Tensor], samples: Sequence[Sample], width: int) -> Tensor:
    """Token-space tensors (one per sample, length P + R) -> [B, width] response-space tensor, zero padded."""
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, (t, s) in enumerate(zip(per_token, samples)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        out[i, :r] = t[p:p + r].float()
    return out


def to_token_space(resp: Tensor, samples: Sequence[Sample]) -> list[Tensor]:
    """[B, R] response-space tensor -> one token-space tensor per sample (zeros over the prompt)."""
    out = []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        t = torch.zeros(p + r, dtype=torch.float32)
        t[p:] = resp[i, :r]
        out.append(t)
    return out


def rollout_logprobs(samples: Sequence[Sample], width: int) -> Tensor:
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, s in enumerate(samples):
        out[i, :len(s.rollout_logprobs)] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return out


def sample_sequences(samples: Sequence[Sample], with_routes: bool = True, **fields: Sequence[Tensor]) -> Sequences:
    """Rollout samples as engine sequences: prompt + response ids, loss_mask on the response (on the model's own
    tokens of a multi-turn response: Sample.response_mask), plus token-space
    fields (advantages=..., ref_logprobs=...), and the rollout's routes when the samples carry them (routing
    replay) and with_routes."""
    ids, masks = [], []
    for s in samples:
        p, r = len(s.prompt_ids), len(s.response_ids)
        mask = torch.zeros(p + r, dtype=torch.float32)
        mask[p:] = 1.0 if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.float32)
        ids.append(torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long))
        masks.append(mask)
    routes = token_routes(samples) if with_routes else None
    return Sequences(ids, masks, **{k: list(v) for k, v in fields.items()}, routed_experts=routes)


def token_routes(samples: Sequence[Sample]) -> list[Tensor] | None:
    """Each sample's rollout routes [P + R - 1, L, K] -> token space [P + R, L, K] (Sequences.routed_experts), or
    None when the samples carry none."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(samples)} samples carry no routed experts: routing replay "
                         "needs the engine's routes for every sample")
    out = []
    for s in samples:
        routes = s.routed_experts
        if routes.size(0) != s.num_tokens - 1:
            raise ValueError(f"a sample of {s.num_tokens} tokens carries routes for {routes.size(0)} (expected one "
                             "per token but the last)")
        # The last token was never run forward by the engine; its output is not read, so any k experts do.
        last = torch.arange(routes.size(2), dtype=routes.dtype).expand(1, *routes.shape[1:])
        out.append(torch.cat([routes, last]))
    return out


def pair_sequences(pairs) -> Sequences:
    """Preference pairs (data.preference items: prompt_ids, chosen_ids, rejected_ids) as consecutive (chosen,
    rejected) sequences with loss_mask on the response: the layout dpo_loss_fn reads."""
    ids, masks = [], []
    for it in pairs:
        for resp in (it.chosen_ids, it.rejected_ids):
            seq = torch.tensor(list(it.prompt_ids) + list(resp), dtype=torch.long)
            mask = torch.zeros(len(seq), dtype=torch.float32)
            mask[len(it.prompt_ids):] = 1.0
            ids.append(seq)
            masks.append(mask)
    return Sequences(ids, masks)


def shard(n: int, rank: int, world: int) -> list[int]:
    """Indices of rank's contiguous share of n items (sizes differ by at most one)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def split_even(indices: Sequence[int], parts: int) -> list[list[int]]:
    base, extra = divmod(len(indices), parts)
    out, start = [], 0
    for k in range(parts):
        size = base + (1 if k < extra else 0)
        out.append(list(indices[start:start + size]))
        start += size
    return out


def rows(x: Tensor, mb) -> Tensor:
    """A micro batch's per-token tensor ([b, s] padded or [1, t] packed) -> [num_seqs, max_len] rows, zero padded.

    Differentiable; the algorithms' per-sequence aggregation modes need one row per sequence.
    """
    if not mb.packed:
        return x
    width = max(mb.seq_lengths)
    idx = torch.zeros(len(mb.seq_lengths), width, dtype=torch.long, device=x.device)
    valid = torch.zeros(len(mb.seq_lengths), width, dtype=torch.bool, device=x.device)
    for j, (start, n) in enumerate(zip(mb.seq_starts, mb.seq_lengths)):
        idx[j, :n] = torch.arange(start, start + n, device=x.device)
        valid[j, :n] = True
    return torch.where(valid, x[0][idx], torch.zeros((), dtype=x.dtype, device=x.device))
