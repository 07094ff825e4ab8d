"""DAPO's data-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

Clip-higher is `ppo_policy_loss(clip_ratio_high > clip_ratio_low)` and the token-level loss is
loss_agg_mode "token-mean"; this file holds dynamic sampling and overlong reward shaping.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def dynamic_sampling_filter(scores: Tensor, group_ids: Tensor, atol: float = 0.0) -> tuple[Tensor, int]:
    """Dynamic sampling (DAPO's constraint 0 < |{o_i correct}| < G): drop groups without reward variance.

    A group whose rewards all lie within `atol` of each other (all correct, all wrong, or a single sample) gives
    every sample a zero group-relative advantage, so it only dilutes the batch. The trainer keeps the rest and,
    as DAPO does, samples more prompts until the batch is full.
    scores: [B] float; group_ids: [B] int (any ints, groups of any size). Returns (keep_mask [B] bool,
    num_dropped_groups) -- an int, since deciding to sample more happens on the host anyway.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must both be [B]; got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor (got {group_ids.dtype})")
    if atol < 0:
        raise ValueError(f"atol must be >= 0; got {atol}")
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    group_max = scores.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, scores, reduce="amax")
    group_min = scores.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse, scores, reduce="amin")
    keep_group = (group_max - group_min) > atol
    return keep_group[inverse], int((~keep_group).sum())


def overlong_penalty(
    response_lengths: Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong punishment (DAPO, sec. "Overlong Reward Shaping"), to be added to the task reward.

        R_length(y) = 0                                        if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache      if L_max - L_cache < |y| <= L_max
                    = -1                                       if |y| > L_max
    scaled by penalty_factor (L_max = max_length, L_cache = buffer_length; DAPO: 20480 and 4096).
    response_lengths: [B] int or float (response tokens per sample). Returns [B] float32 (float64 kept), <= 0.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be > 0; got {max_length}")
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, max_length={max_length}]; got {buffer_length}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0; got {penalty_factor}")
    lengths = response_lengths.to(torch.promote_types(response_lengths.dtype, torch.float32))
    expected = max_length - buffer_length
    penalty = ((expected - lengths) / buffer_length).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor
