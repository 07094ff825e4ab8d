"""Transformer layer specs: Megatron's local modules with torch SDPA core attention, or Transformer Engine.

A config with num_moe_experts gets Megatron's MoE layer as the MLP (router, token dispatcher, experts): with the
local spec its experts are a SequentialMLP of ColumnParallelLinear / RowParallelLinear; with the TE spec a
TEGroupedMLP when config.moe_grouped_gemm, else a SequentialMLP of TE linears (models/moe.py)."""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from mcore_rl.models.attention import SDPAttention


class TorchNorm:
    """Megatron's WrappedTorchNorm (torch's RMSNorm / LayerNorm, the local spec's norm without apex), also under
    sequence parallelism, which WrappedTorchNorm refuses. A norm works token by token, so a rank normalises the
    tokens of its sequence shard with no communication; its weight is replicated over TP while each rank sees other
    tokens, so it is marked `sequence_parallel` and Megatron's finalize_model_grads sums its gradient over the TP
    group, as it does for Transformer Engine's and apex's norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma, persistent and memory-efficient layer norms need Transformer "
                             "Engine or apex: set model.attention=te")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r}: only LayerNorm and RMSNorm are supported")
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def local_norm():
    """The norm class the local spec uses for the decoder's final norm: ours where Megatron would take
    WrappedTorchNorm (no apex), else Megatron's own (apex's FusedLayerNorm handles sequence parallelism)."""
    from megatron.core.transformer import transformer_block

    return TorchNorm if transformer_block.LayerNormImpl is WrappedTorchNorm else transformer_block.LayerNormImpl


def _swap_norms(spec) -> None:
    """Replace WrappedTorchNorm by TorchNorm in a layer spec's submodules, nested specs included."""
    subs = getattr(spec, "submodules", None)
    if subs is None:
        return
    for name, value in vars(subs).items():
        if value is WrappedTorchNorm:
            setattr(subs, name, TorchNorm)
        elif isinstance(value, ModuleSpec):
            _swap_norms(value)


def layer_spec(config, use_te: bool, sliding_window: int | None = None, packed_impl: str = "auto") -> ModuleSpec:
    """sliding_window (None = full causal) and packed_impl (ModelConfig.packed_attention) go to SDPA core
    attention; the Transformer Engine spec takes neither."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SDPAttention, params={"sliding_window": sliding_window, "packed_impl": packed_impl})
    _swap_norms(spec)
    return spec


def block_spec(config, spec: ModuleSpec, use_te: bool, vp_stage: int | None):
    """What GPTModel takes as its layer spec: the layer spec itself with Transformer Engine (the block's final norm
    is then TE's), else the block's submodules with the local spec's final norm (local_norm)."""
    if use_te:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=local_norm())
