"""Command-line overrides checked against the schema before Hydra (mcore_rl/config/cli.py)."""

import pytest

from mcore_rl.config.cli import check_output_dir, check_overrides


@pytest.mark.parametrize("arg, message", [
    ("trainer.totl_steps=3", "unknown config key 'trainer.totl_steps': trainer has no field 'totl_steps'; did you "
                             "mean trainer.total_steps? its fields: checkpoint_reshardable, deterministic, "),
    ("trainr.total_steps=3", "unknown config key 'trainr.total_steps': the config has no field 'trainr'; did you mean "
                             "trainer?"),
    ("agent.max_turnz=3", "agent has no field 'max_turnz'; did you mean agent.max_turns?"),
    ("trainer.total_steps=three", "config key 'trainer.total_steps' takes an integer, got 'three'"),
    ("rollout.temperature=hot", "config key 'rollout.temperature' takes a number, got 'hot'"),
    ("logger.tensorboard=maybe", "config key 'logger.tensorboard' takes true or false, got 'maybe'"),
])
def test_mistakes_are_named_with_what_is_valid(arg, message):
    with pytest.raises(ValueError) as e:
        check_overrides([arg])
    assert message in str(e.value)


@pytest.mark.parametrize("arg", ["trainer.total_steps=3", "rollout.temperature=0.7", "logger.tensorboard=false",
                                 "experiment=gsm8k", "+trainer.extra=1", "hydra.run.dir=x", "tasks=[]",
                                 "trainer.total_steps=1,2", "trainer.total_steps=${oc.env:STEPS}",
                                 "model.path=null", "trainer.stop_signals=[SIGTERM]", "--cfg"])
def test_valid_overrides_and_what_hydra_checks_pass(arg):
    check_overrides([arg])


def test_output_dir_that_cannot_be_made_is_refused_without_creating_anything(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=f"trainer.output_dir={tmp_path}/f/run cannot be created or written: "
                                         f"{tmp_path}/f is not a folder; choose a folder"):
        check_output_dir([f"trainer.output_dir={tmp_path}/f/run"])
    check_output_dir([f"trainer.output_dir={tmp_path}/new/run"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
