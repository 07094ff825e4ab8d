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
    moe: bool = False  # mixture-of-experts MLP in every decoder layer (models/moe.py)


ARCHS = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "mistral": ArchSpec("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "qwen3_moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True, moe=True),
    "mixtral": ArchSpec("mixtral", "MixtralForCausalLM", qkv_bias=False, qk_norm=False, moe=True),
}
_BY_CLASS = {spec.hf_class: spec for spec in ARCHS.values()}

# Mixture-of-experts architectures that are recognised but not supported, and why (docs/moe.md).
UNSUPPORTED_MOE = {
    "Qwen2MoeForCausalLM": "shared experts (shared_expert, shared_expert_gate)",
    "DeepseekV2ForCausalLM": "shared experts and multi-latent attention",
    "DeepseekV3ForCausalLM": "shared experts, multi-latent attention and sigmoid routing with expert bias",
    "OlmoeForCausalLM": "q/k norms over all heads",
    "GptOssForCausalLM": "expert biases, attention sinks and a clamped SwiGLU",
}
_UNSUPPORTED_TYPES = {"qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                      "deepseek_v3": "DeepseekV3ForCausalLM", "olmoe": "OlmoeForCausalLM",
                      "gpt_oss": "GptOssForCausalLM"}


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
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = "" if path.is_dir() else "; model.path must be an HF checkpoint folder, not a file"
        raise ValueError(f"{str(cfg_file)!r} is not a JSON config ({type(e).__name__}: {e}){what}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(cfg_file)!r} holds a {type(cfg).__name__}, not a JSON object: it is not an HF config")
    return cfg


def resolve_arch(hf_config: dict) -> ArchSpec:
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in _BY_CLASS:
            return _BY_CLASS[a]
    model_type = hf_config.get("model_type")
    if not archs and model_type in ARCHS:
        return ARCHS[model_type]
    for a in list(archs) + [_UNSUPPORTED_TYPES.get(model_type)]:
        if a in UNSUPPORTED_MOE:
            raise ValueError(
                f"{a} is a mixture-of-experts architecture this project does not support: its {UNSUPPORTED_MOE[a]} "
                "have no mapping yet; supported mixture-of-experts architectures: "
                + ", ".join(s.hf_class for s in ARCHS.values() if s.moe) + f" (all supported: {supported()})"
            )
    raise ValueError(
        f"unsupported architecture (architectures={archs}, model_type={model_type!r}); "
        f"supported: {supported()}"
    )
