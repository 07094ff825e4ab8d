"""Multi-task training of one shared actor: the `tasks:` list and the task scheduler (`multitask:`).

    tasks:
      - {name: math,   kind: rl,  weight: 1.0, batch_size: 8, data: {train_files: [...]}, reward: {name: math},
         algorithm: {adv_estimator: grpo, n_samples_per_prompt: 4}}
      - {name: safety, kind: dpo, weight: 0.5, batch_size: 8, data: {train_files: [...]}, dpo: {beta: 0.1}}
    multitask: {combine: weighted_sum, weighting: auto, kl_target: 0.05}

Every task trains the same actor (one set of parameters, one optimizer). RL tasks draw prompts, roll out through
the one SGLang engine, score them with their reward and train with their own algorithm config (a whole
AlgorithmConfig, or the top-level `algorithm` when left out); DPO tasks read (prompt, chosen, rejected) rows and
compare the actor with the frozen reference. The scheduler (mcore_rl.algorithms.TaskScheduler,
rule in docs/algorithms.md) sets each task's weight; `combine` decides how the task losses meet: one update from
the weighted sum of the (per-task clipped) gradients, or one task per step in proportion to the weights.
When `tasks` is empty the run has one task, made of the top-level `algorithm`, `data`, `reward` and
`trainer.prompts_per_step` (RLConfig.task_configs()); the loop is the same (trainer/loop.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from omegaconf import MISSING

from mcore_rl.config.agent import AgentConfig
from mcore_rl.config.data import DataConfig, PreferenceDataConfig, _FileDataConfig
from mcore_rl.config.reward import RewardConfig
from mcore_rl.config.rl import AlgorithmConfig

TASK_KINDS = ("rl", "dpo")
COMBINE_MODES = ("weighted_sum", "alternating")
WEIGHTING_MODES = ("fixed", "auto")


@dataclass
class TaskDataConfig(_FileDataConfig):
    """A task's dataset: the prompt-dataset fields (RL tasks) and the preference fields (DPO tasks) in one place;
    each task reads the ones of its kind (see DataConfig and PreferenceDataConfig for their meaning)."""

    answer_key: str | None = "answer"
    """rl tasks: column of the reference answer (DataConfig.answer_key); null for data without answers."""
    meta_keys: list[str] = field(default_factory=list)
    """rl tasks: further columns copied into the samples' meta for the reward (DataConfig.meta_keys)."""
    chosen_key: str = "chosen"
    """dpo tasks: column of the preferred response (PreferenceDataConfig.chosen_key)."""
    rejected_key: str = "rejected"
    """dpo tasks: column of the dispreferred response (PreferenceDataConfig.rejected_key)."""
    max_length: int | None = 2048
    """dpo tasks: pairs whose prompt plus longer response exceeds this many tokens are dropped; null keeps all
    (PreferenceDataConfig.max_length)."""

    def _common(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(_FileDataConfig)}

    def for_prompts(self) -> DataConfig:
        return DataConfig(**self._common(), answer_key=self.answer_key, meta_keys=list(self.meta_keys))

    def for_pairs(self) -> PreferenceDataConfig:
        return PreferenceDataConfig(**self._common(), chosen_key=self.chosen_key, rejected_key=self.rejected_key,
                                    max_length=self.max_length)


@dataclass
class DPOSettings:
    beta: float = 0.1
    """Strength of the implicit KL to the reference (Rafailov et al. 2023)."""
    loss_type: str = "sigmoid"
    """sigmoid: the DPO loss -log sigmoid(beta x margin); ipo: IPO's squared loss (Azar et al. 2023), which
    does not push the margin to infinity on separable pairs."""
    label_smoothing: float = 0.0
    """Conservative DPO: assumed fraction of flipped labels, in [0, 0.5); 0 = plain DPO. loss_type=sigmoid
    only."""

    def __post_init__(self):
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"dpo.loss_type must be sigmoid or ipo, got {self.loss_type!r}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError(f"dpo.label_smoothing ({self.label_smoothing}) applies to loss_type=sigmoid only: set "
                             "dpo.label_smoothing=0 or dpo.loss_type=sigmoid")


