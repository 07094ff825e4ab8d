"""Advantage estimators, registered by name (see `registry.py` for the calling convention).

Every estimator returns `(advantages, returns)`, both `[B, T]`, zero on padding, computed without autograd.
Inputs, by keyword (each estimator declares the ones it uses):

    response_mask: [B, T] 0/1   1 on tokens the policy generated (and is trained on); everything else is padding
    scores:        [B] float    outcome (sequence-level) reward of each sample
    group_ids:     [B] int      samples from the same prompt share an id; any ints, groups of any size
    token_rewards: [B, T] float per-token rewards, e.g. `scores_to_token_rewards` then `apply_kl_penalty`
    values:        [B, T] float critic values V(s_t) of the response tokens
    gamma, lam:    float        discount and GAE lambda

Masked tokens are skipped as if absent (rewards and values on them are ignored), so tool outputs inside a
multi-turn response break neither the return nor the GAE recursion. Outcome estimators broadcast the sequence
advantage to all response tokens and return `returns == advantages` (there is no critic to fit).
A group of one sample has no baseline to compare with: GRPO and RLOO give it advantage 0 (filter such groups
with `dynamic_sampling_filter`, or use `reinforce`, if you mean to learn from them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masking import last_token_index, masked_fill_padding, masked_whiten
from .registry import register_advantage


def _check_outcome_inputs(scores: Tensor, response_mask: Tensor, group_ids: Tensor | None = None) -> None:
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be [B] and response_mask [B, T]; got scores {tuple(scores.shape)} and response_mask "
            f"{tuple(response_mask.shape)}"
        )
    if group_ids is not None and group_ids.shape != scores.shape:
        raise ValueError(f"group_ids must be [B] like scores {tuple(scores.shape)}; got {tuple(group_ids.shape)}")
    if group_ids is not None and group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor (got {group_ids.dtype})")


def _check_token_inputs(response_mask: Tensor, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != response_mask.shape:
            raise ValueError(
                f"{name} must be [B, T] like response_mask {tuple(response_mask.shape)}; got {tuple(t.shape)}"
            )


def _float(t: Tensor) -> Tensor:
    """At least float32 (bf16/int rewards are upcast), float64 kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _broadcast(seq_values: Tensor, response_mask: Tensor) -> Tensor:
    return masked_fill_padding(seq_values[:, None].expand(response_mask.shape), response_mask)


