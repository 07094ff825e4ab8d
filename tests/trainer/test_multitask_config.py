"""The `tasks:` / `multitask:` configuration: Hydra composition of the recipe, and errors that say what to change."""

import os
from pathlib import Path

import pytest

from mcore_rl.config.multitask import MultiTaskConfig, TaskConfig, TaskDataConfig

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
    grpo, dpo = cfg.tasks
    assert (grpo.name, grpo.algorithm, grpo.batch_size, grpo.is_rl) == ("arithmetic", "grpo", 3, True)
    assert (dpo.name, dpo.algorithm, dpo.is_rl) == ("safety", "dpo", False)
    assert grpo.algorithm_config().adv_estimator == "grpo"
    assert dpo.dataset_config().chosen_key == "chosen" and dpo.dataset_config().max_length == 512
    assert cfg.multitask.combine == "alternating"
    for t in cfg.tasks:  # the recipe's data files exist in the repository
        assert all(os.path.isfile(ROOT / f) for f in t.data.train_files)


def _data(**kw):
    return TaskDataConfig(train_files=["x.jsonl"], **kw)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "a b"}, "task name 'a b' must be letters, digits, '_' or '-' (it names metrics)"),
    ({"algorithm": "sft"}, "task t: algorithm must be one of ('grpo', 'ppo', 'dpo'), got 'sft'"),
    ({"weight": 0.0}, "task t: weight must be > 0, got 0.0"),
    ({"batch_size": 0}, "task t: batch_size must be >= 1, got 0"),
    ({"clip_grad": -1.0}, "task t: clip_grad must be >= 0 (0 disables), got -1.0"),
    ({"n_samples_per_prompt": 1}, "task t: algorithm.adv_estimator=grpo compares samples of one prompt"),
    ({"algorithm": "dpo", "data": "max_prompt_length=600"},
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
    with pytest.raises(ValueError, match="task arithmetic: algorithm=ppo with adv_estimator=gae needs a critic"):
        compose("experiment=multitask_grpo_dpo", "tasks.0.algorithm=ppo")
    with pytest.raises(ValueError, match="task safety: dpo compares the actor with the reference"):
        compose("experiment=multitask_grpo_dpo", "ref.enabled=false", "multitask.kl_target=null")
    with pytest.raises(ValueError, match="set actor.mini_batch_size=0"):
        compose("experiment=multitask_grpo_dpo", "actor.mini_batch_size=8")
    with pytest.raises(ValueError, match="actor.old_logprobs=rollout is for single-task runs"):
        compose("experiment=multitask_grpo_dpo", "actor.old_logprobs=rollout")
