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
from mcore_rl.trainer import rl_step as rl
from mcore_rl.trainer.losses import critic_loss_fn
from mcore_rl.trainer.metrics import MetricsLogger
from mcore_rl.trainer.rl_step import StepContext

log = logging.getLogger("mcore_rl")


def train(cfg: RLConfig) -> None:
    if cfg.tasks:
        from mcore_rl.trainer.multitask import train_multitask

        return train_multitask(cfg)
    from megatron.core import parallel_state as ps

    from mcore_rl.data.prompts import load_prompt_dataset
    from mcore_rl.data.sampler import EpochSampler
    from mcore_rl.parallel import destroy
    from mcore_rl.trainer.sync import WeightSync

    hf, model_path, tokenizer, layout = setup(cfg)
    dp_group = ps.get_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    out_dir = cfg.trainer.output_dir

    dataset = load_prompt_dataset(cfg.data, tokenizer)
    sampler = EpochSampler(dataset, cfg.trainer.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    n = cfg.algorithm.n_samples_per_prompt
    num_mini = _num_mini_batches(cfg, dp_size)
    use_ref = cfg.ref.enabled and (cfg.actor.kl_loss_coef > 0 or (cfg.algorithm.kl_in_reward and cfg.algorithm.kl_coef > 0))
    actor, ref, critic = build_engines(cfg, hf, model_path, actor_updates=cfg.trainer.total_steps * num_mini * cfg.actor.ppo_epochs,
                                       critic_updates=cfg.trainer.total_steps * num_mini * cfg.critic.ppo_epochs,
                                       use_ref=use_ref, use_critic=cfg.critic.enabled)
    ctx = StepContext(actor, ref, critic, tokenizer, dp_group, dp_rank, dp_size, score_temperature(cfg))
    old_source = rl.old_logprob_source(cfg.actor.old_logprobs, ppo_epochs=cfg.actor.ppo_epochs,
                                       num_mini_batches=num_mini,
                                       kl_in_reward=cfg.algorithm.kl_in_reward and ref is not None)
    kl_ctl = (alg.AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
              if cfg.algorithm.kl_adaptive else alg.FixedKLController(cfg.algorithm.kl_coef))

    start = 0
    resume_from = ckpt.find_resume(out_dir, cfg.trainer.resume)
    if resume_from is not None:
        state = load_run_checkpoint(resume_from, actor, critic)
        sampler.load_state_dict(state["data"])
        kl_ctl.load_state_dict(state["kl_ctl"])
        start = int(state["step"])
        log.info("resumed from %s at step %d", resume_from, start)

    rollout, rewards = start_rollout(cfg, model_path, [cfg.reward])
    rewards = rewards[0] if rewards else None
    sync = WeightSync(actor.model_chunks, hf, cfg.trainer.weight_sync, cfg.trainer.weight_sync_bucket_mb << 20,
                      rollout, os.path.join(out_dir, "scratch"), model_path)
    expected_syncs = sync.sync() if start > 0 else 0  # the engine starts from the HF weights; give it the actor's
    metrics_log = MetricsLogger(out_dir, dist.get_rank() == 0, cfg.logger.tensorboard,
                                wandb_settings(cfg) if cfg.logger.wandb else None, resume_step=start)
    log_layout(layout, model_path)

    try:
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            t_step = time.perf_counter()
            m: dict[str, float] = {}
            prompts = sampler.next_batch()
            samples = rl.generate(ctx, rollout, rewards, prompts, n, (step - 1) * len(prompts), m)
            prep = rl.prepare(ctx, samples, cfg.algorithm, cfg.actor, cfg.rollout.max_new_tokens, kl_ctl, m,
                              old_source)
            if prep is None:
                log.warning("step %d: every group had equal rewards; skipping the update", step)
                metrics_log.log(step, m)
                continue

            # ---- updates ------------------------------------------------------------------------------------
            t0 = time.perf_counter()
            m.update(rl.update_actor(ctx, prep, cfg.actor, num_mini, cfg.rollout.max_new_tokens))
            if critic is not None:
                m.update(rl.update(critic, prep.critic_seqs, num_mini, cfg.critic.ppo_epochs,
                                   cfg.critic.max_tokens_per_micro_batch, lambda c: critic_loss_fn(cfg.critic, c),
                                   dp_group, "critic"))
            m["timing/train_s"] = time.perf_counter() - t0
            train_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in prep.samples) * cfg.actor.ppo_epochs
            m["throughput/train_tokens_per_s"] = train_tokens / max(m["timing/train_s"], 1e-9)

            # ---- weight sync, metrics, checkpoint -----------------------------------------------------------
            expected_syncs = sync_weights(sync, expected_syncs, step, m)
            m["timing/step_s"] = time.perf_counter() - t_step
            metrics_log.log(step, m)
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.total_steps:
                save_run_checkpoint(cfg, step, actor, critic, {"data": sampler.state_dict(),
                                                               "kl_ctl": kl_ctl.state_dict()})
        if cfg.trainer.export_hf:
            export_hf_folder(actor, hf, model_path, os.path.join(out_dir, "hf"))
    finally:
        metrics_log.close()
        sync.close()
        if rollout is not None:
            rollout.shutdown()
        if rewards is not None:
            rewards.close()
        destroy()


