import pytest
from omegaconf import OmegaConf

from mcore_rl.config.data import DataConfig, PreferenceDataConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(train_files=[]), "train_files is empty"),
        (dict(train_files="a.jsonl"), "write train_files=['a.jsonl']"),
        (dict(train_files=["a"], max_prompt_length=0), "max_prompt_length (0) must be positive"),
        (dict(train_files=["a"], on_bad_row="ignore"), "on_bad_row ('ignore') must be one of ('error', 'skip')"),
        (dict(train_files=["a"], prompt_key=""), "prompt_key is empty"),
        (dict(train_files=["a"], meta_keys=["answer"]), "meta_keys contains 'answer'"),
        (dict(train_files=["a"], meta_keys=["messages"]), "meta_keys contains 'messages'"),
        (dict(train_files=["a"], meta_keys=["prompt"]), "meta_keys contains the prompt column 'prompt'"),
        (dict(train_files=["a"], meta_keys=["x", "x"]), "meta_keys has duplicates"),
        (dict(train_files=["a"], meta_keys="x"), "meta_keys must be a list"),
    ],
)
def test_data_config_errors_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError) as e:
        DataConfig(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chosen_key="prompt"), "must differ"),
        (dict(max_length=0), "max_length (0) must be positive"),
        (dict(max_prompt_length=512, max_length=512), "max_prompt_length (512) must be smaller than max_length (512)"),
    ],
)
def test_preference_config_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        PreferenceDataConfig(train_files=["a"], **kwargs)
    assert message in str(e.value)


def test_configs_work_as_omegaconf_structured_configs():
    base = OmegaConf.structured(DataConfig)
    overrides = ["train_files=[a.jsonl,b]", "meta_keys=[numbers]", "system_prompt=Be brief."]
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    cfg = OmegaConf.to_object(merged)
    assert cfg == DataConfig(train_files=["a.jsonl", "b"], meta_keys=["numbers"], system_prompt="Be brief.")
    bad = OmegaConf.merge(base, OmegaConf.from_dotlist(["train_files=[a]", "on_bad_row=maybe"]))
    with pytest.raises(ValueError, match="on_bad_row"):
        OmegaConf.to_object(bad)
    pref = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PreferenceDataConfig), {"train_files": ["p"]}))
    assert pref.chosen_key == "chosen" and pref.max_length == 2048
