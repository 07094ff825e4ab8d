"""RolloutConfig validation messages, the conf/rollout group files, and the ServerArgs they turn into."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.rollout.settings import server_args, to_cli

CONF = Path(__file__).resolve().parents[2] / "conf" / "rollout"


@pytest.mark.parametrize("name", ["cpu", "gpu", "server"])
def test_group_files_mirror_the_dataclass(name):
    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONF / f"{name}.yaml")
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(RolloutConfig)}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RolloutConfig), raw))
    assert isinstance(cfg, RolloutConfig)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="vllm"), "rollout.mode must be one of"),
    (dict(mode="engine", server_url="http://h:1"), "needs rollout.mode=server"),
    (dict(dtype="int8"), "rollout.dtype must be one of"),
    (dict(port=70000), "rollout.port must be in 1..65535 or null"),
    (dict(request_timeout_s=0), "rollout.request_timeout_s must be > 0"),
    (dict(request_batch_size=0), "rollout.request_batch_size must be >= 1"),
    (dict(top_k=0), "rollout.top_k must be -1 \\(off\\) or >= 1"),
    (dict(stop="</answer>", skip_tokenizer_init=False), "write stop=\\['</answer>'\\]"),
    (dict(stop=["</answer>"]), "set rollout.skip_tokenizer_init=false, or use rollout.stop_token_ids"),
    (dict(extra_args={"port": 1}), "must not set \\['port'\\]"),
])
def test_invalid_values_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_cpu_settings_are_filled_in_without_cuda():
    args = server_args(RolloutConfig(device="cpu", attention_backend=None), "/m")
    assert args["attention_backend"] == "torch_native" and args["disable_cuda_graph"] is True
    assert args["sampling_backend"] == "pytorch" and args["grammar_backend"] == "none"
    gpu_cfg = RolloutConfig(device="cuda", attention_backend="triton", extra_args={"cuda_graph_max_bs": 8})
    gpu = server_args(gpu_cfg, "/m")
    assert gpu["attention_backend"] == "triton" and "disable_cuda_graph" not in gpu and gpu["cuda_graph_max_bs"] == 8


def test_auto_attention_backend():
    """auto (and None) is torch_native on CPU; on a GPU fa3 only where sgl_kernel has its FA3 kernels and the GPU
    is a Hopper: this machine has no GPU, so a CUDA config resolves to triton here. On the H100 run of
    2026-12-05, with the slimmed sgl_kernel (no FA3 kernels), auto took triton; the fa3 branch has not run yet."""
    assert server_args(RolloutConfig(device="cpu", attention_backend="auto"), "/m")["attention_backend"] == \
        "torch_native"
    for backend in ("auto", None):
        assert server_args(RolloutConfig(device="cuda", attention_backend=backend), "/m")["attention_backend"] == \
            "triton"


def test_cli_flags():
    flags = to_cli({"model_path": "/m", "disable_cuda_graph": True, "enable_memory_saver": False, "tp_size": 2})
    assert flags == ["--model-path", "/m", "--disable-cuda-graph", "--tp-size", "2"]
