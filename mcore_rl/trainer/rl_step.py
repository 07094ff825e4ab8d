"""The parts of an RL task's step (tasks.RLTask runs them; the loop never calls them directly).

    rollout, m1 = generate(ctx, engine, rewards, prompts, n, first_group_id)   # rank 0 generates, all get them
    source = old_logprob_source(cfg.actor.old_logprobs, ...)                    # recompute | current | rollout
    batch, m2 = prepare(ctx, rollout, algo, cfg.actor, max_new_tokens, kl_ctl, source)  # RLBatch or Skip
    m3 = update_actor(ctx, batch, cfg.actor, num_mini, max_new_tokens)          # optimizer steps

Each returns its own metrics (keys without a task prefix; the loop prefixes them in multi-task runs).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl import algorithms as alg
from mcore_rl.agent.rollout import agent_metrics
from mcore_rl.config.rl import ActorConfig, AlgorithmConfig
from mcore_rl.parallel import watchdog
from mcore_rl.parallel.runtime import from_rank0
from mcore_rl.rewards.manager import RewardError
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.trainer.batch import response_mask, rollout_logprobs, sample_sequences, shard, split_even
from mcore_rl.trainer.batch import to_response_space, to_token_space
from mcore_rl.trainer.losses import actor_loss_fn, count, step_peaks
from mcore_rl.trainer.step_data import Rollout, RLBatch, Sequences, Skip


@dataclass
class StepContext:
    """The models and the data-parallel position every part of a step needs."""

    actor: Any
    ref: Any
    critic: Any
    tokenizer: Any
    dp_group: Any
    dp_rank: int
    dp_size: int
    temperature: float
    """Log-probs are scored under logits / temperature (1.0 for greedy rollouts)."""


def old_logprob_source(mode: str, *, ppo_epochs: int, num_mini_batches: int, kl_in_reward: bool) -> str:
    """Where the update's old log-probs come from, for actor.old_logprobs = `mode` (config/rl.py):

      recompute  the actor's forward pass over the samples before the updates (prepare);
      current    the update's own log-probs, detached: only when the step makes exactly one optimizer update
                 from the whole batch (ppo_epochs == 1, num_mini_batches == 1), so the weights it differentiates
                 at are the weights the forward pass would have used, and nothing reads log pi_old before the
                 update (kl_in_reward: the KL penalty in the reward, with a reference model, does);
      rollout    the rollout engine's log-probs.
    """
    if mode == "rollout":
        return "rollout"
    if mode == "auto" and ppo_epochs == 1 and num_mini_batches == 1 and not kl_in_reward:
        return "current"
    if mode not in ("auto", "recompute"):
        raise ValueError(f"actor.old_logprobs must be auto, recompute or rollout, got {mode!r}")
    return "recompute"


def ref_in_update(setting: str, ref, *, old_source: str, kl_in_reward: bool) -> bool:
    """Whether the reference log-probs are computed in the update (ref.compute_at, config/rl.py) rather than in
    prepare's forward passes. Allowed only where they feed the KL loss alone: no KL in the reward, and nothing
    reading them before the update (old_source current: prepare's `kl` metric is then the update's)."""
    if ref is None or setting == "forward":
        return False
    allowed = old_source == "current" and not kl_in_reward
    if setting == "update" and not allowed:
        raise ValueError("ref.compute_at=update needs the reference to feed the KL loss alone: actor.old_logprobs "
                         f"auto with one update a step (old log-probs are taken from {old_source!r} here) and "
                         "algorithm.kl_in_reward off; set ref.compute_at=auto or forward")
    return allowed and (setting == "update" or ref.graphed is not None)


def attach_ref_logprobs(ref, micro_batches, temperature: float) -> None:
    """The reference's log-probs of the update's micro batches as their `ref_logprobs` field (0 off the loss
    mask, as prepare's would be), queued on the device ahead of the update (ref.compute_at=update)."""
    for mb, out in zip(micro_batches, ref.compute_logprobs(micro_batches, temperature=temperature)):
        mb.fields["ref_logprobs"] = torch.where(mb["loss_mask"].bool(), out["logprobs"].float(), 0.0)


def generate(ctx: StepContext, engine, rewards, prompts, n: int, first_group_id: int,
             agent=None, seed_stream: str = "") -> tuple[Rollout, dict]:
    """Rank 0 generates n samples per prompt and scores them (produce); every rank gets the samples (receive).

    agent: an AgentRollout (mcore_rl.agent.rollout; rank 0) for multi-turn tool-using trajectories, whose
    response is the whole trajectory after the prompt (tool tokens masked by Sample.response_mask); None =
    single-turn samples. seed_stream: the task, in a multi-task run: tasks number their groups alike, and this
    keeps their samples' seeds apart (mcore_rl.rollout.seeds)."""
    produced = (produce(ctx, engine, rewards, prompts, n, first_group_id, agent, seed_stream) if engine is not None
                else (None, None))
    return receive(*produced)


def produce(ctx: StepContext, engine, rewards, prompts, n: int, first_group_id: int, agent=None,
            seed_stream: str = "", generate_fn=None) -> tuple[list | BaseException, BaseException | None]:
    """Rank 0's part of generate, without collectives (asynchronous rollouts run it on a thread of their own):
    generate (engine.generate, agent.generate, or `generate_fn()` returning a RolloutBatch), decode, score.
    Returns (payload, error): payload = [samples, policy version, metrics] for receive(), or the exception every
    rank should raise; error = the original exception (rank 0 re-raises it, with its traceback), else None."""
    t0 = time.perf_counter()
    try:
        if generate_fn is not None:
            batch = generate_fn()
        elif agent is None:
            batch = engine.generate([p.prompt_ids for p in prompts], n=n, first_group_id=first_group_id,
                                    metas=[p.meta for p in prompts], prompt_texts=[p.prompt_text for p in prompts],
                                    seed_stream=seed_stream)
        else:
            batch = agent.generate(engine, prompts, n, first_group_id=first_group_id, seed_stream=seed_stream)
        for s in batch.samples:
            s.response_text = ctx.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        metrics = dict(rewards.score(batch.samples))
        if agent is not None:
            add_turn_rewards(batch.samples)
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return [batch.samples, batch.policy_version, metrics], None
    except Exception as e:  # every rank raises it, instead of waiting for samples that never come
        return (e if isinstance(e, (RolloutEngineError, RewardError)) else RuntimeError(
            f"global rank 0 failed to generate: {type(e).__name__}: {e}")), e


def receive(payload, error: BaseException | None = None) -> tuple[Rollout, dict]:
    """Every rank: the samples rank 0 produced (payload; None elsewhere), and the rollout metrics. Collective."""
    try:
        samples, version, rollout_metrics = from_rank0(payload)
    except BaseException:
        if error is not None:
            raise error  # rank 0: the original, with its traceback
        raise
    m = dict(rollout_metrics)
    num_gen = sum(s.num_model_tokens for s in samples)  # generated tokens: a tool's reply tokens are not
    m["throughput/rollout_tokens_per_s"] = num_gen / max(m["timing/rollout_s"], 1e-9)
    num = max(len(samples), 1)  # none: an asynchronous batch whose samples were all too stale
    m["response_length/mean"] = num_gen / num
    m["response_length/clip_frac"] = sum(s.finish_reason == "length" for s in samples) / num
    m["rollout/sample_weight_version"] = float(version)
    m.update(agent_metrics(samples))  # {} for single-turn samples
    return Rollout(samples, version), m


def add_turn_rewards(samples) -> None:
    """agent.turn_reward: each trajectory's per-turn rewards summed into its reward."""
    for s in samples:
        if s.agent is not None and s.agent.turn_rewards:
            s.reward = float(s.reward) + sum(s.agent.turn_rewards)


def prepare(ctx: StepContext, rollout: Rollout, algo: AlgorithmConfig, actor_cfg: ActorConfig, max_new_tokens: int,
            kl_ctl, old_source: str = "recompute", ref_in_update: bool = False) -> tuple[RLBatch | Skip, dict]:
    """Rewards -> (filter) -> old / reference log-probs and values -> advantages -> this rank's sequences.

    The actor's forward pass runs only for old_source=recompute; otherwise the rollout/* diagnostics (and, for
    current, `kl`) are measured by the update's loss (losses.actor_loss_fn). With old_source=rollout the
    rollout log-probs also stand for log pi_old in `kl` and the KL reward penalty. With ref_in_update
    (rl_step.ref_in_update) the reference's pass is left to update_actor. Skip when dynamic sampling leaves fewer
    samples than data-parallel ranks.
    """
    if ref_in_update and (old_source != "current" or algo.kl_in_reward):
        raise ValueError("ref_in_update needs old_source current and no KL in the reward (rl_step.ref_in_update)")
    if old_source == "current" and algo.kl_in_reward and ctx.ref is not None:
        raise ValueError("old_source=current cannot serve algorithm.kl_in_reward: the KL penalty needs log pi_old "
                         "before the update (old_logprob_source picks recompute for it)")
    m: dict[str, float] = {}
    samples = rollout.samples
    scores = torch.tensor([float(s.reward) for s in samples])
    group_ids = torch.tensor([s.group_id for s in samples])
    if algo.overlong_buffer > 0:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        scores = scores + alg.overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
    if algo.dynamic_sampling:
        keep, dropped = alg.dynamic_sampling_filter(scores, group_ids)
        m["dapo/dropped_groups"] = float(dropped)
        if int(keep.sum()) < ctx.dp_size:
            return Skip("every group had equal rewards (dynamic sampling left fewer samples than DP ranks)"), m
        idx = keep.nonzero().flatten().tolist()
        samples, scores, group_ids = [samples[i] for i in idx], scores[idx], group_ids[idx]

    # ---- forward passes: old / reference log-probs, values (each DP rank on its share) ---------------------
    watchdog.set_phase("forward")
    t0 = time.perf_counter()
    mine = shard(len(samples), ctx.dp_rank, ctx.dp_size)
    my_samples = [samples[i] for i in mine]
    mbs = micro_batches(ctx.actor, sample_sequences(my_samples), actor_cfg.forward_tokens_per_micro_batch)
    t = ctx.temperature
    recompute = old_source == "recompute"
    old_tok = gather_tokens(ctx.actor.compute_logprobs(mbs, temperature=t), mbs, "logprobs") if recompute else None
    ref_tok = (gather_tokens(ctx.ref.compute_logprobs(mbs, temperature=t), mbs, "logprobs")
               if ctx.ref is not None and not ref_in_update else None)
    val_tok = gather_tokens(ctx.critic.compute_values(mbs), mbs, "values") if ctx.critic is not None else None
    m["timing/forward_s"] = time.perf_counter() - t0
    m["actor/old_logprobs_recomputed"] = float(recompute)
    if ctx.ref is not None:
        m["actor/ref_in_update"] = float(ref_in_update)

    # Advantages need the whole batch (groups, whitening): all-gather the per-sample results over DP.
    mask = response_mask(samples)
    width = mask.size(1)
    ref_lp = all_gather_resp(ref_tok, my_samples, width, ctx.dp_group) if ref_tok else None
    values = all_gather_resp(val_tok, my_samples, width, ctx.dp_group) if val_tok else None
    roll = rollout_logprobs(samples, width)
    old = roll if old_source == "rollout" else None
    if recompute:
        old = all_gather_resp(old_tok, my_samples, width, ctx.dp_group)
        diff = (old - roll).abs() * mask
        m["rollout/logprob_diff"] = float(diff.sum() / mask.sum().clamp(min=1))
        m["rollout/logprob_diff_max"] = float(diff.max())
        m["rollout/kl"] = float(alg.masked_mean(alg.estimate_kl(roll, old, "k3"), mask))

    token_rewards = alg.scores_to_token_rewards(scores, mask)
    kl = None  # old_source=current with a reference: the update measures it
    if ref_lp is None:
        kl = 0.0
    elif old is not None:
        kl = float(alg.masked_mean(alg.estimate_kl(old, ref_lp, "k1"), mask))
    if kl is not None:
        m["kl"] = kl
    if algo.kl_in_reward and ref_lp is not None:
        token_rewards, kl_m = alg.apply_kl_penalty(token_rewards, old, ref_lp, mask, kl_ctl.value, algo.kl_estimator)
        kl_ctl.update(float(kl_m["kl_seq"]), n_steps=len(samples))
        m["kl_coef"] = kl_ctl.value
    adv, returns = alg.compute_advantages(
        algo.adv_estimator, scores=scores, group_ids=group_ids, response_mask=mask,
        token_rewards=token_rewards, values=values, gamma=algo.gamma, lam=algo.lam,
        **({"norm_by_std": algo.norm_adv_by_std} if algo.adv_estimator == "grpo" else {}))
    m["advantages/mean"] = float(alg.masked_mean(adv, mask))
    m["advantages/abs_mean"] = float(alg.masked_mean(adv.abs(), mask))

    fields = {"advantages": adv, "rollout_logprobs": roll}
    if recompute:
        fields["old_logprobs"] = old
    if ref_lp is not None:
        fields["ref_logprobs"] = ref_lp
    actor_seqs = sample_sequences(my_samples, **{k: to_token_space(v[mine], my_samples) for k, v in fields.items()})
    critic_seqs = None
    if ctx.critic is not None:
        critic_seqs = sample_sequences(my_samples, with_routes=False,
                                       old_values=to_token_space(values[mine], my_samples),
                                       returns=to_token_space(returns[mine], my_samples))
    return RLBatch(Rollout(samples, rollout.weight_version), actor_seqs, critic_seqs, kl, int(mask.sum()),
                   old_source, ref_in_update), m


def update_actor(ctx: StepContext, batch: RLBatch, actor_cfg: ActorConfig, num_mini: int,
                 max_response_length: int) -> dict[str, float]:
    """The actor's updates of one step (update() with the actor's loss); metrics as update() returns them, plus
    the diagnostics the loss measures when prepare() skipped the old log-prob pass."""
    peaks = step_peaks(actor_cfg, batch.old_source, ctx.actor.device)
    updates = itertools.count()  # the engine/trainer gap is measured on the step's first update (actor_loss_fn)
    metrics = update(ctx.actor, batch.actor, num_mini, actor_cfg.ppo_epochs, actor_cfg.max_tokens_per_micro_batch,
                     lambda c: actor_loss_fn(actor_cfg, c, max_response_length, ctx.ref is not None,
                                             batch.old_source, peaks, measure_gap=next(updates) == 0),
                     ctx.dp_group, "actor", with_entropy=True, temperature=ctx.temperature,
                     before_step=(lambda mbs: attach_ref_logprobs(ctx.ref, mbs, ctx.temperature))
                     if batch.ref_in_update else None)
    if peaks is not None:
        metrics.update(peaks.reduce())
    return metrics


def update(engine, seqs: Sequences, num_mini, epochs, max_tokens, make_loss, dp_group, prefix,
           before_step=None, **kw) -> dict[str, float]:
    """`epochs` passes over `seqs` in `num_mini` mini-batches, one optimizer step each; each metric the mean over
    the applied updates that report it. `before_step(micro_batches)` runs before each optimizer step's pass."""
    sums: dict[str, float] = {}
    seen: dict[str, int] = {}
    skipped = 0
    first: dict[str, float] = {}
    engine_seqs = seqs.for_engine()
    for _ in range(epochs):
        for part in split_even(list(range(len(engine_seqs))), num_mini):
            mbs = micro_batches(engine, [engine_seqs[i] for i in part], max_tokens)
            counts = count(mbs, engine.device, dp_group)
            if before_step is not None:  # after count(), whose host sync would wait for what it queues
                before_step(mbs)
            res = engine.train_step(mbs, make_loss(counts), **kw)
            if res.nonfinite:  # not applied (engine.optimizer_step); update.check_finite applies trainer.on_nonfinite
                first = first or {f"{prefix}/nonfinite_loss": res.loss, f"{prefix}/nonfinite_grad_norm": res.grad_norm}
                skipped += 1
                continue
            for k, v in (*res.metrics.items(), (f"{prefix}/grad_norm", res.grad_norm)):
                sums[k] = sums.get(k, 0.0) + v
                seen[k] = seen.get(k, 0) + 1
            sums[f"{prefix}/lr"] = res.lr
    return {**{k: (v if k.endswith("/lr") else v / seen[k]) for k, v in sums.items()}, **first,
            f"{prefix}/nonfinite_updates": float(skipped)}


# ---- helpers ---------------------------------------------------------------------------------------------------

def micro_batches(engine, seqs: Sequences | list[dict], max_tokens: int, keep_together: int = 1):
    from mcore_rl.engine.batching import make_micro_batches

    if isinstance(seqs, Sequences):
        seqs = seqs.for_engine()
    return make_micro_batches(seqs, max_tokens, min_micro_batches=engine.pp_size,
                              multiple_of=engine.micro_batch_multiple, keep_together=keep_together,
                              pad_to_multiple_of=engine.sequence_multiple)


def gather_tokens(outputs, mbs, key: str):
    """Per-sequence host tensors (float32) of one per-token output, in the sequences' order: one device-to-host
    copy for the whole batch, not one (and one stream sync) per sequence."""
    from mcore_rl.engine.batching import unpack

    per_seq = unpack([o[key] for o in outputs], mbs)
    if not per_seq:
        return []
    flat = torch.cat([t.float() for t in per_seq]).cpu()
    return list(flat.split([t.numel() for t in per_seq]))


def all_gather_resp(per_token, my_samples, width, dp_group):
    """This rank's token-space outputs -> the whole batch's [B, width] response-space tensor on every rank."""
    local = to_response_space(per_token, my_samples, width)
    world = dist.get_world_size(dp_group)
    if world == 1:
        return local
    parts = [None] * world
    dist.all_gather_object(parts, local, group=dp_group)
    return torch.cat(parts, dim=0)
