"""Offline preference losses: DPO (sigmoid, label-smoothed / conservative), IPO and KTO.

Inputs are summed log-probs of each response under the policy (with grad) and the frozen reference, `[B]`.
Losses average over pairs (or examples); pass `global_num_pairs` / `global_num_examples` (the mini-batch total
over micro batches and DP ranks) to get a contribution that sums to the full-batch loss, as in `aggregation.py`.
Implicit rewards are beta * (logps - ref_logps); metrics are detached 0-dim tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo")


def _mean(x: Tensor) -> Tensor:
    return x.mean() if x.numel() > 0 else x.new_zeros(())


def _normalise(losses: Tensor, global_count: Tensor | float | None) -> Tensor:
    count = losses.numel() if global_count is None else global_count
    return losses.sum() / torch.as_tensor(count, dtype=losses.dtype, device=losses.device).clamp(min=1)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    global_num_pairs: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Preference Optimization and IPO on pairs (chosen y_w, rejected y_l).

        h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
        sigmoid (Rafailov et al. 2023, eq. 7), with label smoothing eps (conservative DPO, Mitchell 2023,
        "A note on DPO with noisy preferences"):  l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
        ipo (Azar et al. 2023, eq. 17, beta = tau):  l = (h - 1 / (2 beta))^2

    The IPO paper averages log-probs over tokens; pass length-normalised log-probs for that variant.
    All inputs [B] float (the two reference tensors are detached). Returns (loss 0-dim, metrics:
    rewards_chosen, rewards_rejected, reward_margin, reward_accuracy (fraction with chosen reward > rejected)).
    """
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"unknown loss_type '{loss_type}'; known: {', '.join(PREFERENCE_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5); got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing > 0:
        raise ValueError(f"label_smoothing ({label_smoothing}) applies to loss_type 'sigmoid' only, not 'ipo'")
    inputs = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    shapes = {tuple(t.shape) for t in inputs}
    if len(shapes) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss inputs must all be [B]; got shapes {sorted(shapes)}")

    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    h = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios.detach()
        rejected_rewards = beta * rejected_logratios.detach()
        metrics = {
            "rewards_chosen": _mean(chosen_rewards),
            "rewards_rejected": _mean(rejected_rewards),
            "reward_margin": _mean(chosen_rewards - rejected_rewards),
            "reward_accuracy": _mean((chosen_rewards > rejected_rewards).to(chosen_rewards.dtype)),
        }
    return _normalise(losses, global_num_pairs), metrics


@torch.no_grad()
def kto_kl_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point z0 = max(0, mean(log pi_theta(y'|x) - log pi_ref(y'|x))) (Ethayarajh et al. 2024).

    Computed on mismatched pairs (x, y') (each prompt with another example's completion), detached.
    policy_kl_logps, ref_kl_logps: [N] float. Returns a 0-dim tensor. Under DP, average the mean over ranks
    (all-reduce) before passing it to `kto_loss`, so every rank uses the same z0.
    """
    if policy_kl_logps.shape != ref_kl_logps.shape:
        raise ValueError(f"shapes differ: {tuple(policy_kl_logps.shape)} vs {tuple(ref_kl_logps.shape)}")
    return _mean(policy_kl_logps - ref_kl_logps).clamp(min=0)


def kto_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    kl_ref_point: Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    global_num_examples: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization"), on unpaired desirable (chosen) and undesirable (rejected) examples.

        r = policy_logps - ref_logps,   z0 = max(0, kl_ref_point) (detached)
        desirable:    l = lambda_D * (1 - sigmoid(beta (r - z0)))
        undesirable:  l = lambda_U * (1 - sigmoid(beta (z0 - r)))
        loss = (sum over all examples) / (N_D + N_U)

    The paper suggests lambda_D N_D / (lambda_U N_U) in [1, 4/3]. policy_chosen_logps, ref_chosen_logps: [N_D];
    policy_rejected_logps, ref_rejected_logps: [N_U] (either may be empty); kl_ref_point: 0-dim (see
    `kto_kl_reference_point`). Returns (loss 0-dim, metrics: rewards_chosen, rewards_rejected, kl_ref_point).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight ({desirable_weight}) and undesirable_weight ({undesirable_weight}) must be >= 0"
        )
    if policy_chosen_logps.shape != ref_chosen_logps.shape or policy_rejected_logps.shape != ref_rejected_logps.shape:
        raise ValueError(
            "policy/ref shapes must match: "
            f"chosen {tuple(policy_chosen_logps.shape)} vs {tuple(ref_chosen_logps.shape)},"
            f" rejected {tuple(policy_rejected_logps.shape)} vs {tuple(ref_rejected_logps.shape)}"
        )
    dtype = torch.promote_types(policy_chosen_logps.dtype, policy_rejected_logps.dtype)
    z0 = torch.as_tensor(kl_ref_point, dtype=dtype, device=policy_chosen_logps.device).detach().clamp(min=0)
    chosen_logratios = policy_chosen_logps.to(dtype) - ref_chosen_logps.detach().to(dtype)
    rejected_logratios = policy_rejected_logps.to(dtype) - ref_rejected_logps.detach().to(dtype)
    chosen_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (chosen_logratios - z0)))
    rejected_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - rejected_logratios)))
    losses = torch.cat([chosen_losses, rejected_losses])
    with torch.no_grad():
        metrics = {
            "rewards_chosen": _mean(beta * chosen_logratios.detach()),
            "rewards_rejected": _mean(beta * rejected_logratios.detach()),
            "kl_ref_point": z0,
        }
    return _normalise(losses, global_num_examples), metrics