def group_statistics(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample statistics of its group: (group mean [B], unbiased group std [B], group size [B] int64).

    The std of a group of one is 0 (not NaN). scores: [B] float; group_ids: [B] int.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = scores.new_zeros(counts.numel()).index_add_(0, inverse, scores)
    mean = sums / counts.to(scores.dtype)
    dev = scores - mean[inverse]
    sq = scores.new_zeros(counts.numel()).index_add_(0, inverse, dev * dev)
    std = (sq / (counts - 1).clamp(min=1).to(scores.dtype)).sqrt()
    return mean[inverse], std[inverse], counts[inverse]


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence reward on its last response token (the usual input of GAE / REINFORCE++).

    scores: [B] float; response_mask: [B, T] 0/1. Returns [B, T] float, zero elsewhere. A row without response
    tokens gets no reward (there is no token to credit).
    """
    _check_outcome_inputs(scores, response_mask)
    scores = _float(scores)
    last = last_token_index(response_mask)
    rewards = scores.new_zeros(response_mask.shape)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} over the response tokens (masked tokens skipped).

    token_rewards: [B, T] float; response_mask: [B, T] 0/1. Returns [B, T], zero on padding.
    """
    _check_token_inputs(response_mask, token_rewards=token_rewards)
    mask = response_mask.bool()
    rewards = _float(token_rewards)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_fill_padding(returns, mask)


@register_advantage("gae")
@torch.no_grad()
def gae_advantages(
    *,
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t),    A_t = sum_l (gamma * lam)^l delta_{t+l},    R_t = A_t + V(s_t)

    with V = 0 after the last response token. token_rewards: [B, T] float; values: [B, T] float;
    response_mask: [B, T] 0/1. Returns (advantages [B, T], returns [B, T]); returns are the critic's targets and
    are computed before whitening. `whiten` normalises advantages over the batch's response tokens (PPO practice).
    """
    _check_token_inputs(response_mask, token_rewards=token_rewards, values=values)
    mask = response_mask.bool()
    dtype = torch.promote_types(_float(token_rewards).dtype, _float(values).dtype)
    rewards, values = token_rewards.to(dtype), values.to(dtype)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    last_gae = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = last_gae
    returns = masked_fill_padding(advantages + values, mask)
    advantages = masked_whiten(advantages, mask) if whiten else masked_fill_padding(advantages, mask)
    return advantages, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo_advantages(
    *, scores: Tensor, group_ids: Tensor, response_mask: Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (Shao et al. 2024, DeepSeekMath, sec. 4.1.2, outcome supervision).

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        (std: unbiased, over the samples of i's group g)

    `norm_by_std=False` drops the division (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training").
    scores: [B] float; group_ids: [B] int; response_mask: [B, T] 0/1. Returns (advantages, returns) [B, T],
    returns == advantages. All-equal groups and groups of one get 0.
    """
    _check_outcome_inputs(scores, response_mask, group_ids)
    scores = _float(scores)
    mean, std, _ = group_statistics(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage("dr_grpo")
@torch.no_grad()
def dr_grpo_advantages(*, scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_g(r).

    Same as `grpo` with norm_by_std=False; pair it with loss_agg_mode "seq-mean-token-sum-norm" for the full
    Dr. GRPO objective. scores: [B]; group_ids: [B] int; response_mask: [B, T]. Returns (advantages, returns).
    """
    return grpo_advantages(scores=scores, group_ids=group_ids, response_mask=response_mask, norm_by_std=False)


@register_advantage("rloo")
@torch.no_grad()
def rloo_advantages(*, scores: Tensor, group_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

        A_i = r_i - 1/(n-1) sum_{j in g, j != i} r_j  =  n/(n-1) * (r_i - mean_g(r))

    scores: [B] float; group_ids: [B] int; response_mask: [B, T] 0/1. Returns (advantages, returns) [B, T],
    returns == advantages. A group of one (no other sample to form the baseline) gets 0.
    """
    _check_outcome_inputs(scores, response_mask, group_ids)
    scores = _float(scores)
    mean, _, counts = group_statistics(scores, group_ids)
    n = counts.to(scores.dtype)
    adv = torch.where(counts > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage("reinforce")
@torch.no_grad()
def reinforce_advantages(
    *, scores: Tensor, response_mask: Tensor, baseline: str | Tensor = "batch_mean"
) -> tuple[Tensor, Tensor]:
    """REINFORCE with a baseline (Williams 1992): A_i = r_i - b.

    baseline: "batch_mean" (b = mean of the batch's scores), "none" (b = 0), or a [B] tensor (e.g. a value model's
    prediction per prompt). scores: [B] float; response_mask: [B, T] 0/1. Returns (advantages, returns) [B, T],
    returns == advantages.
    """
    _check_outcome_inputs(scores, response_mask)
    scores = _float(scores)
    if isinstance(baseline, Tensor):
        if baseline.shape != scores.shape:
            raise ValueError(
                f"baseline tensor must be [B] like scores {tuple(scores.shape)}; got {tuple(baseline.shape)}"
            )
        adv = scores - baseline.to(scores.dtype)
    elif baseline == "batch_mean":
        adv = scores - scores.mean() if scores.numel() > 0 else scores
    elif baseline == "none":
        adv = scores
    else:
        raise ValueError(f"unknown baseline '{baseline}'; use 'batch_mean', 'none' or a [B] tensor")
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    *, token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

        G_t = sum_{s >= t} gamma^(s-t) r_s,      A_t = (G_t - mean(G)) / std(G)    (over all response tokens)

    where r_s carries the sequence reward on the last token minus the per-token KL penalty
    (`scores_to_token_rewards` then `apply_kl_penalty`). token_rewards: [B, T] float; response_mask: [B, T] 0/1.
    Returns (advantages [B, T], returns G [B, T]).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    *, scores: Tensor, group_ids: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then normalise over the whole batch.

        A_i = (r_i - mean_g(r)),  then whitened over all response tokens of the batch

    scores: [B] float; group_ids: [B] int; response_mask: [B, T] 0/1. Returns (advantages, returns) [B, T],
    returns = the group-centred scores before whitening.
    """
    _check_outcome_inputs(scores, response_mask, group_ids)
    scores = _float(scores)
    mean, _, _ = group_statistics(scores, group_ids)
    centred = _broadcast(scores - mean, response_mask)
    return masked_whiten(centred, response_mask), centred
