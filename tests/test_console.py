"""mcore_rl/console.py: logger.level's filters catch the libraries' warnings and records they name and nothing
of ours, a later level undoes an earlier one, and the config resolves SGLang's log level from it. The console of
a real run at both levels: tests/trainer/test_console_run.py."""

import logging
import sys
import warnings

import pytest

from mcore_rl import console


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv(console.ENV, raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    yield
    console.configure("verbose")  # undoes the filters; monkeypatch restores the environment


def shown(module: str, message: str, category=UserWarning) -> bool:
    """Whether the filters now in force let this warning through (no registry: not deduplicated)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(seen)


def test_info_hides_library_warnings_and_keeps_ours(clean):
    console.configure("info")
    assert not shown("megatron.core.optimizer", "Apex is not installed. Falling back to Torch Norm")
    assert not shown("sglang.srt.layers.quantization.awq", "Only CUDA, HIP and XPU support AWQ currently.")
    assert not shown("megatron.core.transformer.transformer_config", "full scope is deprecated", FutureWarning)
    assert not shown("flashinfer.jit.core", "a kernel note")
    assert not shown("torch.distributed.c10d_logger",
                     "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
    assert not shown("torch.distributed.c10d_logger", "barrier(): using the device under current context. You can "
                     "specify `device_id` in `init_process_group` to mute this warning.")
    # the narrow ones stay narrow: other torch warnings, ours, and a module merely named like a library
    assert shown("torch.distributed.c10d_logger", "something else is deprecated", FutureWarning)
    assert shown("torch.distributed.c10d_logger", "barrier() failed in some other way")
    assert shown("torch.nn.functional", "Mismatch dtype between input and weight")
    assert shown("mcore_rl.trainer.run", "a warning of ours")
    assert shown("megatron_extras", "not Megatron-Core")
    assert console.WARNOPTIONS[0] in sys.warnoptions  # reaches multiprocessing's resource tracker
    assert console.os.environ[console.ENV] == "info" and console.os.environ["TRANSFORMERS_VERBOSITY"] == "error"


def test_verbose_undoes_info(clean):
    console.configure("info")
    console.configure("verbose")
    assert shown("megatron.core.optimizer", "Apex is not installed. Falling back to Torch Norm")
    assert console.WARNOPTIONS[0] not in sys.warnoptions
    assert logging.getLogger("megatron").level == logging.NOTSET
    assert "TRANSFORMERS_VERBOSITY" not in console.os.environ


def test_info_quiets_megatron_records_and_sglangs_sigquit_note(clean, caplog):
    console.configure("info", sglang_level="error")
    caplog.set_level(logging.DEBUG)
    logging.getLogger("megatron.core.distributed.param_and_grad_buffer").info("Params for bucket 1")
    logging.getLogger("megatron.core.optimizer").warning("a real Megatron warning")
    engine = logging.getLogger("sglang.srt.entrypoints.engine")
    engine.error("Using custom SIGQUIT handler: <function _on_sigquit>")
    engine.error("Received sigquit from a child process. It usually means the child failed.")
    logging.getLogger("sglang.srt.server_args").warning("Cuda graph is disabled")
    texts = [r.getMessage() for r in caplog.records]
    assert texts == ["a real Megatron warning",
                     "Received sigquit from a child process. It usually means the child failed."]


def test_configure_from_env_follows_the_parent(clean, monkeypatch):
    console.configure_from_env()  # not a run's child: nothing
    assert shown("megatron.core.x", "Apex is not installed")
    monkeypatch.setenv(console.ENV, "info")
    console.configure_from_env()
    assert not shown("megatron.core.x", "Apex is not installed")


def test_level_is_checked_and_drives_sglangs_log_level():
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.root import RLConfig
    from mcore_rl.config.trainer import LoggerConfig

    with pytest.raises(ValueError, match=r"logger.level must be one of \('info', 'verbose'\), got 'debug'"):
        LoggerConfig(level="debug")
    with pytest.raises(ValueError, match="rollout.log_level must be one of .* or null, got 'loud'"):
        RolloutConfig(log_level="loud")
    assert RLConfig().rollout.log_level == "error"
    assert RLConfig(logger=LoggerConfig(level="verbose")).rollout.log_level == "info"
    assert RLConfig(rollout=RolloutConfig(log_level="warning")).rollout.log_level == "warning"
