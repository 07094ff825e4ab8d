"""Transformer layer specs: Megatron's local modules with torch SDPA core attention, or Transformer Engine.

A config with num_moe_experts gets Megatron's MoE layer as the MLP (router, token dispatcher, experts): with the
local spec its experts are a SequentialMLP of ColumnParallelLinear / RowParallelLinear; with the TE spec a
TEGroupedMLP when config.moe_grouped_gemm, else a SequentialMLP of TE linears (models/moe.py)."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_rl.models.attention import SDPAttention


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
    return spec
