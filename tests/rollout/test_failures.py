"""Engines that cannot start, start too slowly, or die mid-rollout: each must raise RolloutEngineError that says
what failed and what to change, promptly, never hang, and leave no processes behind."""

from __future__ import annotations

import json
import os
import signal
import threading

import psutil
import pytest

from conftest import cpu_config
from mcore_rl.rollout import RolloutEngine, RolloutEngineError


def our_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory) -> str:
    """config.json of a real architecture and a corrupt safetensors file: passes our checks, fails inside SGLang
    (a folder with no weights at all would make SGLang look for them on the HF Hub first)."""
    path = tmp_path_factory.mktemp("broken")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 512, "torch_dtype": "float32"}))
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    return str(path)


@pytest.mark.parametrize("mode", ["engine", "server"])
def test_missing_model_path(tmp_path, mode):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(RolloutEngineError, match=r"model_path .*no_such_model' is not an HF checkpoint folder .*"
                                                 r"Set rollout.model_path"):
        RolloutEngine(cpu_config(mode=mode), model_path=missing)


def test_no_model_path_at_all():
    with pytest.raises(ValueError, match="set rollout.model_path or pass model_path="):
        RolloutEngine(cpu_config(mode="engine"))


def test_broken_checkpoint_engine(broken_checkpoint):
    before = our_children()
    with pytest.raises(RolloutEngineError, match=r"SGLang engine failed to start for model_path=.*Check that "
                                                 r"rollout.model_path"):
        RolloutEngine(cpu_config(mode="engine"), model_path=broken_checkpoint)
    assert not {pid for pid in our_children() - before if alive(pid)}


def test_server_that_exits_during_startup(tmp_path):
    """An unreadable config.json: the launched server exits before its scheduler starts."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RolloutEngineError, match=r"(?s)failed to start the SGLang server .* exited with code .*"
                                                 r"Check rollout.model_path.*last lines of .*sglang_server_"):
        RolloutEngine(cpu_config(mode="server"), model_path=str(tmp_path))


@pytest.mark.parametrize("mode", ["engine", "server"])
def test_startup_timeout_kills_what_was_started(models, mode):
    before = our_children()
    with pytest.raises(RolloutEngineError, match=r"within 1 s \(rollout.startup_timeout_s\)"):
        RolloutEngine(cpu_config(mode=mode, startup_timeout_s=1.0), model_path=models["m0"])
    assert not {pid for pid in our_children() - before if alive(pid)}


def long_generation(engine):
    """Far more work than fits in the second before the kill: 128 samples of 480 tokens."""
    sampling = engine.default_sampling(temperature=1.0, max_new_tokens=480, ignore_eos=True)
    return engine.generate([[5, 6, 7]], n=128, sampling=sampling)


def test_server_killed_mid_rollout(models):
    engine = RolloutEngine(cpu_config(mode="server", request_batch_size=16), model_path=models["m0"])
    pid = engine.backend.pid
    try:
        threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL)).start()
        with pytest.raises(RolloutEngineError, match=rf"(?s)SGLang server.*\(pid {pid}\) exited with code -9"):
            long_generation(engine)
        assert not engine.alive
        with pytest.raises(RolloutEngineError, match="SGLang server is not usable .* cannot generate"):
            engine.generate([[1, 2, 3]])
    finally:
        engine.shutdown()
    assert not alive(pid)


def test_engine_child_killed_mid_rollout(models):
    """In-process engine: SGLang's own reaction (SIGQUIT to this process, which kills it) must be contained."""
    engine = RolloutEngine(cpu_config(mode="engine", request_batch_size=16), model_path=models["m0"])
    children = list(engine.backend._child_pids)
    scheduler = children[0]
    try:
        threading.Timer(1.0, os.kill, args=(scheduler, signal.SIGKILL)).start()
        with pytest.raises(RolloutEngineError, match=r"SGLang engine died during generate: .*"):
            long_generation(engine)
        assert not engine.alive
        with pytest.raises(RolloutEngineError, match="SGLang engine is not usable .* cannot generate"):
            engine.generate([[1, 2, 3]])
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in children)


def test_attach_to_nothing_times_out():
    from mcore_rl.net import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutEngineError, match=rf"failed to attach to the SGLang server at {url} within 1 s "
                                                 r"\(rollout.startup_timeout_s\); last health check: ConnectionError"):
        RolloutEngine(cpu_config(mode="server", server_url=url, startup_timeout_s=1.0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "generate\\(\\) got no prompts"),
    (dict(prompts=[[1], []]), "prompt 1 must be a non-empty list of token ids"),
    (dict(prompts=["text"]), "prompt 0 must be a non-empty list of token ids"),
    (dict(n=0), "n \\(samples per prompt\\) must be >= 1"),
    (dict(metas=[{}, {}]), "metas has 2 entries for 1 prompts"),
])
def test_generate_arguments_are_checked(kwargs, message):
    from mcore_rl.rollout.engine import SamplingParams, _check_generate_args

    args = dict(prompts=[[1, 2]], n=1, sampling=SamplingParams(), metas=None, prompt_texts=None,
                skip_tokenizer_init=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        _check_generate_args(**args)
