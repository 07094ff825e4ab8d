"""Task kinds: what one task brings to a training step. The loop (trainer/loop.py) sees only this interface:

    batch, metrics = task.next_batch(step)      # RLBatch | PreferenceBatch | Skip, and the task's metrics
    objective = task.objective(batch)           # micro batches + loss for the actor's update
    metrics = task.train_critic(batch)          # the critic's updates on this batch ({} when it has none)
    task.state_dict() / task.load_state_dict()  # data position (and KL controller) for checkpoints
    task.close()                                # reward workers and tools, once, when the run ends

RLTask: prompts -> SGLang rollout -> reward -> forward passes and advantages (rl_step.py); with an `agent`
    node the rollout is multi-turn with tools (mcore_rl/agent/rollout.py), the rest the same.
PreferenceTask: (prompt, chosen, rejected) pairs -> the reference's log-probs -> the DPO loss.
With trainer.rollout_mode != sync an RLTask takes its rollouts from rank 0's RolloutProducer
    (async_rollout.py), which made them ahead, instead of generating them; the rest of its step is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mcore_rl import algorithms as alg
from mcore_rl.config.root import RLConfig, TaskSpec
from mcore_rl.trainer import rl_step as rl
from mcore_rl.trainer.batch import pair_sequences, shard
from mcore_rl.trainer.losses import (PeakMetrics, actor_loss_fn, count, critic_loss_fn, dpo_loss_fn,
                                     step_peaks)
from mcore_rl.trainer.step_data import PreferenceBatch, RLBatch, Skip


@dataclass
class Objective:
    """A task's part of the actor's update: its micro batches and loss (engine.TaskGrad, with the scheduler's
    coefficient and the task's clip added by the loop)."""

    micro_batches: list
    loss_fn: Callable
    temperature: float
    with_entropy: bool
    kl: float | None
    """This task's measure of how far the actor is from the reference (loop._global_kl), or None."""
    kl_tokens: int
    peaks: PeakMetrics | None = None


class RLTask:
    def __init__(self, spec: TaskSpec, cfg: RLConfig, ctx: rl.StepContext, sampler, *, num_mini_batches: int,
                 use_ref: bool):
        self.spec, self.cfg, self.ctx, self.sampler = spec, cfg, ctx, sampler
        self.name = spec.name
        self.algo = spec.algorithm
        self.rewards = None  # RewardManager on global rank 0 (Run.start_rollout)
        self.num_mini_batches = num_mini_batches
        self.kl_ctl = (alg.AdaptiveKLController(self.algo.kl_coef, self.algo.kl_target, self.algo.kl_horizon)
                       if self.algo.kl_adaptive else alg.FixedKLController(self.algo.kl_coef))
        kl_in_reward = self.algo.kl_in_reward and use_ref
        mode = cfg.actor.old_logprobs
        if cfg.multi_task and mode == "auto":
            # the KL monitor and the per-task metrics read each task's log pi_old before the combined update
            mode = "recompute"
        self.old_source = rl.old_logprob_source(mode, ppo_epochs=cfg.actor.ppo_epochs,
                                                num_mini_batches=num_mini_batches, kl_in_reward=kl_in_reward)
        self.agent = None  # AgentRollout on global rank 0, built at the first rollout (agent_rollout)
        self.producer = None  # RolloutProducer on global rank 0 of an asynchronous run (Run)
        # The response budget the length-normalised losses and the overlong penalty measure against: a turn's
        # for single-turn samples, the whole trajectory's for agentic ones.
        self.max_response = spec.agent.max_response_tokens if spec.agent else cfg.rollout.max_new_tokens

    def next_batch(self, step: int, engine) -> tuple[RLBatch | Skip, dict[str, float]]:
        if self.cfg.trainer.rollout_mode != "sync":  # made ahead by rank 0's producer (async_rollout.py)
            rollout, m = rl.receive(*(self.producer.take(self, step) if self.producer is not None else (None, None)))
            if not rollout.samples:
                return Skip("every sample was older than trainer.max_staleness allows"), m
            batch, prep_m = rl.prepare(self.ctx, rollout, self.algo, self.cfg.actor, self.max_response,
                                       self.kl_ctl, self.old_source, self.ref_in_update())
            return batch, {**m, **prep_m}
        prompts = self.sampler.next_batch()
        n = self.algo.n_samples_per_prompt
        rollout, m = rl.generate(self.ctx, engine, self.rewards, prompts, n, (step - 1) * len(prompts),
                                 agent=self.agent_rollout(engine),
                                 seed_stream=f"task:{self.name}" if self.cfg.multi_task else "")
        batch, prep_m = rl.prepare(self.ctx, rollout, self.algo, self.cfg.actor, self.max_response,
                                   self.kl_ctl, self.old_source, self.ref_in_update())
        return batch, {**m, **prep_m}

    def ref_in_update(self) -> bool:
        """rl_step.ref_in_update for this task (asked per batch: the engines are built after the tasks)."""
        return rl.ref_in_update(self.cfg.ref.compute_at, self.ctx.ref, old_source=self.old_source,
                                kl_in_reward=self.algo.kl_in_reward)

    def agent_rollout(self, engine):
        """The task's AgentRollout where this rank generates and the task has an `agent` node, else None."""
        if self.agent is None and engine is not None and self.spec.agent is not None:
            from mcore_rl.agent.rollout import AgentRollout
            from mcore_rl.agent.tools import build_tools

            self.agent = AgentRollout(self.spec.agent, self.ctx.tokenizer, build_tools(self.spec.agent.tools))
        return self.agent

    def close(self) -> None:
        try:
            if self.agent is not None:
                self.agent.close()
        finally:
            if self.rewards is not None:
                self.rewards.close()

    def train_alone(self, batch: RLBatch) -> dict[str, float]:
        """The actor's updates when this is the run's only task: mini-batches x ppo_epochs optimizer steps, each
        under the actor's global clip."""
        return rl.update_actor(self.ctx, batch, self.cfg.actor, self.num_mini_batches, self.max_response)

    def objective(self, batch: RLBatch) -> Objective:
        actor = self.ctx.actor
        mbs = rl.micro_batches(actor, batch.actor, self.cfg.actor.max_tokens_per_micro_batch)
        peaks = step_peaks(self.cfg.actor, batch.old_source, actor.device)
        counts = count(mbs, actor.device, self.ctx.dp_group)
        loss_fn = actor_loss_fn(self.cfg.actor, counts, self.max_response, self.ctx.ref is not None,
                                batch.old_source, peaks)
        kl = batch.kl if self.ctx.ref is not None else None
        return Objective(mbs, loss_fn, self.ctx.temperature, True, kl, batch.num_response_tokens, peaks)

    def train_critic(self, batch: RLBatch) -> dict[str, float]:
        critic = self.ctx.critic
        if critic is None or batch.critic is None:
            return {}
        c = self.cfg.critic
        return rl.update(critic, batch.critic, self.num_mini_batches, c.ppo_epochs, c.max_tokens_per_micro_batch,
                         lambda counts: critic_loss_fn(c, counts), self.ctx.dp_group, "critic")

    def state_dict(self) -> dict:
        return {"data": self.sampler.state_dict(), "kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["data"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])


class PreferenceTask:
    def __init__(self, spec: TaskSpec, cfg: RLConfig, ctx: rl.StepContext, sampler):
        self.spec, self.cfg, self.ctx, self.sampler = spec, cfg, ctx, sampler
        self.name = spec.name
        self.rewards = None

    def next_batch(self, step: int, engine=None) -> tuple[PreferenceBatch, dict[str, float]]:
        ctx, actor = self.ctx, self.ctx.actor
        items = self.sampler.next_batch()
        seqs = pair_sequences([items[i] for i in shard(len(items), ctx.dp_rank, ctx.dp_size)])
        mbs = rl.micro_batches(actor, seqs, self.cfg.actor.forward_tokens_per_micro_batch, keep_together=2)
        seqs = seqs.with_fields(ref_logprobs=rl.gather_tokens(ctx.ref.compute_logprobs(mbs), mbs, "logprobs"))
        counts = count(mbs, actor.device, ctx.dp_group)  # sums over the sequences: any micro batching gives them
        tokens = int(counts.num_tokens)
        return PreferenceBatch(seqs, tokens), {"response_length/mean": float(counts.num_tokens / counts.num_seqs)}

    def objective(self, batch: PreferenceBatch) -> Objective:
        actor = self.ctx.actor
        mbs = rl.micro_batches(actor, batch.actor, self.cfg.actor.max_tokens_per_micro_batch, keep_together=2)
        loss_fn = dpo_loss_fn(self.spec.dpo, count(mbs, actor.device, self.ctx.dp_group))
        return Objective(mbs, loss_fn, 1.0, False, None, batch.num_response_tokens)

    def train_critic(self, batch: PreferenceBatch) -> dict[str, float]:
        return {}

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()

    def state_dict(self) -> dict:
        return {"data": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["data"])


def build_tasks(cfg: RLConfig, ctx: rl.StepContext, tokenizer, *, use_ref: bool) -> list:
    """One task object per TaskSpec, each with its dataset and sampler (before the engines are built: ctx holds
    the data-parallel layout; use_ref says whether a reference model will be)."""
    from mcore_rl.data.preference import load_preference_dataset
    from mcore_rl.data.prompts import load_prompt_dataset
    from mcore_rl.data.sampler import EpochSampler

    tasks = []
    for spec in cfg.task_specs():
        per_item = spec.algorithm.n_samples_per_prompt if spec.is_rl else 1
        if cfg.multi_task and spec.batch_size * per_item < ctx.dp_size:
            raise ValueError(f"task {spec.name}: batch_size ({spec.batch_size}) gives fewer sequences than "
                             f"data-parallel ranks ({ctx.dp_size}); raise tasks[i].batch_size")
        if spec.is_rl:
            dataset = load_prompt_dataset(spec.data, tokenizer, tools=prompt_tools(spec))
        else:
            dataset = load_preference_dataset(spec.data, tokenizer)
        sampler = EpochSampler(dataset, spec.batch_size, shuffle=spec.data.shuffle, seed=spec.data.seed)
        if spec.is_rl:
            tasks.append(RLTask(spec, cfg, ctx, sampler, num_mini_batches=num_mini_batches(cfg, spec, ctx.dp_size),
                                use_ref=use_ref))
        else:
            tasks.append(PreferenceTask(spec, cfg, ctx, sampler))
    return tasks


def num_mini_batches(cfg: RLConfig, spec: TaskSpec, dp_size: int) -> int:
    total = spec.batch_size * spec.algorithm.n_samples_per_prompt
    mini = cfg.actor.mini_batch_size or total
    if total % mini:
        raise ValueError(f"trainer.prompts_per_step x algorithm.n_samples_per_prompt ({total}) is not divisible by "
                         f"actor.mini_batch_size ({mini})")
    if mini < dp_size:
        raise ValueError(f"actor.mini_batch_size ({mini}) must be at least the data-parallel size ({dp_size}): "
                         "every DP rank needs a sample in every mini-batch")
    return total // mini


def prompt_tools(spec: TaskSpec) -> list[dict] | None:
    """The tool schemas an agent task's prompts are rendered with (agent.tools_in_prompt), else None."""
    if spec.agent is None or not spec.agent.tools_in_prompt:
        return None
    from mcore_rl.agent.tools import tool_schemas

    return tool_schemas(spec.agent.tools)
