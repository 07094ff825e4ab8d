"""Several tasks training one actor: GRPO / PPO tasks with rollouts and rewards, DPO tasks on preference pairs.

    for each step:
        tasks = scheduler.next_tasks()                  # all (weighted_sum) or one (alternating)
        per task: draw its batch -> RL: rollout, reward, old/ref log-probs, advantages | DPO: ref log-probs
        actor.multi_objective_step(tasks)              # each task's gradient clipped alone, then weighted, summed
        critic updates (ppo tasks), scheduler.observe(losses), KL monitor -> LR multiplier, weight sync, save

One actor engine (one set of parameters, one optimizer), one reference, one SGLang engine on global rank 0 (only
when a task rolls out), one reward manager per RL task. Metrics of task <name> go under `task/<name>/`; the
scheduler's state, each task's data position and the KL monitor travel in the checkpoint's state.json.
Configuration: mcore_rl/config/multitask.py; the scheduler's rule: mcore_rl/algorithms/task_scheduler.py.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl import algorithms as alg
from mcore_rl.config.multitask import TaskConfig
from mcore_rl.config.root import RLConfig
from mcore_rl.trainer import checkpoint as ckpt
from mcore_rl.trainer import rl_step as rl
from mcore_rl.trainer.batch import shard
from mcore_rl.trainer.losses import actor_loss_fn, count, critic_loss_fn, dpo_loss_fn
from mcore_rl.trainer.loop import (build_engines, export_hf_folder, load_run_checkpoint, log_layout,
                                   save_run_checkpoint, score_temperature, setup, start_rollout, sync_weights,
                                   wandb_settings)
from mcore_rl.trainer.metrics import MetricsLogger

log = logging.getLogger("mcore_rl")


@dataclass
class Task:
    cfg: TaskConfig
    sampler: Any
    rewards: Any = None
    """RewardManager on global rank 0 (RL tasks)."""
    kl_ctl: Any = field(default_factory=lambda: alg.FixedKLController(0.0))

    @property
    def name(self) -> str:
        return self.cfg.name


@dataclass
class TaskBatch:
    """What one task brings to this step's update."""

    micro_batches: list
    loss_fn: Any
    temperature: float
    with_entropy: bool
    metrics: dict[str, float]
    kl: float
    """This task's measure of how far the actor is from the reference (see _global_kl)."""
    kl_tokens: int
    critic_seqs: list | None = None


