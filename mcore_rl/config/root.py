"""The whole run's configuration: one dataclass per component, composed by Hydra from conf/.

`register()` puts the schema into Hydra's ConfigStore as `rl_schema`; conf/config.yaml lists it first in its
defaults, so every YAML value is type-checked against these dataclasses, and `to_object()` builds the
dataclasses (running each component's __post_init__ validation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.config.agent import AgentConfig
from mcore_rl.config.data import DataConfig, PreferenceDataConfig
from mcore_rl.config.model import ModelConfig
from mcore_rl.config.multitask import DPOSettings, MultiTaskConfig, TaskConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.config.reward import RewardConfig
from mcore_rl.config.rl import ActorConfig, AlgorithmConfig, CriticConfig, RefConfig
from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.config.trainer import LoggerConfig, TrainerConfig
from mcore_rl.config.weight_sync import WeightSyncConfig


@dataclass(frozen=True)
class TaskSpec:
    """A task as the trainer runs it: its TaskConfig with the top-level defaults filled in (RLConfig.task_specs)."""

    name: str
    """TaskConfig.name; for the single task of a run without `tasks`, algorithm.name."""
    kind: str
    """rl | dpo"""
    weight: float
    """TaskConfig.weight (1.0 for the single task)."""
    batch_size: int
    """Prompts (rl) or pairs (dpo) a step: TaskConfig.batch_size, or trainer.prompts_per_step for the single task."""
    clip_grad: float
    """Per-task gradient clip: TaskConfig.clip_grad, or 0 (none; actor.clip_grad still applies) for the single
    task."""
    data: DataConfig | PreferenceDataConfig
    """The dataset config of the task's kind (prompts for rl, pairs for dpo)."""
    algorithm: AlgorithmConfig | None
    """rl tasks."""
    reward: RewardConfig | None
    """rl tasks."""
    dpo: DPOSettings | None
    """dpo tasks."""
    agent: AgentConfig | None = None
    """rl tasks with multi-turn tool-using rollouts (TaskConfig.agent, or the top-level `agent`); None =
    single-turn."""

    @property
    def is_rl(self) -> bool:
        return self.kind == "rl"


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The trained model (actor; the reference and the critic share its architecture)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / DP layout of the trainer."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The actor's optimizer and policy-loss settings."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The critic (built when critic.enabled; needed by the gae estimator)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference model of the KL terms and of DPO."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The SGLang engine and sampling."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the actor's weights reach the rollout engine after each update (transport, layout, bucket size)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm of the single task, and of every rl task in `tasks` that leaves its own out."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts of the single task. With `tasks`, each task names its own data and this node is not read."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward of the single task, and of every rl task in `tasks` that leaves its own out."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, batch size, output folder, checkpoints and resume."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics sinks."""
    tasks: list[TaskConfig] = field(default_factory=list)
    """Several tasks training one actor (config/multitask.py); empty = one task made of `algorithm`, `data`,
    `reward` and `trainer.prompts_per_step`."""
    multitask: MultiTaskConfig = field(default_factory=MultiTaskConfig)
    """Task scheduler and global KL monitor (the monitor also works with one task)."""
    agent: AgentConfig | None = None
    """Multi-turn rollouts with tools (config/agent.py, docs/agent.md) of the single task, and of every rl task
    in `tasks` that leaves its own out; null = single-turn rollouts."""

    def __post_init__(self):
        if self.tasks:
            self._check_task_list()
        for task in self.task_specs():
            where = f"task {task.name}: " if self.tasks else ""
            if task.is_rl:
                self._check_rl_task(task.algorithm, where, task.agent)
            elif not self.ref.enabled:
                raise ValueError(f"{where}dpo compares the actor with the reference; set ref.enabled=true")
        self._check_weight_sync_layout()
        self._check_rollout_mode()
        if self.rollout.log_level is None:  # SGLang's log lines follow the console's level (mcore_rl/console.py)
            self.rollout.log_level = "info" if self.logger.level == "verbose" else "error"
        # One switch: routing replay needs the engine's routes (model.moe_routing_replay's docstring).
        self.rollout.return_routed_experts = self.rollout.return_routed_experts or self.model.moe_routing_replay
        needs_ref = self.actor.kl_loss_coef > 0 or self.multitask.kl_target is not None
        if needs_ref and not self.ref.enabled:
            raise ValueError("actor.kl_loss_coef > 0 or multitask.kl_target is set, but ref.enabled=false: enable "
                             "the reference or turn those off")

    @property
    def multi_task(self) -> bool:
        """Several tasks (the `tasks` list): per-task gradient clipping and metrics under task/<name>/."""
        return bool(self.tasks)

    def task_specs(self) -> list[TaskSpec]:
        """The run's tasks with the top-level defaults filled in: the `tasks` list, or the one task of
        `algorithm` / `data` / `reward` / `trainer.prompts_per_step`."""
        if not self.tasks:
            return [TaskSpec(name=self.algorithm.name, kind="rl", weight=1.0, batch_size=self.trainer.prompts_per_step,
                             clip_grad=0.0, data=self.data, algorithm=self.algorithm, reward=self.reward, dpo=None,
                             agent=self.agent)]
        specs = []
        for t in self.tasks:
            rl = t.is_rl
            specs.append(TaskSpec(name=t.name, kind=t.kind, weight=t.weight, batch_size=t.batch_size,
                                  clip_grad=t.clip_grad, data=t.dataset_config(),
                                  algorithm=(t.algorithm or self.algorithm) if rl else None,
                                  reward=(t.reward or self.reward) if rl else None, dpo=None if rl else t.dpo,
                                  agent=(t.agent or self.agent) if rl else None))
        return specs

    def _check_rl_task(self, algo: AlgorithmConfig, where: str, agent: AgentConfig | None = None) -> None:
        budget, budget_name = ((agent.max_response_tokens, "agent.max_response_tokens") if agent is not None
                               else (self.rollout.max_new_tokens, "rollout.max_new_tokens"))
        if algo.overlong_buffer > budget:
            raise ValueError(f"{where}algorithm.overlong_buffer ({algo.overlong_buffer}) must be at most "
                             f"{budget_name} ({budget}): the penalty ramps in over the "
                             "last overlong_buffer tokens of the response budget")
        if agent is not None and (self.rollout.return_routed_experts or self.model.moe_routing_replay):
            raise ValueError(f"{where}agent rollouts do not carry the engine's routed experts across turns: set "
                             "model.moe_routing_replay=false and rollout.return_routed_experts=false, or agent=null")
        if algo.adv_estimator == "gae" and not self.critic.enabled:
            raise ValueError(f"{where}algorithm.adv_estimator=gae needs a critic: add critic=default "
                             "(critic.enabled=true)")
        outcome_only = ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline")
        if algo.kl_in_reward and algo.adv_estimator in outcome_only:
            raise ValueError(
                f"{where}algorithm.kl_in_reward=true has no effect with adv_estimator={algo.adv_estimator} "
                "(it uses sequence scores, not token rewards): use actor.kl_loss_coef for a KL term, or an "
                "estimator that takes token rewards (gae, reinforce_plus_plus)"
            )
        if algo.kl_in_reward and algo.kl_coef > 0 and not self.ref.enabled:
            raise ValueError(f"{where}algorithm.kl_in_reward with kl_coef > 0 needs the reference: set "
                             "ref.enabled=true or algorithm.kl_coef=0")

    def _check_rollout_mode(self) -> None:
        """What the asynchronous rollout modes (trainer.rollout_mode) cannot serve."""
        t = self.trainer
        if self.rollout.release_while_training is None:
            self.rollout.release_while_training = self.rollout.enable_memory_saver and t.rollout_mode == "sync"
        if t.rollout_mode == "sync":
            return
        if self.rollout.release_while_training:
            raise ValueError(f"rollout.release_while_training=true frees the engine's memory while the step trains, "
                             f"but trainer.rollout_mode={t.rollout_mode} generates then: set one of them back "
                             "(release_while_training=null follows the mode)")
        specs = self.task_specs()
        if not any(s.is_rl for s in specs):
            raise ValueError(f"trainer.rollout_mode={t.rollout_mode} overlaps rollouts with training, but no task "
                             "generates rollouts (every task is dpo): use trainer.rollout_mode=sync")
        if self.multi_task and self.multitask.combine != "weighted_sum":
            raise ValueError(f"trainer.rollout_mode={t.rollout_mode} generates the batches of the coming steps ahead, "
                             f"so it needs to know which tasks they train; multitask.combine="
                             f"{self.multitask.combine} picks them step by step: set multitask.combine=weighted_sum "
                             "or trainer.rollout_mode=sync")
        if t.rollout_mode == "async" and t.partial_rollouts == "continue":
            agents = [s.name for s in specs if s.is_rl and s.agent is not None]
            if agents:
                raise ValueError(f"trainer.partial_rollouts=continue cannot resume multi-turn trajectories in the "
                                 f"middle of a turn (task {agents[0]} has an agent): set trainer.partial_rollouts="
                                 "finish")
            if self.model.moe_routing_replay:
                raise ValueError("trainer.partial_rollouts=continue with model.moe_routing_replay: a continued "
                                 "sample's routes would mix two weight versions; set trainer.partial_rollouts="
                                 "finish or model.moe_routing_replay=false")

    def _check_weight_sync_layout(self) -> None:
        """A layout forced by name that this rollout / parallel config rules out fails now, not at the first sync
        (what only the running engine and model can tell is checked then, by weight_sync/plan.py)."""
        layout = self.weight_sync.layout
        if layout not in ("engine", "shared"):
            return
        from mcore_rl.weight_sync.plan import ActorLayout, EngineFacts, layout_blockers, shared_blockers

        facts = EngineFacts.from_config(self.rollout, self.weight_sync.engine_loaders)
        reasons = layout_blockers(self.weight_sync.transport, facts, None)
        if layout == "shared":
            reasons += shared_blockers(ActorLayout(self.parallel.tp, self.parallel.pp))
        if reasons:
            raise ValueError(f"weight_sync.layout={layout} is not possible: {'; '.join(reasons)}. Set "
                             "weight_sync.layout=auto (falls back to what is possible) or hf.")

    def _check_task_list(self) -> None:
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")
        unknown = [n for n in self.multitask.only if n not in names]
        if unknown:
            raise ValueError(f"multitask.only names tasks {unknown} that are not in tasks {names}")
        if self.multitask.only:
            self.tasks = [t for t in self.tasks if t.name in self.multitask.only]
        if self.actor.mini_batch_size:
            raise ValueError("with tasks, every update uses each task's whole step batch: set actor.mini_batch_size=0 "
                             "(and use tasks[i].batch_size and actor.ppo_epochs to size the updates)")


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rl_schema", node=RLConfig)


def to_object(cfg) -> RLConfig:
    """OmegaConf config -> RLConfig dataclasses (validation runs here)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)
