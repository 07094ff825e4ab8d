"""RolloutConfig -> SGLang ServerArgs: the hardware-dependent defaults, and the same settings as
`python -m sglang.launch_server` command-line flags.
"""

from __future__ import annotations

from typing import Any, Sequence

from mcore_rl.config.rollout import DTYPES, RolloutConfig

# What SGLang needs on a machine without CUDA (each of the first five was needed on the CPU machines).
CPU_DEFAULTS = {
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
    "disable_cuda_graph": True,
    "disable_overlap_schedule": True,
    "sleep_on_idle": True,  # not needed to run, but an idle scheduler otherwise spins a core at 100%
}


def resolve_device(cfg: RolloutConfig) -> str:
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def deterministic(cfg: RolloutConfig, device: str) -> bool:
    """rollout.deterministic resolved for `device`: None is on for CPU, off for GPU."""
    return device == "cpu" if cfg.deterministic is None else cfg.deterministic


def gpu_attention_backend(gpu: int = 0) -> str:
    """rollout.attention_backend=auto (or None) on a GPU: fa3 where sgl_kernel ships its FA3 kernels (the
    flash_ops library, which slimmed installs leave out) and the GPU is a Hopper (compute capability 9.x, what
    those kernels are built for), else triton."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability(gpu)[0] == 9):
        return "triton"
    loaded = sys.modules.get("sgl_kernel")  # imported already (find_spec refuses a module without __spec__)
    if loaded is not None:
        dirs = list(getattr(loaded, "__path__", None) or [])
    else:
        spec = importlib.util.find_spec("sgl_kernel")
        dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    return "fa3" if any(any(Path(d).glob("flash_ops*.so")) for d in dirs) else "triton"


def server_args(cfg: RolloutConfig, model_path: str, custom_weight_loaders: Sequence[str] = ()) -> dict[str, Any]:
    """ServerArgs fields for `cfg` (None-valued fields are left to SGLang). custom_weight_loaders: dotted names of
    loaders SGLang registers besides any in cfg.extra_args (RolloutEngine passes mcore_rl.weight_sync.loaders')."""
    device = resolve_device(cfg)
    args: dict[str, Any] = {
        "model_path": model_path,
        "skip_tokenizer_init": cfg.skip_tokenizer_init,
        "device": device,
        "dtype": DTYPES[cfg.dtype],
        "tp_size": cfg.tp_size,
        "base_gpu_id": cfg.base_gpu_id,
        "mem_fraction_static": cfg.mem_fraction_static,
        "max_total_tokens": cfg.max_total_tokens,
        "context_length": cfg.context_length,
        "enable_memory_saver": cfg.enable_memory_saver,
        "random_seed": cfg.random_seed,
        "enable_deterministic_inference": deterministic(cfg, device),
        "log_level": cfg.log_level or "warning",
    }
    for name, cpu_value in CPU_DEFAULTS.items():
        value = getattr(cfg, name)
        args[name] = cpu_value if value is None and device == "cpu" else value
    if cfg.attention_backend in (None, "auto"):
        args["attention_backend"] = "torch_native" if device == "cpu" else gpu_attention_backend(cfg.base_gpu_id)
    args.update(cfg.extra_args)
    if custom_weight_loaders:
        args["custom_weight_loader"] = [*(args.get("custom_weight_loader") or []), *custom_weight_loaders]
    return {k: v for k, v in args.items() if v is not None}


def to_cli(args: dict[str, Any]) -> list[str]:
    """ServerArgs fields -> launch_server flags (True -> bare flag, False omitted: all our booleans are
    store_true flags that default to False)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            continue
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
