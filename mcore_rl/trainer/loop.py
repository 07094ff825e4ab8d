"""The RL loop, top to bottom: one function, `train(cfg)`, run by every torchrun process.

    prompts -> SGLang rollout (n per prompt) -> rewards -> old / reference log-probs and values (Megatron
    forward) -> advantages -> actor and critic updates (mini-batches x micro-batches x PPO epochs)
    -> weight sync -> metrics -> checkpoint

Global rank 0 owns the rollout engine and the reward functions; the samples are broadcast to every rank, each
data-parallel rank trains on its share, and the weights come back to the engine through the bridge.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist

from mcore_rl import algorithms as alg
from mcore_rl.config.optim import OptimConfig
from mcore_rl.config.root import RLConfig
from mcore_rl.trainer import checkpoint as ckpt
from mcore_rl.trainer.batch import response_mask, rollout_logprobs, sequences, shard, split_even
from mcore_rl.trainer.batch import to_response_space, to_token_space
from mcore_rl.trainer.losses import actor_loss_fn, count, critic_loss_fn
from mcore_rl.trainer.metrics import MetricsLogger

log = logging.getLogger("mcore_rl")


def train(cfg: RLConfig) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.data.prompts import load_prompt_dataset
    from mcore_rl.data.sampler import EpochSampler
    from mcore_rl.engine import TrainEngine
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.models.smollm2 import resolve_model_path
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.trainer.sync import WeightSync

    rank0 = int(os.environ.get("RANK", 0)) == 0
    # Our own handler: SGLang reconfigures the root logger (to its log_level) when its engine starts, which
    # would silence the per-step summary line.
    log.setLevel(logging.INFO if rank0 else logging.WARNING)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s mcore_rl: %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    model_path = resolve_model_path(cfg.model.path)  # safe to call from every rank at once (file lock)
    hf = load_hf_config(model_path)
    layout = initialize(cfg.parallel, hf)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    dp_group = ps.get_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    out_dir = cfg.trainer.output_dir
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    dataset = load_prompt_dataset(cfg.data, tokenizer)
    sampler = EpochSampler(dataset, cfg.trainer.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    n = cfg.algorithm.n_samples_per_prompt
    # The trainer scores tokens under the distribution the engine sampled from: logits / T. Greedy (T = 0)
    # log-probs are the plain log-softmax, as SGLang reports them.
    temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    num_mini = _num_mini_batches(cfg, dp_size)
    updates = cfg.trainer.total_steps * num_mini * cfg.actor.ppo_epochs
    actor = TrainEngine(hf, cfg.model, cfg.parallel, OptimConfig.from_settings(cfg.actor, lr_decay_steps=updates))
    load_hf_weights(actor.model_chunks, model_path, hf)
    actor.reload_master_weights()  # the optimizer's fp32 master copies were taken before the weights arrived
    use_ref = cfg.ref.enabled and (cfg.actor.kl_loss_coef > 0 or (cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0))
    ref = critic = None
    if use_ref:
        ref = TrainEngine(hf, cfg.model, cfg.parallel, None)
        load_hf_weights(ref.model_chunks, model_path, hf)
    if cfg.critic.enabled:
        critic_updates = cfg.trainer.total_steps * num_mini * cfg.critic.ppo_epochs
        critic = TrainEngine(hf, cfg.model, cfg.parallel, OptimConfig.from_settings(cfg.critic, lr_decay_steps=critic_updates),
                             value_head=True)
        load_hf_weights(critic.model_chunks, model_path, hf)  # the critic starts from the actor's weights
        critic.reload_master_weights()
    kl_ctl = (alg.AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
              if cfg.algorithm.kl_adaptive else alg.FixedKLController(cfg.algorithm.kl_coef))

    start = 0
    resume_from = ckpt.find_resume(out_dir, cfg.trainer.resume)
    if resume_from is not None:
        state = ckpt.read_state(resume_from)
        actor.load_checkpoint(resume_from / "actor")
        if critic is not None:
            critic.load_checkpoint(resume_from / "critic")
        sampler.load_state_dict(state["data"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        ckpt.set_rng_state(ckpt.read_rank_state(resume_from)["rng"])
        start = int(state["step"])
        log.info("resumed from %s at step %d", resume_from, start)

    rollout = rewards = None
    if dist.get_rank() == 0:
        from mcore_rl.rewards.manager import RewardManager
        from mcore_rl.rollout.engine import RolloutEngine

        rollout = RolloutEngine(cfg.rollout, model_path)
        rewards = RewardManager(cfg.reward)
    sync = WeightSync(actor.model_chunks, hf, cfg.trainer.weight_sync, cfg.trainer.weight_sync_bucket_mb << 20,
                      rollout, os.path.join(out_dir, "scratch"), model_path)
    expected_syncs = 0
    if start > 0:
        expected_syncs = sync.sync()  # the engine starts from the HF weights; give it the resumed actor's
    metrics_log = MetricsLogger(out_dir, dist.get_rank() == 0, cfg.logger.tensorboard,
                                _wandb_cfg(cfg) if cfg.logger.wandb else None, resume_step=start)
    if dist.get_rank() == 0:
        log.info("layout: world %d = tp %d x pp %d x dp %d (%s); model %s", layout.world_size, layout.tp,
                 layout.pp, layout.dp, layout.backend, model_path)

    try:
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            t_step = time.perf_counter()
            m: dict[str, float] = {}
            prompts = sampler.next_batch()

            # ---- rollout and rewards (rank 0), shared with every rank --------------------------------------
            t0 = time.perf_counter()
            payload = None
            if rollout is not None:
                batch = rollout.generate([p.prompt_ids for p in prompts], n=n,
                                         first_group_id=(step - 1) * len(prompts),
                                         metas=[p.meta for p in prompts], prompt_texts=[p.prompt_text for p in prompts])
                for s in batch.samples:
                    s.response_text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
                m.update(rewards.score(batch.samples))
                payload = [batch.samples, m]
            samples, rollout_metrics = _broadcast(payload)
            m.update(rollout_metrics)
            m["timing/rollout_s"] = time.perf_counter() - t0
            num_gen = sum(len(s.response_ids) for s in samples)
            m["throughput/rollout_tokens_per_s"] = num_gen / max(m["timing/rollout_s"], 1e-9)
            m["response_length/mean"] = num_gen / len(samples)
            m["response_length/clip_frac"] = sum(s.finish_reason == "length" for s in samples) / len(samples)

            scores = torch.tensor([float(s.reward) for s in samples])
            group_ids = torch.tensor([s.group_id for s in samples])
            if cfg.algorithm.overlong_buffer > 0:
                lengths = torch.tensor([len(s.response_ids) for s in samples])
                scores = scores + alg.overlong_penalty(lengths, cfg.rollout.max_new_tokens,
                                                       cfg.algorithm.overlong_buffer, cfg.algorithm.overlong_penalty)
            if cfg.algorithm.dynamic_sampling:
                keep, dropped = alg.dynamic_sampling_filter(scores, group_ids)
                m["dapo/dropped_groups"] = float(dropped)
                if int(keep.sum()) < dp_size:
                    log.warning("step %d: every group had equal rewards; skipping the update", step)
                    metrics_log.log(step, m)
                    continue
                idx = keep.nonzero().flatten().tolist()
                samples, scores, group_ids = [samples[i] for i in idx], scores[idx], group_ids[idx]

            # ---- forward passes: old / reference log-probs, values (each DP rank on its share) -------------
            t0 = time.perf_counter()
            mine = shard(len(samples), dp_rank, dp_size)
            my_samples = [samples[i] for i in mine]
            mbs = _micro_batches(actor, sequences(my_samples), cfg.actor.max_tokens_per_micro_batch)
            old_tok = _gather_tokens(actor.compute_logprobs(mbs, temperature=temp), mbs, "logprobs")
            ref_tok = (_gather_tokens(ref.compute_logprobs(mbs, temperature=temp), mbs, "logprobs")
                       if ref is not None else None)
            val_tok = _gather_tokens(critic.compute_values(mbs), mbs, "values") if critic is not None else None
            m["timing/forward_s"] = time.perf_counter() - t0

            # Advantages need the whole batch (groups, whitening): all-gather the per-sample results over DP.
            mask = response_mask(samples)
            width = mask.size(1)
            old = _all_gather_resp(old_tok, my_samples, width, dp_group)
            ref_lp = _all_gather_resp(ref_tok, my_samples, width, dp_group) if ref_tok else None
            values = _all_gather_resp(val_tok, my_samples, width, dp_group) if val_tok else None
            roll = rollout_logprobs(samples, width)
            diff = (old - roll).abs() * mask
            m["rollout/logprob_diff"] = float(diff.sum() / mask.sum().clamp(min=1))
            m["rollout/logprob_diff_max"] = float(diff.max())
            m["rollout/kl"] = float(alg.masked_mean(alg.estimate_kl(roll, old, "k3"), mask))

            token_rewards = alg.scores_to_token_rewards(scores, mask)
            kl = alg.masked_mean(alg.estimate_kl(old, ref_lp, "k1"), mask) if ref_lp is not None else torch.tensor(0.0)
            m["kl"] = float(kl)
            if cfg.algorithm.kl_in_reward and ref_lp is not None:
                token_rewards, kl_m = alg.apply_kl_penalty(token_rewards, old, ref_lp, mask, kl_ctl.value,
                                                           cfg.algorithm.kl_estimator)
                kl_ctl.update(float(kl_m["kl_seq"]), n_steps=len(samples))
                m["kl_coef"] = kl_ctl.value
            adv, returns = alg.compute_advantages(
                cfg.algorithm.adv_estimator, scores=scores, group_ids=group_ids, response_mask=mask,
                token_rewards=token_rewards, values=values, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                **({"norm_by_std": cfg.algorithm.norm_adv_by_std} if cfg.algorithm.adv_estimator == "grpo" else {}))
            m["advantages/mean"] = float(alg.masked_mean(adv, mask))
            m["advantages/abs_mean"] = float(alg.masked_mean(adv.abs(), mask))

            # ---- updates ------------------------------------------------------------------------------------
            t0 = time.perf_counter()
            fields = {"old_logprobs": old, "advantages": adv, "rollout_logprobs": roll}
            if ref_lp is not None:
                fields["ref_logprobs"] = ref_lp
            seqs = sequences(my_samples, {k: to_token_space(v[mine], my_samples) for k, v in fields.items()})
            m.update(_update(actor, seqs, num_mini, cfg.actor.ppo_epochs, cfg.actor.max_tokens_per_micro_batch,
                             lambda c: actor_loss_fn(cfg.actor, c, cfg.rollout.max_new_tokens, ref is not None),
                             dp_group, "actor", with_entropy=True, temperature=temp))
            if critic is not None:
                cseqs = sequences(my_samples, {"old_values": to_token_space(values[mine], my_samples),
                                               "returns": to_token_space(returns[mine], my_samples)})
                m.update(_update(critic, cseqs, num_mini, cfg.critic.ppo_epochs, cfg.critic.max_tokens_per_micro_batch,
                                 lambda c: critic_loss_fn(cfg.critic, c), dp_group, "critic"))
            m["timing/train_s"] = time.perf_counter() - t0
            train_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) * cfg.actor.ppo_epochs
            m["throughput/train_tokens_per_s"] = train_tokens / max(m["timing/train_s"], 1e-9)

            # ---- weight sync, metrics, checkpoint -----------------------------------------------------------
            t0 = time.perf_counter()
            engine_syncs = sync.sync()
            m["timing/weight_sync_s"] = time.perf_counter() - t0
            if dist.get_rank() == 0:
                # The engine counts the syncs it completed since it started; the weights it now holds are the
                # actor's after this step's update, whatever the run's history (resumed or not).
                if engine_syncs != expected_syncs + 1:
                    raise RuntimeError(f"rollout engine reports {engine_syncs} weight syncs, expected "
                                       f"{expected_syncs + 1}: a sync was lost")
                expected_syncs = engine_syncs
                m["rollout/engine_syncs"] = float(engine_syncs)
                m["rollout/weight_version"] = float(step)
                m["weight_sync/gb_per_s"] = sync.last_bytes / 1e9 / max(m["timing/weight_sync_s"], 1e-9)
            m["timing/step_s"] = time.perf_counter() - t_step
            metrics_log.log(step, m)
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.total_steps:
                _save(cfg, step, actor, critic, sampler, kl_ctl)
        if cfg.trainer.export_hf:
            _export_hf(actor, hf, model_path, os.path.join(out_dir, "hf"))
    finally:
        metrics_log.close()
        sync.close()
        if rollout is not None:
            rollout.shutdown()
        if rewards is not None:
            rewards.close()
        destroy()


# ---- helpers ---------------------------------------------------------------------------------------------------

def _num_mini_batches(cfg: RLConfig, dp_size: int) -> int:
    total = cfg.trainer.prompts_per_step * cfg.algorithm.n_samples_per_prompt
    mini = cfg.actor.mini_batch_size or total
    if total % mini:
        raise ValueError(f"trainer.prompts_per_step x algorithm.n_samples_per_prompt ({total}) is not divisible by "
                         f"actor.mini_batch_size ({mini})")
    if mini < dp_size:
        raise ValueError(f"actor.mini_batch_size ({mini}) must be at least the data-parallel size ({dp_size}): "
                         "every DP rank needs a sample in every mini-batch")
    return total // mini


def _micro_batches(engine, seqs, max_tokens: int):
    from mcore_rl.engine.batching import make_micro_batches

    return make_micro_batches(seqs, max_tokens, min_micro_batches=engine.pp_size,
                              multiple_of=engine.micro_batch_multiple)


def _gather_tokens(outputs, mbs, key: str):
    from mcore_rl.engine.batching import unpack

    return [t.float().cpu() for t in unpack([o[key] for o in outputs], mbs)]


def _all_gather_resp(per_token, my_samples, width, dp_group):
    """This rank's token-space outputs -> the whole batch's [B, width] response-space tensor on every rank."""
    local = to_response_space(per_token, my_samples, width)
    world = dist.get_world_size(dp_group)
    if world == 1:
        return local
    parts = [None] * world
    dist.all_gather_object(parts, local, group=dp_group)
    return torch.cat(parts, dim=0)


def _update(engine, seqs, num_mini, epochs, max_tokens, make_loss, dp_group, prefix, **kw) -> dict[str, float]:
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(epochs):
        for part in split_even(list(range(len(seqs))), num_mini):
            mbs = _micro_batches(engine, [seqs[i] for i in part], max_tokens)
            counts = count(mbs, engine.device, dp_group)
            res = engine.train_step(mbs, make_loss(counts), **kw)
            for k, v in res.metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            sums[f"{prefix}/grad_norm"] = sums.get(f"{prefix}/grad_norm", 0.0) + res.grad_norm
            sums[f"{prefix}/lr"] = res.lr
            steps += 1
    return {k: (v if k.endswith("/lr") else v / steps) for k, v in sums.items()}


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _save(cfg, step, actor, critic, sampler, kl_ctl) -> None:
    tmp = ckpt.begin(cfg.trainer.output_dir, step)
    actor.save_checkpoint(tmp / "actor")
    if critic is not None:
        critic.save_checkpoint(tmp / "critic")
    ckpt.write_rank_state(tmp)
    state = {"step": step, "data": sampler.state_dict(), "kl_ctl": kl_ctl.state_dict(),
             "config": dataclasses.asdict(cfg)}
    final = ckpt.commit(cfg.trainer.output_dir, step, tmp, state, cfg.trainer.keep_last)
    log.info("saved checkpoint %s", final)


def _export_hf(actor, hf, model_path, out) -> None:
    from mcore_rl.trainer.export import export_final

    path = export_final(actor.model_chunks, hf, model_path, out)
    log.info("exported the actor as an HF checkpoint: %s", path)


def _wandb_cfg(cfg) -> dict:
    return {"project": cfg.logger.wandb_project, "name": cfg.logger.run_name, "config": dataclasses.asdict(cfg)}