# ---- set-up shared with the multi-task loop ------------------------------------------------------------------

def setup(cfg: RLConfig):
    """Logging, model path, parallel state, tokenizer. Returns (hf config, model path, tokenizer, layout)."""
    from transformers import AutoTokenizer

    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.models.smollm2 import resolve_model_path
    from mcore_rl.parallel import initialize

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
    return hf, model_path, AutoTokenizer.from_pretrained(model_path), layout


def build_engines(cfg: RLConfig, hf, model_path, *, actor_updates: int, critic_updates: int, use_ref: bool,
                  use_critic: bool):
    """The actor (trained), the frozen reference and the critic, all loaded from the HF checkpoint."""
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.engine import TrainEngine

    actor = TrainEngine(hf, cfg.model, cfg.parallel, OptimConfig.from_settings(cfg.actor, lr_decay_steps=actor_updates))
    load_hf_weights(actor.model_chunks, model_path, hf)
    actor.reload_master_weights()  # the optimizer's fp32 master copies were taken before the weights arrived
    ref = critic = None
    if use_ref:
        ref = TrainEngine(hf, cfg.model, cfg.parallel, None)
        load_hf_weights(ref.model_chunks, model_path, hf)
    if use_critic:
        critic = TrainEngine(hf, cfg.model, cfg.parallel,
                             OptimConfig.from_settings(cfg.critic, lr_decay_steps=critic_updates), value_head=True)
        load_hf_weights(critic.model_chunks, model_path, hf)  # the critic starts from the actor's weights
        critic.reload_master_weights()
    return actor, ref, critic


def start_rollout(cfg: RLConfig, model_path, reward_cfgs):
    """On global rank 0: the SGLang engine and one RewardManager per reward config. (None, []) elsewhere."""
    if dist.get_rank() != 0:
        return None, []
    from mcore_rl.rewards.manager import RewardManager
    from mcore_rl.rollout.engine import RolloutEngine

    return RolloutEngine(cfg.rollout, model_path), [RewardManager(r) for r in reward_cfgs]


def sync_weights(sync, expected_syncs: int, step: int, m: dict) -> int:
    """Push the actor's weights to the engine and check that the engine counted the sync; returns its count."""
    t0 = time.perf_counter()
    engine_syncs = sync.sync()
    m["timing/weight_sync_s"] = time.perf_counter() - t0
    if dist.get_rank() != 0:
        return expected_syncs
    # The engine counts the syncs it completed since it started; the weights it now holds are the actor's after
    # this step's update, whatever the run's history (resumed or not).
    if engine_syncs != expected_syncs + 1:
        raise RuntimeError(f"rollout engine reports {engine_syncs} weight syncs, expected {expected_syncs + 1}: "
                           "a sync was lost")
    m["rollout/engine_syncs"] = float(engine_syncs)
    m["rollout/weight_version"] = float(step)
    m["weight_sync/gb_per_s"] = sync.last_bytes / 1e9 / max(m["timing/weight_sync_s"], 1e-9)
    return engine_syncs


def log_layout(layout, model_path) -> None:
    if dist.get_rank() == 0:
        log.info("layout: world %d = tp %d x pp %d x dp %d (%s); model %s", layout.world_size, layout.tp,
                 layout.pp, layout.dp, layout.backend, model_path)


def load_run_checkpoint(path, actor, critic) -> dict:
    """Engines and this rank's RNG from a run checkpoint; returns its state.json."""
    state = ckpt.read_state(path)
    actor.load_checkpoint(path / "actor")
    if critic is not None:
        critic.load_checkpoint(path / "critic")
    ckpt.set_rng_state(ckpt.read_rank_state(path)["rng"])
    return state


def save_run_checkpoint(cfg, step, actor, critic, state: dict) -> None:
    tmp = ckpt.begin(cfg.trainer.output_dir, step)
    actor.save_checkpoint(tmp / "actor")
    if critic is not None:
        critic.save_checkpoint(tmp / "critic")
    ckpt.write_rank_state(tmp)
    state = {"step": step, **state, "config": dataclasses.asdict(cfg)}
    final = ckpt.commit(cfg.trainer.output_dir, step, tmp, state, cfg.trainer.keep_last)
    log.info("saved checkpoint %s", final)


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


def score_temperature(cfg) -> float:
    # The trainer scores tokens under the distribution the engine sampled from: logits / T. Greedy (T = 0)
    # log-probs are the plain log-softmax, as SGLang reports them.
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def export_hf_folder(actor, hf, model_path, out) -> None:
    from mcore_rl.trainer.export import export_final

    path = export_final(actor.model_chunks, hf, model_path, out)
    log.info("exported the actor as an HF checkpoint: %s", path)


def wandb_settings(cfg) -> dict:
    return {"project": cfg.logger.wandb_project, "name": cfg.logger.run_name, "config": dataclasses.asdict(cfg)}