class MultiTaskTrainer:
    """Set up in __init__ (every rank), `run()` the steps, `close()`. train_multitask(cfg) does all three."""

    def __init__(self, cfg: RLConfig):
        from megatron.core import parallel_state as ps

        from mcore_rl.data.preference import load_preference_dataset
        from mcore_rl.data.prompts import load_prompt_dataset
        from mcore_rl.data.sampler import EpochSampler
        from mcore_rl.trainer.sync import WeightSync

        self.cfg = cfg
        self.hf, self.model_path, tokenizer, layout = setup(cfg)
        dp_group = ps.get_data_parallel_group()
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tasks: list[Task] = []
        for t in cfg.tasks:
            data = t.dataset_config()
            dataset = (load_prompt_dataset(data, tokenizer) if t.is_rl else load_preference_dataset(data, tokenizer))
            if t.batch_size * (t.n_samples_per_prompt if t.is_rl else 1) < dp_size:
                raise ValueError(f"task {t.name}: batch_size ({t.batch_size}) gives fewer sequences than "
                                 f"data-parallel ranks ({dp_size}); raise tasks[i].batch_size")
            self.tasks.append(Task(t, EpochSampler(dataset, t.batch_size, shuffle=data.shuffle, seed=data.seed)))
        mt = cfg.multitask
        self.has_rl = any(t.cfg.is_rl for t in self.tasks)
        use_critic = any(t.cfg.is_rl and t.cfg.algorithm_config().adv_estimator == "gae" for t in self.tasks)
        use_ref = cfg.ref.enabled and (any(not t.cfg.is_rl for t in self.tasks) or cfg.actor.kl_loss_coef > 0
                                       or mt.kl_target is not None)
        updates = cfg.trainer.total_steps * cfg.actor.ppo_epochs
        self.actor, self.ref, self.critic = build_engines(
            cfg, self.hf, self.model_path, actor_updates=updates,
            critic_updates=cfg.trainer.total_steps * cfg.critic.ppo_epochs * len(self.tasks),
            use_ref=use_ref, use_critic=use_critic)
        self.ctx = rl.StepContext(self.actor, self.ref, self.critic, tokenizer, dp_group, dp_rank, dp_size,
                                  score_temperature(cfg))
        self.scheduler = alg.TaskScheduler(
            [t.name for t in self.tasks], [t.cfg.weight for t in self.tasks], combine=mt.combine,
            weighting=mt.weighting, window=mt.auto_window, min_history=mt.auto_min_history,
            min_multiplier=mt.auto_min_multiplier, max_multiplier=mt.auto_max_multiplier,
            smoothing=mt.auto_smoothing)
        self.kl_monitor = (alg.KLLRMonitor(mt.kl_target, mt.kl_lr_decay, mt.kl_min_lr_multiplier)
                           if mt.kl_target is not None else None)

        self.start = 0
        resume_from = ckpt.find_resume(cfg.trainer.output_dir, cfg.trainer.resume)
        if resume_from is not None:
            self._restore(load_run_checkpoint(resume_from, self.actor, self.critic))
            log.info("resumed from %s at step %d", resume_from, self.start)

        self.rollout = None
        if self.has_rl:
            rl_tasks = [t for t in self.tasks if t.cfg.is_rl]
            self.rollout, managers = start_rollout(cfg, self.model_path, [t.cfg.reward for t in rl_tasks])
            for task, manager in zip(rl_tasks, managers):
                task.rewards = manager
        self.sync = None
        self.expected_syncs = 0
        if self.has_rl:
            self.sync = WeightSync(self.actor.model_chunks, self.hf, cfg.trainer.weight_sync,
                                   cfg.trainer.weight_sync_bucket_mb << 20, self.rollout,
                                   os.path.join(cfg.trainer.output_dir, "scratch"), self.model_path)
            if self.start > 0:
                self.expected_syncs = self.sync.sync()
        self.metrics_log = MetricsLogger(cfg.trainer.output_dir, dist.get_rank() == 0, cfg.logger.tensorboard,
                                         wandb_settings(cfg) if cfg.logger.wandb else None, resume_step=self.start)
        log_layout(layout, self.model_path)
        log.info("tasks: %s; combine %s, weighting %s", ", ".join(f"{t.name} ({t.cfg.algorithm}, w {t.cfg.weight})"
                                                                 for t in self.tasks), mt.combine, mt.weighting)

    # -- the loop --------------------------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        for step in range(self.start + 1, cfg.trainer.total_steps + 1):
            m = self.step(step)
            self.metrics_log.log(step, m)
            if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or step == cfg.trainer.total_steps:
                save_run_checkpoint(cfg, step, self.actor, self.critic, self._state())
        if cfg.trainer.export_hf:
            export_hf_folder(self.actor, self.hf, self.model_path, os.path.join(cfg.trainer.output_dir, "hf"))

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        t_step = time.perf_counter()
        m: dict[str, float] = {}
        active = self.scheduler.next_tasks()
        batches: dict[int, TaskBatch] = {}
        for i in active:
            task = self.tasks[i]
            t0 = time.perf_counter()
            tb = self._rl_batch(task, step) if task.cfg.is_rl else self._dpo_batch(task)
            if tb is None:
                log.warning("step %d: task %s had nothing to train on (every group had equal rewards)", step, task.name)
                continue
            tb.metrics["timing/prepare_s"] = time.perf_counter() - t0
            batches[i] = tb
        for i, task in enumerate(self.tasks):
            m[f"task/{task.name}/weight"] = self.scheduler.weights[i]
            m[f"task/{task.name}/trained"] = float(i in batches)
        if not batches:
            m["timing/step_s"] = time.perf_counter() - t_step
            return m

        # ---- one update from every active task's batch (per-task clip, weights), actor.ppo_epochs times -------
        t0 = time.perf_counter()
        order = list(batches)
        coef = dict(zip(order, self.scheduler.coefficients(order)))  # a task that dropped out shares nothing
        grads = [self._task_grad(batches[i], coef[i], self.tasks[i].cfg.clip_grad) for i in order]
        sums: dict[str, float] = {}
        for epoch in range(cfg.actor.ppo_epochs):
            res, per_task = self.actor.multi_objective_step(grads)
            for i, r in zip(order, per_task):
                if epoch == 0 and batches[i].kl is None and "dpo/logratio" in r.metrics:
                    batches[i].kl = r.metrics["dpo/logratio"]  # measured before this step's first update
            _add(sums, "actor/grad_norm", res.grad_norm)
            m["actor/lr"] = res.lr
            for i, r in zip(order, per_task):
                p = f"task/{self.tasks[i].name}/"
                if cfg.actor.ppo_epochs > 1 and epoch in (0, cfg.actor.ppo_epochs - 1):
                    # the same batch before the first and before the last update: did the combined updates
                    # lower this task's own loss?
                    m[p + ("loss/first_epoch" if epoch == 0 else "loss/last_epoch")] = r.loss
                _add(sums, p + "loss", r.loss)
                _add(sums, p + "grad_norm", r.grad_norm)
                _add(sums, p + "clip_coef", r.clip_coef)
                for key, v in r.metrics.items():
                    _add(sums, p + key, v)
        m.update({k: v / cfg.actor.ppo_epochs for k, v in sums.items()})
        for i in order:
            m[f"task/{self.tasks[i].name}/coef"] = coef[i]
        for i in order:  # the critic learns each ppo task's values on that task's rollouts
            if batches[i].critic_seqs is not None:
                cm = rl.update(self.critic, batches[i].critic_seqs, 1, cfg.critic.ppo_epochs,
                               cfg.critic.max_tokens_per_micro_batch, lambda c: critic_loss_fn(cfg.critic, c),
                               self.ctx.dp_group, "critic")
                m.update({f"task/{self.tasks[i].name}/{k}": v for k, v in cm.items()})
        m["timing/train_s"] = time.perf_counter() - t0
        self.scheduler.observe({i: m[f"task/{self.tasks[i].name}/loss"] for i in order})

        # ---- global KL monitor: decay the actor's LR while KL(actor || reference) exceeds the target ------------
        kl = _global_kl([batches[i] for i in order])
        if kl is not None:
            m["kl"] = kl
            if self.kl_monitor is not None:
                self.actor.set_lr_multiplier(self.kl_monitor.update(kl))
                m["kl_monitor/exceeded"] = float(self.kl_monitor.decayed)
        m["actor/lr_multiplier"] = self.actor.lr_multiplier

        for i in order:
            m.update({f"task/{self.tasks[i].name}/{k}": v for k, v in batches[i].metrics.items()})
        if self.sync is not None:
            self.expected_syncs = sync_weights(self.sync, self.expected_syncs, step, m)
        m["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
        if torch.cuda.is_available():
            m["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
        m["timing/step_s"] = time.perf_counter() - t_step
        return m

    # -- per-task batches ------------------------------------------------------------------------------------

    def _rl_batch(self, task: Task, step: int) -> TaskBatch | None:
        cfg, t = self.cfg, task.cfg
        tm: dict[str, float] = {}
        prompts = task.sampler.next_batch()
        samples = rl.generate(self.ctx, self.rollout, task.rewards, prompts, t.n_samples_per_prompt,
                              (step - 1) * t.batch_size, tm)
        # Always the forward pass (actor.old_logprobs auto acts as recompute; rollout is refused by the config):
        # the KL monitor and the per-task metrics read each task's log pi_old from prepare, before the update.
        prep = rl.prepare(self.ctx, samples, t.algorithm_config(), cfg.actor, cfg.rollout.max_new_tokens,
                          task.kl_ctl, tm, old_source="recompute")
        if prep is None:
            return None
        mbs = rl.micro_batches(self.actor, prep.actor_seqs, cfg.actor.max_tokens_per_micro_batch)
        counts = count(mbs, self.actor.device, self.ctx.dp_group)
        loss_fn = actor_loss_fn(cfg.actor, counts, cfg.rollout.max_new_tokens, self.ref is not None, "recompute")
        kl = tm.get("kl") if self.ref is not None else None
        return TaskBatch(mbs, loss_fn, self.ctx.temperature, True, tm, kl, prep.num_response_tokens,
                         prep.critic_seqs)

    def _dpo_batch(self, task: Task) -> TaskBatch:
        cfg, ctx = self.cfg, self.ctx
        items = task.sampler.next_batch()
        mine = [items[i] for i in shard(len(items), ctx.dp_rank, ctx.dp_size)]
        seqs = []
        for it in mine:  # a pair is two consecutive sequences: chosen, then rejected
            for resp in (it.chosen_ids, it.rejected_ids):
                ids = torch.tensor(list(it.prompt_ids) + list(resp), dtype=torch.long)
                mask = torch.zeros(len(ids), dtype=torch.float32)
                mask[len(it.prompt_ids):] = 1.0
                seqs.append({"input_ids": ids, "loss_mask": mask})
        budget = cfg.actor.max_tokens_per_micro_batch
        mbs = rl.micro_batches(self.actor, seqs, cfg.actor.forward_tokens_per_micro_batch, keep_together=2)
        ref = rl.gather_tokens(self.ref.compute_logprobs(mbs), mbs, "logprobs")
        for seq, r in zip(seqs, ref):
            seq["ref_logprobs"] = r
        mbs = rl.micro_batches(self.actor, seqs, budget, keep_together=2)  # again, now with the ref field
        counts = count(mbs, self.actor.device, ctx.dp_group)
        tokens = int(counts.num_tokens)
        metrics = {"response_length/mean": float(counts.num_tokens / counts.num_seqs)}
        return TaskBatch(mbs, dpo_loss_fn(task.cfg.dpo, counts), 1.0, False, metrics, None, tokens)

    def _task_grad(self, tb: TaskBatch, coef: float, clip: float):
        from mcore_rl.engine import TaskGrad

        return TaskGrad(tb.micro_batches, tb.loss_fn, coef, clip, tb.temperature, tb.with_entropy)

    # -- checkpoint state ------------------------------------------------------------------------------------

    def _state(self) -> dict:
        return {"tasks": {t.name: t.sampler.state_dict() for t in self.tasks},
                "scheduler": self.scheduler.state_dict(),
                "kl_monitor": self.kl_monitor.state_dict() if self.kl_monitor is not None else None}

    def _restore(self, state: dict) -> None:
        saved = state.get("tasks")
        if saved is None:
            raise ValueError("the checkpoint is from a single-task run; a multi-task run cannot resume from it")
        missing = [t.name for t in self.tasks if t.name not in saved]
        if missing:
            raise ValueError(f"the checkpoint has no data position for tasks {missing} (it has {sorted(saved)}): "
                             "resume with the tasks it was saved with")
        for t in self.tasks:
            t.sampler.load_state_dict(saved[t.name])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.kl_monitor is not None and state.get("kl_monitor"):
            self.kl_monitor.load_state_dict(state["kl_monitor"])
            self.actor.set_lr_multiplier(self.kl_monitor.lr_multiplier)
        self.start = int(state["step"])

    def close(self) -> None:
        from mcore_rl.parallel import destroy

        self.metrics_log.close()
        if self.sync is not None:
            self.sync.close()
        if self.rollout is not None:
            self.rollout.shutdown()
        for t in self.tasks:
            if t.rewards is not None:
                t.rewards.close()
        destroy()


def train_multitask(cfg: RLConfig) -> None:
    trainer = MultiTaskTrainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()


def _global_kl(batches: list[TaskBatch]) -> float | None:
    """Token-weighted mean over this step's tasks of their KL measure: RL tasks give k1 KL(actor || reference)
    on their own samples (on-policy, an estimate of the true KL); DPO tasks give the mean log-ratio
    log pi - log pi_ref on the dataset's responses (how far the actor moved there; not a KL). None when no task
    measured one (no reference)."""
    parts = [(b.kl, b.kl_tokens) for b in batches if b.kl is not None]
    total = sum(n for _, n in parts)
    return sum(k * n for k, n in parts) / total if total else None


def _add(sums: dict, key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)