@dataclass
class TaskConfig:
    name: str = "task"
    """Metrics go under task/<name>/; letters, digits, '_' and '-'."""
    kind: str = "rl"
    """rl: prompts, rollouts, a reward and the policy-gradient loss of `algorithm`. dpo: preference pairs and
    the DPO loss against the frozen reference."""
    weight: float = 1.0
    """Base weight: the share of the combined gradient (weighted_sum) or of the steps (alternating)."""
    batch_size: int = 8
    """Prompts (rl) or preference pairs (dpo) drawn per step, over all data-parallel ranks."""
    clip_grad: float = 1.0
    """This task's gradient norm is clipped to this before the tasks are combined (0 disables)."""
    data: TaskDataConfig = field(default_factory=TaskDataConfig)
    """The task's dataset: prompts (rl) or (prompt, chosen, rejected) rows (dpo)."""
    algorithm: AlgorithmConfig | None = None
    """rl tasks: the whole algorithm config (estimator, samples per prompt, KL in reward, DAPO filters ...), as
    the top-level `algorithm:`; null = the top-level `algorithm` itself. dpo tasks must leave it null."""
    reward: RewardConfig | None = None
    """rl tasks: how samples are scored; null = the top-level `reward`. dpo tasks must leave it null."""
    dpo: DPOSettings = field(default_factory=DPOSettings)
    """dpo tasks: the loss's settings."""
    agent: AgentConfig | None = None
    """rl tasks: multi-turn rollouts with tools (config/agent.py); null = the top-level `agent` (itself null:
    single-turn). dpo tasks must leave it null."""

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.name or ""):
            raise ValueError(f"task name {self.name!r} must be letters, digits, '_' or '-' (it names metrics)")
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.name}: kind must be one of {TASK_KINDS}, got {self.kind!r}")
        if self.weight <= 0:
            raise ValueError(f"task {self.name}: weight must be > 0, got {self.weight}")
        if self.batch_size < 1:
            raise ValueError(f"task {self.name}: batch_size must be >= 1, got {self.batch_size}")
        if self.clip_grad < 0:
            raise ValueError(f"task {self.name}: clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        if self.data.train_files == MISSING:
            raise ValueError(f"task {self.name}: set data.train_files")
        if not self.is_rl and (self.algorithm is not None or self.reward is not None):
            raise ValueError(f"task {self.name}: a dpo task has no algorithm or reward; remove them (its loss is set "
                             "by dpo: {beta, loss_type, label_smoothing})")
        if not self.is_rl and self.agent is not None:
            raise ValueError(f"task {self.name}: a dpo task generates nothing, so it takes no agent; remove it")
        try:  # validate the fields this task reads, with the task named in the message
            self.dataset_config()
        except ValueError as e:
            raise ValueError(f"task {self.name}: {e}") from None

    @property
    def is_rl(self) -> bool:
        return self.kind == "rl"

    def dataset_config(self) -> DataConfig | PreferenceDataConfig:
        return self.data.for_prompts() if self.is_rl else self.data.for_pairs()


@dataclass
class MultiTaskConfig:
    combine: str = "weighted_sum"
    """weighted_sum: every step trains every task; one optimizer update from sum_i (w_i / sum w) * clip_i(g_i).
    alternating: every step trains one task (its clipped gradient alone), chosen by smooth weighted round-robin,
    so each task gets a share of the steps proportional to its weight; only that task's data is drawn."""
    weighting: str = "fixed"
    """fixed: the tasks' base weights. auto: base weight x a multiplier from the task's recent loss fluctuation."""
    auto_window: int = 8
    """auto: the standard deviation is taken over the task's last this-many losses."""
    auto_min_history: int = 3
    """auto: weights stay at their base until every task has this many losses."""
    auto_min_multiplier: float = 0.25
    """auto: lower bound of the multiplier std_i / mean_j(std_j), in (0, 1]."""
    auto_max_multiplier: float = 4.0
    """auto: upper bound of that multiplier, >= 1."""
    auto_smoothing: float = 0.5
    """auto: the new weight is smoothing x old + (1 - smoothing) x target (0 = jump to the target)."""
    kl_target: float | None = None
    """Global KL monitor: when the step's KL of the actor to the reference exceeds this, the actor's learning
    rate is multiplied by kl_lr_decay (never below kl_min_lr_multiplier, never raised again). None = off."""
    kl_lr_decay: float = 0.5
    """Factor, in (0, 1], the actor's learning-rate multiplier is multiplied by at each step whose KL exceeds
    kl_target (1 = only monitor)."""
    kl_min_lr_multiplier: float = 0.01
    """Floor of that multiplier, in [0, 1] (a fraction of the schedule's learning rate)."""
    only: list[str] = field(default_factory=list)
    """Train only these tasks of `tasks` (names; empty = all): ablate a recipe's task from the command line,
    e.g. multitask.only=[arithmetic]."""

    def __post_init__(self):
        if self.combine not in COMBINE_MODES:
            raise ValueError(f"multitask.combine must be one of {COMBINE_MODES}, got {self.combine!r}")
        if self.weighting not in WEIGHTING_MODES:
            raise ValueError(f"multitask.weighting must be one of {WEIGHTING_MODES}, got {self.weighting!r}")
        if self.auto_window < 2:
            raise ValueError(f"multitask.auto_window must be >= 2 (a standard deviation), got {self.auto_window}")
        if not 2 <= self.auto_min_history <= self.auto_window:
            raise ValueError(f"multitask.auto_min_history ({self.auto_min_history}) must be in "
                             f"[2, auto_window ({self.auto_window})]")
        if not 0 < self.auto_min_multiplier <= 1 <= self.auto_max_multiplier:
            raise ValueError(f"multitask.auto_min_multiplier ({self.auto_min_multiplier}) must be in (0, 1] and "
                             f"auto_max_multiplier ({self.auto_max_multiplier}) >= 1")
        if not 0 <= self.auto_smoothing < 1:
            raise ValueError(f"multitask.auto_smoothing must be in [0, 1), got {self.auto_smoothing}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ValueError(f"multitask.kl_target must be > 0 (or null to disable), got {self.kl_target}")
        if not 0 < self.kl_lr_decay <= 1:
            raise ValueError(f"multitask.kl_lr_decay must be in (0, 1], got {self.kl_lr_decay}")
        if not 0 <= self.kl_min_lr_multiplier <= 1:
            raise ValueError(f"multitask.kl_min_lr_multiplier must be in [0, 1], got {self.kl_min_lr_multiplier}")
