"""Which HuggingFace architectures are supported, read from config.json (`architectures` / `model_type`).

The architecture is never guessed from a model's name or path: `resolve_arch` looks only at the config.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ArchSpec:
    name: str
    hf_class: str
    qkv_bias: bool  # attention q/k/v projections carry a bias
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)


ARCHS = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "mistral": ArchSpec("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
}
_BY_CLASS = {spec.hf_class: spec for spec in ARCHS.values()}


def supported() -> str:
    return ", ".join(f"{s.hf_class} (model_type {k!r})" for k, s in ARCHS.items())


def load_hf_config(hf_dir: str | os.PathLike) -> dict:
    """Read `config.json` of an HF checkpoint folder as a dict, with errors that say what to change."""
    path = Path(hf_dir)
    if not path.exists():
        raise FileNotFoundError(f"HF model folder {str(path)!r} does not exist; check model.path")
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}: model.path must be an HF checkpoint folder")
    with open(cfg_file) as f:
        return json.load(f)


def resolve_arch(hf_config: dict) -> ArchSpec:
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in _BY_CLASS:
            return _BY_CLASS[a]
    model_type = hf_config.get("model_type")
    if not archs and model_type in ARCHS:
        return ARCHS[model_type]
    raise ValueError(
        f"unsupported architecture (architectures={archs}, model_type={model_type!r}); "
        f"supported: {supported()}"
    )
