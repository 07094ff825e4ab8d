"""RLConfig: every error it raises, through Hydra composition as a user meets them (the command line), each
checked by its message; and registry names checked when the config is built, naming the close matches."""

from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mcore_rl.config.root import register, to_object

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_object(hydra_compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae needs a critic: add critic=default"),
    (["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward=true has no effect with adv_estimator=grpo"),
    (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1",
      "ref.enabled=false"], "algorithm.kl_in_reward with kl_coef > 0 needs the reference"),
    (["algorithm.overlong_buffer=30"], "algorithm.overlong_buffer (30) must be at most rollout.max_new_tokens (24)"),
    (["experiment=multitask_grpo_dpo", "tasks.1.dpo.loss_type=ipo", "tasks.1.dpo.label_smoothing=0.1"],
     "dpo.label_smoothing (0.1) applies to loss_type=sigmoid only"),
    (["weight_sync.layout=engine", "rollout.tp_size=2"],
     "weight_sync.layout=engine is not possible: rollout.tp_size=2"),
    (["weight_sync.layout=shared", "parallel.tp=2"],
     "weight_sync.layout=shared is not possible: the actor is split (parallel.tp=2, parallel.pp=1)"),
    (["actor.kl_loss_coef=0.1", "ref.enabled=false"],
     "actor.kl_loss_coef > 0 or multitask.kl_target is set, but ref.enabled=false"),
    (["multitask.kl_target=0.1", "ref.enabled=false"],
     "actor.kl_loss_coef > 0 or multitask.kl_target is set, but ref.enabled=false"),
    (["experiment=multitask_grpo_dpo", "actor.mini_batch_size=8"], "set actor.mini_batch_size=0"),
    (["experiment=multitask_grpo_dpo", "tasks.1.name=arithmetic"], "task names must be unique"),
    (["experiment=multitask_grpo_dpo", "multitask.only=[math]"],
     "multitask.only names tasks ['math'] that are not in tasks"),
    (["experiment=multitask_grpo_dpo", "ref.enabled=false", "multitask.kl_target=null"],
     "task safety: dpo compares the actor with the reference"),
    (["trainer.rollout_mode=asynchronous"],
     "trainer.rollout_mode must be one of ('sync', 'one_step_off_policy', 'async'), got 'asynchronous'"),
    (["trainer.rollout_mode=async", "trainer.max_staleness=0"], "trainer.max_staleness must be >= 1"),
    (["trainer.rollout_mode=async", "trainer.partial_rollouts=abort"],
     "trainer.partial_rollouts must be finish or continue, got 'abort'"),
    (["experiment=multitask_grpo_dpo", "multitask.combine=alternating", "trainer.rollout_mode=one_step_off_policy"],
     "multitask.combine=alternating picks them step by step: set multitask.combine=weighted_sum"),
    (["experiment=cpu_agent_calculator", "trainer.rollout_mode=async", "trainer.partial_rollouts=continue"],
     "cannot resume multi-turn trajectories in the middle of a turn (task grpo has an agent): set "
     "trainer.partial_rollouts=finish"),
    (["trainer.rollout_mode=one_step_off_policy", "rollout.release_while_training=true"],
     "rollout.release_while_training=true frees the engine's memory while the step trains, but "
     "trainer.rollout_mode=one_step_off_policy generates then"),
    (["trainer.rollout_mode=async", "trainer.partial_rollouts=continue", "model.moe_routing_replay=true"],
     "a continued sample's routes would mix two weight versions"),
])
def test_run_config_errors(overrides, message):
    with pytest.raises(ValueError) as e:
        compose(*overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator='grpoo' is not one of dr_grpo, gae, grpo"),
    ("actor.policy_loss=ppoo", "actor.policy_loss='ppoo' is not one of gspo, pg, ppo; did you mean ppo"),
    ("actor.loss_agg_mode=token_mean", "actor.loss_agg_mode='token_mean' is not one of"),
    ("actor.kl_loss_estimator=k4", "actor.kl_loss_estimator='k4' is not one of k1, k2, k3"),
    ("algorithm.kl_estimator=low_var", "algorithm.kl_estimator='low_var' is not one of k1, k2, k3"),
    ("actor.old_logprobs=recomptue", "did you mean recompute"),
])
def test_registry_names_fail_at_build_time(override, message):
    with pytest.raises(ValueError) as e:
        compose(override)
    assert message in str(e.value)
    assert "grpoo" not in override or "did you mean grpo" in str(e.value)


def test_optimizer_errors_name_the_section_written():
    with pytest.raises(ValueError, match=r"^actor.min_lr \(0.5\) must be in \[0, lr"):
        compose("actor.min_lr=0.5")
    with pytest.raises(ValueError, match=r"^critic.lr_warmup_init"):
        compose("critic.lr_warmup_init=1.0")


def test_optimizer_fields_settable_from_yaml():
    cfg = compose("actor.lr_warmup_init=1e-7", "actor.use_distributed_optimizer=false",
                  "actor.grad_reduce_in_fp32=false", "critic.lr_decay_style=cosine")
    assert cfg.actor.lr_warmup_init == 1e-7 and not cfg.actor.use_distributed_optimizer
    assert not cfg.actor.grad_reduce_in_fp32 and cfg.critic.lr_decay_steps is None


@pytest.mark.parametrize("override, key", [("model=hf", "model.path"), ("data.train_files=???", "data.train_files"),
                                           ("tasks.0.data.train_files=???", "tasks[0].data.train_files")])
def test_required_fields_are_named_when_missing(override, key):
    from omegaconf.errors import MissingMandatoryValue

    extra = ["experiment=multitask_grpo_dpo"] if override.startswith("tasks") else []
    with pytest.raises(MissingMandatoryValue) as e:
        compose(*extra, override)
    assert key in str(e.value)


def test_release_while_training_follows_the_memory_saver_and_the_mode():
    """null: the colocated engine's memory is released while training when the memory saver can free it and
    nothing generates during the update (trainer.rollout_mode=sync)."""
    assert compose("rollout=gpu", "rollout.enable_memory_saver=true").rollout.release_while_training is True
    assert compose("rollout=gpu", "rollout.enable_memory_saver=true",
                   "trainer.rollout_mode=one_step_off_policy").rollout.release_while_training is False
    assert compose().rollout.release_while_training is False
