"""The loss functions the trainer hands to the engine: the actor's policy loss (+ KL, entropy) and the critic's.

The engine's contract (mcore_rl/engine/forward_backward.py): a loss function returns a *contribution*, and the
contributions of all micro batches on all data-parallel ranks are summed. The algorithms' aggregation gives
exactly that when it is handed the mini-batch's global token and sequence counts (MiniBatchCounts), so the
summed loss is the full mini-batch loss whatever the micro-batching or DP layout. Metrics are weighted by the
micro batch's share of the mini-batch's tokens, so their sums are token-weighted means; a maximum cannot be a
sum, so it goes through a PeakMetrics the caller reduces once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl import algorithms as alg
from mcore_rl.config.multitask import DPOSettings
from mcore_rl.config.rl import ActorConfig, CriticConfig
from mcore_rl.trainer.batch import rows


@dataclass
class MiniBatchCounts:
    num_tokens: torch.Tensor  # response tokens in the mini-batch, over all DP ranks
    num_seqs: torch.Tensor  # sequences with at least one response token


def count(micro_batches, device, dp_group) -> MiniBatchCounts:
    """Global counts of one mini-batch: one all-reduce over the data-parallel group."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in micro_batches:
        m = rows(mb["loss_mask"], mb)
        counts[0] += m.sum()
        counts[1] += (m.sum(-1) > 0).sum()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return MiniBatchCounts(counts[0].clamp(min=1), counts[1].clamp(min=1))


def _share(mb, counts: MiniBatchCounts) -> torch.Tensor:
    return mb["loss_mask"].sum().double() / counts.num_tokens


class PeakMetrics:
    """Running maxima of non-negative per-token quantities over a step's micro batches, kept on the device (no
    host sync per micro batch). `reduce()` takes the max over every rank (so pipeline stages that never ran the
    loss still agree); call it once per step, on every rank."""

    def __init__(self, keys, device):
        self.values = {k: torch.zeros((), dtype=torch.float32, device=device) for k in keys}

    def observe(self, key: str, x: torch.Tensor) -> None:
        self.values[key] = torch.maximum(self.values[key], x.detach().max().float())

    def reduce(self) -> dict[str, float]:
        keys = sorted(self.values)
        vec = torch.stack([self.values[k] for k in keys])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        return dict(zip(keys, vec.tolist()))


def step_peaks(cfg: ActorConfig, old_source: str, device) -> PeakMetrics | None:
    """The maxima actor_loss_fn reports for this config and old-log-prob source (None: it reports none)."""
    keys = ([] if old_source == "recompute" else ["rollout/logprob_diff_max"]) + \
        (["off_policy/ratio_max"] if cfg.correction() is not None else [])
    return PeakMetrics(keys, device) if keys else None


def actor_loss_fn(cfg: ActorConfig, counts: MiniBatchCounts, max_response_length: int, use_ref: bool,
                  old_source: str = "recompute", peaks: PeakMetrics | None = None, measure_gap: bool = True):
    """PPO-family policy loss (+ entropy bonus, + KL loss) of one mini-batch.

    old_source (rl_step.old_logprob_source) says what plays log pi_old in the ratio:
      recompute: mb["old_logprobs"], the actor's forward pass before the updates;
      current:   the update's own log-probs, detached (exactly on-policy: ratio 1, gradient A * grad log pi,
                 the same as the recomputed ratio's at its value 1). TIS then weighs current / rollout, the
                 value pi_old / pi_rollout has with recompute;
      rollout:   mb["rollout_logprobs"], SGLang's log-probs of the samples.
    Without the forward pass (current, rollout), the diagnostics prepare() takes from it are measured here from
    the update's log-probs instead: rollout/logprob_diff and rollout/kl (token means over the mini-batch),
    rollout/logprob_diff_max (into `peaks`, required then) and, with old_source=current and a reference, `kl`.
    With one update a step (what auto needs) they equal prepare()'s values. With rollout and several updates a
    step, only the first update measures them (measure_gap, set by update_actor): later updates differentiate
    weights the optimizer has already moved, so their gap would add the policy's own drift to the engine /
    trainer mismatch these metrics are for (the first update's tokens are a 1 / num_mini_batches sample).

    cfg.correction() (actor.off_policy_correction or tis_cap): token weights from pi_old / pi_rollout
    (algorithms/off_policy.py) passed to the policy loss; off_policy/* token means, and its ratio max into
    `peaks`.
    """
    agg = dict(loss_agg_mode=cfg.loss_agg_mode, global_num_tokens=counts.num_tokens.float(),
               global_num_seqs=counts.num_seqs.float(), max_response_length=max_response_length)
    if old_source not in ("recompute", "current", "rollout"):
        raise ValueError(f"old_source must be recompute, current or rollout, got {old_source!r}")
    correction = cfg.correction()
    assert peaks is not None or (old_source == "recompute" and correction is None), \
        "the forward-free paths and the off-policy corrections report maxima: pass peaks (step_peaks)"

    def loss_fn(out: dict, mb):
        mask = rows(mb["loss_mask"], mb)
        logprobs = rows(out["logprobs"], mb)
        metrics = {}
        if old_source == "recompute":
            old = rows(mb["old_logprobs"], mb)
        else:
            current, roll = logprobs.detach(), rows(mb["rollout_logprobs"], mb)
            old = current if old_source == "current" else roll
            if measure_gap:
                metrics.update(_rollout_gap(current, roll, mask, counts, peaks))
            if old_source == "current" and use_ref:
                kl_k1 = alg.estimate_kl(current, rows(mb["ref_logprobs"], mb), "k1")
                metrics["kl"] = (kl_k1 * mask).sum().double() / counts.num_tokens
        weights = None
        if correction is not None:
            weights, cm = alg.compute_correction(correction[0], old_logprobs=old,
                                                 rollout_logprobs=rows(mb["rollout_logprobs"], mb),
                                                 response_mask=mask, **correction[1])
            share = _share(mb, counts)
            for key in ("ratio_mean", "truncated_frac", "masked_frac", "mismatch_kl"):
                metrics[f"off_policy/{key}"] = cm[key].double() * share
            peaks.observe("off_policy/ratio_max", cm["ratio_max"])
        loss, m = alg.compute_policy_loss(
            cfg.policy_loss, logprobs=logprobs, old_logprobs=old, advantages=rows(mb["advantages"], mb),
            response_mask=mask, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c, token_weights=weights, **agg)
        share = _share(mb, counts)
        metrics["actor/pg_loss"] = loss.detach()
        for key in ("clip_frac", "ppo_kl", "approx_kl", "ratio_mean"):
            if key in m:
                metrics[f"actor/{key}"] = m[key] * share
        total = loss
        if cfg.entropy_coef or "entropy" in out:
            ent = alg.entropy_bonus(mask, entropy=rows(out["entropy"], mb), **agg)
            metrics["actor/entropy"] = ent.detach()
            total = total - cfg.entropy_coef * ent
        if use_ref and cfg.kl_loss_coef > 0:
            kl, _ = alg.kl_loss(logprobs, rows(mb["ref_logprobs"], mb), mask, estimator=cfg.kl_loss_estimator, **agg)
            metrics["actor/kl_loss"] = kl.detach()
            total = total + cfg.kl_loss_coef * kl
        return total, metrics

    return loss_fn


