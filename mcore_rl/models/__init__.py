"""Megatron-Core models built from HF configs (see builder.py)."""

from mcore_rl.models.arch import ARCHS, load_hf_config, resolve_arch
from mcore_rl.models.builder import (BuiltModel, ModelInfo, ValueHead, build_model, padded_vocab_size,
                                     transformer_config)

__all__ = ["ARCHS", "BuiltModel", "ModelInfo", "ValueHead", "build_model", "load_hf_config", "padded_vocab_size",
           "resolve_arch", "transformer_config"]
