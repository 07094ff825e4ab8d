"""Critic loss: squared error to the returns, with PPO's value clipping."""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .masking import masked_fill_padding, masked_mean, masked_var


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Tensor | float | None = None,
    global_num_seqs: Tensor | float | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO as in OpenAI baselines' ppo2; Andrychowicz et al. 2021, "What Matters in On-Policy
    Reinforcement Learning?").

        V_clip = old_values + clip(values - old_values, -cliprange_value, cliprange_value)
        l_t    = 0.5 * max((values - returns)^2, (V_clip - returns)^2)        (0.5 * (values - returns)^2 if None)

    values: [B, T] float, with grad (current critic); old_values: [B, T] float (critic at rollout time);
    returns: [B, T] float (targets from the estimator); response_mask: [B, T] 0/1. Aggregation as in
    `aggregate_loss`. Returns (loss 0-dim, metrics: vf_clip_frac, vpred_mean, explained_variance) where
    explained_variance = 1 - Var(returns - values) / Var(returns) over this batch's response tokens.
    """
    for name, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        if t.shape != response_mask.shape:
            raise ValueError(
                f"{name} must be [B, T] like response_mask {tuple(response_mask.shape)}; got {tuple(t.shape)}"
            )
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 or None; got {cliprange_value}")
    mask = response_mask.bool()
    values = masked_fill_padding(values, mask)
    returns = masked_fill_padding(returns.detach().to(values.dtype), mask)
    err = (values - returns) ** 2
    clipped = torch.zeros_like(mask)
    if cliprange_value is not None:
        old_values = masked_fill_padding(old_values.detach().to(values.dtype), mask)
        values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        err_clipped = (values_clipped - returns) ** 2
        clipped = err_clipped.detach() > err.detach()
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * aggregate_loss(
        err, mask, loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        max_response_length=max_response_length,
    )
    with torch.no_grad():
        v = values.detach()
        var_returns = masked_var(returns, mask)
        metrics = {
            "vf_clip_frac": masked_mean(clipped.to(v.dtype), mask),
            "vpred_mean": masked_mean(v, mask),
            "explained_variance": 1.0 - masked_var(returns - v, mask) / var_returns.clamp(min=1e-8),
        }
    return loss, metrics