def _rollout_gap(current, roll, mask, counts: MiniBatchCounts, peaks: PeakMetrics) -> dict[str, torch.Tensor]:
    """The trainer/engine log-prob gap on this micro batch, as contributions to token means (prepare()'s
    rollout/* metrics, same formulas)."""
    diff = (current - roll).abs() * mask
    peaks.observe("rollout/logprob_diff_max", diff)
    kl_k3 = alg.estimate_kl(roll, current, "k3") * mask
    return {"rollout/logprob_diff": diff.sum().double() / counts.num_tokens,
            "rollout/kl": kl_k3.sum().double() / counts.num_tokens}


def critic_loss_fn(cfg: CriticConfig, counts: MiniBatchCounts):
    agg = dict(loss_agg_mode="token-mean", global_num_tokens=counts.num_tokens.float())

    def loss_fn(out: dict, mb):
        mask = rows(mb["loss_mask"], mb)
        loss, m = alg.value_loss(rows(out["values"], mb), rows(mb["old_values"], mb), rows(mb["returns"], mb),
                                 mask, cliprange_value=cfg.cliprange_value, **agg)
        share = _share(mb, counts)
        metrics = {"critic/value_loss": loss.detach()}
        for key, value in m.items():
            if key != "value_loss":
                metrics[f"critic/{key}"] = value * share
        return cfg.value_loss_coef * loss, metrics

    return loss_fn


def dpo_loss_fn(cfg: DPOSettings, counts: MiniBatchCounts):
    """DPO on (chosen, rejected) pairs laid out as consecutive sequences 2j, 2j+1 (make_micro_batches with
    keep_together=2 keeps a pair in one micro batch). Sequence log-probs are sums over the response tokens.

    Metrics: dpo/loss and the implicit-reward statistics (pair-weighted means over the mini-batch), and
    dpo/logratio, the token mean of log pi(y|x) - log pi_ref(y|x) over chosen and rejected responses: how far
    the actor has moved from the reference on this data (a KL proxy; it is not a KL, the responses were not
    sampled from the actor).
    """
    num_pairs = counts.num_seqs / 2

    def loss_fn(out: dict, mb):
        assert all(i % 2 == 0 and j == i + 1 for i, j in zip(mb.indices[0::2], mb.indices[1::2])), mb.indices
        mask = rows(mb["loss_mask"], mb)
        diff = (rows(out["logprobs"], mb) - rows(mb["ref_logprobs"], mb)) * mask
        logp = (rows(out["logprobs"], mb) * mask).sum(-1)
        ref = (rows(mb["ref_logprobs"], mb) * mask).sum(-1)
        loss, m = alg.dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], beta=cfg.beta, loss_type=cfg.loss_type,
                               label_smoothing=cfg.label_smoothing, global_num_pairs=num_pairs.float())
        share = (len(mb.indices) / 2) / num_pairs
        metrics = {"dpo/loss": loss.detach(), "dpo/logratio": diff.detach().sum() / counts.num_tokens}
        for key, value in m.items():
            metrics[f"dpo/{key}"] = value * share
        return loss, metrics

    return loss_fn
