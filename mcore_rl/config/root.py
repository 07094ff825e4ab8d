"""The whole run's configuration: one dataclass per component, composed by Hydra from conf/.

`register()` puts the schema into Hydra's ConfigStore as `rl_schema`; conf/config.yaml lists it first in its
defaults, so every YAML value is type-checked against these dataclasses, and `to_object()` builds the
dataclasses (running each component's __post_init__ validation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.config.data import DataConfig
from mcore_rl.config.model import ModelConfig
from mcore_rl.config.multitask import MultiTaskConfig, TaskConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.config.reward import RewardConfig
from mcore_rl.config.rl import ActorConfig, AlgorithmConfig, CriticConfig, RefConfig
from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.config.trainer import LoggerConfig, TrainerConfig


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(train_files=["<set data.train_files>"]))
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    tasks: list[TaskConfig] = field(default_factory=list)
    """Multi-task training of one actor (config/multitask.py); empty = the single task of algorithm/data/reward."""
    multitask: MultiTaskConfig = field(default_factory=MultiTaskConfig)

    def __post_init__(self):
        if self.tasks:
            self._check_tasks()
            return
        if self.algorithm.adv_estimator == "gae" and not self.critic.enabled:
            raise ValueError("algorithm.adv_estimator=gae needs a critic: add critic=default (critic.enabled=true)")
        outcome_only = ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline")
        if self.algorithm.kl_in_reward and self.algorithm.adv_estimator in outcome_only:
            raise ValueError(
                f"algorithm.kl_in_reward=true has no effect with adv_estimator={self.algorithm.adv_estimator} "
                "(it uses sequence scores, not token rewards): use actor.kl_loss_coef for a KL term, or an "
                "estimator that takes token rewards (gae, reinforce_plus_plus)"
            )
        uses_kl = self.actor.kl_loss_coef > 0 or (self.algorithm.kl_in_reward and self.algorithm.kl_coef > 0)
        if uses_kl and not self.ref.enabled:
            raise ValueError("a KL coefficient is > 0 but ref.enabled=false: enable the reference or set the "
                             "coefficients (actor.kl_loss_coef, algorithm.kl_coef) to 0")

    def _check_tasks(self) -> None:
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")
        unknown = [n for n in self.multitask.only if n not in names]
        if unknown:
            raise ValueError(f"multitask.only names tasks {unknown} that are not in tasks {names}")
        if self.multitask.only:
            self.tasks = [t for t in self.tasks if t.name in self.multitask.only]
        for t in self.tasks:
            if t.is_rl and t.algorithm_config().adv_estimator == "gae" and not self.critic.enabled:
                raise ValueError(f"task {t.name}: algorithm={t.algorithm} with adv_estimator=gae needs a critic: "
                                 "add critic=default (critic.enabled=true), or set the task's adv_estimator")
            if not t.is_rl and not self.ref.enabled:
                raise ValueError(f"task {t.name}: dpo compares the actor with the reference; set ref.enabled=true")
        if self.actor.mini_batch_size:
            raise ValueError("with tasks, every update uses each task's whole step batch: set actor.mini_batch_size=0 "
                             "(and use tasks[i].batch_size and actor.ppo_epochs to size the updates)")
        if self.actor.old_logprobs == "rollout":
            raise ValueError("actor.old_logprobs=rollout is for single-task runs; with tasks the old log-probs are "
                             "recomputed: set actor.old_logprobs to auto or recompute")
        needs_ref = self.actor.kl_loss_coef > 0 or self.multitask.kl_target is not None
        if needs_ref and not self.ref.enabled:
            raise ValueError("actor.kl_loss_coef > 0 or multitask.kl_target is set, but ref.enabled=false: enable "
                             "the reference or turn those off")


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rl_schema", node=RLConfig)


def to_object(cfg) -> RLConfig:
    """OmegaConf config -> RLConfig dataclasses (validation runs here)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)
