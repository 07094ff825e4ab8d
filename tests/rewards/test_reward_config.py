import pytest
from omegaconf import OmegaConf

from mcore_rl.config.reward import (
    ExactMatchRewardConfig,
    MathRewardConfig,
    RemoteRewardConfig,
    RewardConfig,
    RewardModelConfig,
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="gsm9k"), "reward name 'gsm9k' is unknown; choose one of"),
        (dict(name="function"), "name='function' needs function_path"),
        (dict(name="reward_model"), "name='reward_model' needs reward_model.path"),
        (dict(name="remote"), "name='remote' needs remote.url starting with http:// or https://, got None"),
        (dict(name="remote", remote=RemoteRewardConfig(url="localhost:8000")), "got 'localhost:8000'"),
        (dict(scale=float("nan")), "scale (nan) must be a finite number"),
        (dict(clip_min=1.0, clip_max=0.0), "clip_min (1.0) is larger than clip_max (0.0)"),
        (dict(num_workers=-1), "num_workers (-1) must be >= 0"),
        (dict(timeout_s=0.0), "timeout_s (0.0) must be positive, or None"),
        (dict(num_workers=0), "timeout_s (60.0) needs worker threads, but num_workers is 0"),
        (dict(max_logged_errors=-1), "max_logged_errors (-1) must be >= 0"),
    ],
)
def test_reward_config_errors_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError) as e:
        RewardConfig(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MathRewardConfig(rel_tol=-0.1), "math.rel_tol (-0.1) must be in [0, 1)"),
        (lambda: ExactMatchRewardConfig(extract="first"), "exact_match.extract ('first') must be one of"),
        (lambda: RewardModelConfig(dtype="fp8"), "reward_model.dtype ('fp8') must be one of"),
        (lambda: RewardModelConfig(batch_size=0), "reward_model.batch_size (0) and max_length (4096) must be positive"),
        (lambda: RemoteRewardConfig(timeout_s=0), "remote.timeout_s (0) must be positive"),
        (lambda: RemoteRewardConfig(max_retries=-1), "remote.max_retries (-1) must be >= 0"),
        (
            lambda: RemoteRewardConfig(backoff_s=2.0, backoff_max_s=1.0),
            "need 0 <= remote.backoff_s (2.0) <= remote.backoff_max_s (1.0)",
        ),
    ],
)
def test_sub_config_errors(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


def test_reward_config_as_omegaconf_structured_config():
    merged = OmegaConf.merge(
        OmegaConf.structured(RewardConfig),
        OmegaConf.from_dotlist(
            ["name=remote", "remote.url=http://127.0.0.1:9000/score", "remote.headers.X-Key=abc", "timeout_s=null"]
        ),
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg.remote, RemoteRewardConfig) and cfg.remote.headers == {"X-Key": "abc"}
    assert cfg.timeout_s is None and cfg.name == "remote"
