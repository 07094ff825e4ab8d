"""The `tasks:` / `multitask:` configuration: Hydra composition of the recipe, and errors that say what to change."""

import os
from pathlib import Path

import pytest

from mcore_rl.config.multitask import MultiTaskConfig, TaskConfig, TaskDataConfig
from mcore_rl.config.rl import AlgorithmConfig

ROOT = Path(__file__).resolve().parents[2]


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mcore_rl.config.root import register, to_object

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_object(hydra_compose("config", overrides=list(overrides)))


def test_recipe_composes_into_task_configs():
    cfg = compose("experiment=multitask_grpo_dpo", "tasks.0.batch_size=3", "multitask.combine=alternating")
    grpo, dpo = cfg.task_specs()
    assert (grpo.name, grpo.kind, grpo.batch_size, grpo.is_rl) == ("arithmetic", "rl", 3, True)
    assert (dpo.name, dpo.kind, dpo.is_rl, dpo.algorithm, dpo.reward) == ("safety", "dpo", False, None, None)
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.algorithm.n_samples_per_prompt == 4
    assert grpo.reward.math.fallback_last_number  # the task's own reward, not the top-level one
    assert dpo.data.chosen_key == "chosen" and dpo.data.max_length == 512 and dpo.dpo.beta == 0.1
    assert cfg.multitask.combine == "alternating"
    for t in cfg.tasks:  # the recipe's data files exist in the repository
        assert all(os.path.isfile(ROOT / f) for f in t.data.train_files)


def _data(**kw):
    return TaskDataConfig(train_files=["x.jsonl"], **kw)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "a b"}, "task name 'a b' must be letters, digits, '_' or '-' (it names metrics)"),
    ({"kind": "sft"}, "task t: kind must be one of ('rl', 'dpo'), got 'sft'"),
    ({"weight": 0.0}, "task t: weight must be > 0, got 0.0"),
    ({"batch_size": 0}, "task t: batch_size must be >= 1, got 0"),
    ({"clip_grad": -1.0}, "task t: clip_grad must be >= 0 (0 disables), got -1.0"),
    ({"kind": "dpo", "algorithm": AlgorithmConfig()}, "task t: a dpo task has no algorithm or reward; remove them"),
    ({"kind": "dpo", "data": "max_prompt_length=600"},
     "task t: max_prompt_length (600) must be smaller than max_length (512)"),
])
def test_task_errors(kwargs, message):
    kwargs = dict(kwargs)
    data = kwargs.pop("data", None)
    data_kw = {"max_length": 512, "max_prompt_length": 600} if data else {}
    with pytest.raises(ValueError) as e:
        TaskConfig(name=kwargs.pop("name", "t"), data=_data(**data_kw), **kwargs)
    assert message in str(e.value)


def test_task_needs_its_data_files():
    with pytest.raises(ValueError, match=r"task t: set data.train_files"):
        TaskConfig(name="t")


@pytest.mark.parametrize("kwargs, message", [
    ({"combine": "sum"}, "multitask.combine must be one of ('weighted_sum', 'alternating'), got 'sum'"),
    ({"weighting": "dynamic"}, "multitask.weighting must be one of ('fixed', 'auto'), got 'dynamic'"),
    ({"auto_min_multiplier": 2.0}, "multitask.auto_min_multiplier (2.0) must be in (0, 1]"),
    ({"auto_min_history": 9}, "multitask.auto_min_history (9) must be in [2, auto_window (8)]"),
    ({"kl_target": 0.0}, "multitask.kl_target must be > 0 (or null to disable), got 0.0"),
])
def test_multitask_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        MultiTaskConfig(**kwargs)
    assert message in str(e.value)


def test_only_selects_tasks():
    cfg = compose("experiment=multitask_grpo_dpo", "multitask.only=[safety]")
    assert [t.name for t in cfg.tasks] == ["safety"]
    with pytest.raises(ValueError, match=r"multitask.only names tasks \['math'\] that are not in tasks"):
        compose("experiment=multitask_grpo_dpo", "multitask.only=[math]")


def test_run_level_errors():
    with pytest.raises(ValueError, match="task names must be unique"):
        compose("experiment=multitask_grpo_dpo", "tasks.1.name=arithmetic")
    with pytest.raises(ValueError, match="task arithmetic: algorithm.adv_estimator=gae needs a critic"):
        compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm.adv_estimator=gae")
    with pytest.raises(ValueError, match="task arithmetic: algorithm.kl_in_reward=true has no effect"):
        compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm.kl_in_reward=true")
    with pytest.raises(ValueError, match=r"algorithm.n_samples_per_prompt >= 2 \(got 1\)"):
        compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm.n_samples_per_prompt=1")
    with pytest.raises(ValueError, match=r"adv_estimator='grpoo' is not one of .*did you mean grpo"):
        compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm.adv_estimator=grpoo")
    with pytest.raises(ValueError, match="task safety: dpo compares the actor with the reference"):
        compose("experiment=multitask_grpo_dpo", "ref.enabled=false", "multitask.kl_target=null")
    with pytest.raises(ValueError, match="set actor.mini_batch_size=0"):
        compose("experiment=multitask_grpo_dpo", "actor.mini_batch_size=8")



def test_task_defaults_come_from_the_top_level():
    """A task that leaves out its algorithm or reward runs with the top-level ones (nothing is silently ignored);
    algorithm features a task's own config sets reach its AlgorithmConfig whole."""
    cfg = compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm=null", "tasks.0.reward=null",
                  "algorithm.n_samples_per_prompt=6", "algorithm.dynamic_sampling=true", "reward.name=exact_match")
    rl = cfg.task_specs()[0]
    assert rl.algorithm is cfg.algorithm and rl.algorithm.n_samples_per_prompt == 6 and rl.algorithm.dynamic_sampling
    assert rl.reward is cfg.reward and rl.reward.name == "exact_match"
    cfg = compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm.overlong_buffer=4",
                  "tasks.0.algorithm.kl_adaptive=true")
    assert cfg.task_specs()[0].algorithm.overlong_buffer == 4 and cfg.task_specs()[0].algorithm.kl_adaptive


def test_single_task_is_one_task():
    cfg = compose("trainer.prompts_per_step=3")
    (spec,) = cfg.task_specs()
    assert not cfg.multi_task and spec.is_rl and spec.batch_size == 3
    assert spec.algorithm is cfg.algorithm and spec.reward is cfg.reward and spec.data is cfg.data
