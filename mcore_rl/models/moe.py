"""Mixture-of-experts settings: HF config (Qwen3-MoE, Mixtral) -> the MoE fields of Megatron's TransformerConfig.

Both architectures put a top-k MoE MLP in every decoder layer: router `mlp.gate` (a [E, h] matrix, no bias),
softmax over the E experts, top-k, SwiGLU experts. They differ only in how the k weights are normalised:

* Mixtral and Qwen3-MoE with norm_topk_prob=true renormalise the top-k softmax probabilities to sum to one, which
  is the softmax of the top-k logits: Megatron's router with moe_router_pre_softmax=False (top-k on the logits,
  then softmax over the k).
* Qwen3-MoE with norm_topk_prob=false keeps the top-k of the softmax over all experts: moe_router_pre_softmax=True.

Which code runs where (megatron-core 0.16.1):

* Experts: SequentialMLP (one MLP per local expert, plain matmuls; CPU and GPU) unless grouped GEMM is chosen
  (ModelConfig.moe_grouped_gemm), which needs Transformer Engine's TEGroupedMLP (GPU). Megatron's legacy
  GroupedMLP (the `grouped_gemm` package: CUDA only, bf16 only, all local experts fused into one weight) is not
  offered: its fused layout has no bridge mapping.
* Token dispatcher (ModelConfig.moe_token_dispatcher): alltoall by default, on gloo (CPU) and NCCL: each rank
  sends its routed tokens to the experts' ranks (torch.distributed.all_to_all_single, which gloo implements).
  allgather gathers every token on every expert rank; Megatron refuses it with variable_seq_lengths, which the
  pipeline needs, so it is only allowed at parallel.pp=1.
* Routing, the auxiliary losses and the permutation run in plain torch (the fused TE router and permutation
  kernels, moe_router_fusion / moe_permute_fusion, stay off).
* Without Transformer Engine, megatron-core 0.16.1's router fails with NameError 'te_general_gemm' (moe_utils
  imports it only when TE imports, yet reads it unconditionally): `define_missing_te_names` sets the names TE would
  have provided to None, which sends the router to its torch.mm path. On CPU and on GPUs without TE alike.
"""

from __future__ import annotations

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.models.arch import ArchSpec


# Names megatron.core.transformer.moe.moe_utils imports from Transformer Engine, and tests against None.
_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
             "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
             "fused_unpermute", "te_general_gemm")


def define_missing_te_names() -> list[str]:
    """Without Transformer Engine, define moe_utils' TE names as None (see the module docstring); returns those set.
    Idempotent; does nothing when TE imported."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in _TE_NAMES if not hasattr(moe_utils, n)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing


def num_experts(hf: dict) -> int:
    """Routed experts per MoE layer (Qwen3-MoE's config.json says num_experts, Mixtral's num_local_experts)."""
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not n:
        raise ValueError("config.json of a mixture-of-experts model has neither num_experts nor num_local_experts")
    return int(n)


def expert_ffn(hf: dict, arch: ArchSpec) -> int:
    """Intermediate size of one expert: Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size."""
    return int(hf["moe_intermediate_size"]) if arch.name == "qwen3_moe" else int(hf["intermediate_size"])


def refuse_unsupported(hf: dict, arch: ArchSpec) -> None:
    """MoE config switches the Megatron model cannot express, as ValueErrors that say what is supported."""
    if arch.name == "qwen3_moe":
        sparse_step = hf.get("decoder_sparse_step", 1)
        dense = hf.get("mlp_only_layers") or []
        if sparse_step != 1 or dense:
            raise ValueError(
                f"Qwen3MoeForCausalLM with dense MLP layers (decoder_sparse_step={sparse_step}, "
                f"mlp_only_layers={dense}) is not supported: only models whose every layer is a mixture of experts "
                "(decoder_sparse_step=1, mlp_only_layers=[]), as all released Qwen3-MoE checkpoints are"
            )
    if hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts"):
        raise ValueError(f"{arch.hf_class} with shared experts is not supported: routed experts only")
    if arch.name == "mixtral" and hf.get("router_jitter_noise"):
        raise ValueError(
            f"MixtralForCausalLM with router_jitter_noise={hf['router_jitter_noise']} is not supported (Megatron's "
            "input jitter differs from HF's); set router_jitter_noise to 0 in config.json"
        )


def validate_experts(hf: dict, parallel: ParallelConfig) -> None:
    """Expert parallelism against the number of experts (the world is checked by mcore_rl.parallel.validate)."""
    experts = num_experts(hf)
    top_k = hf.get("num_experts_per_tok", 2)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the number of experts ({experts})")
    if experts % parallel.ep:
        raise ValueError(
            f"the number of experts ({experts}) is not divisible by parallel.ep ({parallel.ep}); every "
            f"expert-parallel rank holds the same number of experts: use a parallel.ep that divides {experts}"
        )


def grouped_gemm(model_cfg: ModelConfig, te: bool) -> bool:
    """Whether the experts run as grouped GEMMs (TEGroupedMLP) rather than one after the other (SequentialMLP)."""
    if model_cfg.moe_grouped_gemm == "on" and not te:
        raise ValueError(
            "model.moe_grouped_gemm=on needs Transformer Engine's TEGroupedMLP (model.attention=te, or auto with "
            "transformer_engine installed on a GPU); use moe_grouped_gemm=auto or off for sequential experts"
        )
    return te and model_cfg.moe_grouped_gemm != "off"


def moe_fields(hf: dict, arch: ArchSpec, model_cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    """TransformerConfig keyword arguments of the MoE layers ({} for a dense architecture)."""
    if not arch.moe:
        if parallel.ep > 1:
            raise ValueError(f"parallel.ep ({parallel.ep}) > 1 needs a mixture-of-experts model; "
                             f"{arch.hf_class} is dense: set parallel.ep=1")
        return {}
    refuse_unsupported(hf, arch)
    validate_experts(hf, parallel)
    if parallel.tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"a mixture-of-experts model at parallel.tp ({parallel.tp}) > 1 needs parallel.sequence_parallel=true: "
            "Megatron refuses to train MoE layers with tensor parallelism but without sequence parallelism (which "
            "needs Transformer Engine norms, so GPUs only); split the experts with parallel.ep and parallel.etp and "
            "keep parallel.tp=1 otherwise"
        )
    if model_cfg.moe_token_dispatcher == "allgather" and parallel.pp > 1:
        raise ValueError(
            f"model.moe_token_dispatcher=allgather does not work with parallel.pp ({parallel.pp}) > 1: Megatron "
            "refuses it with the variable sequence lengths the pipeline exchanges; use alltoall"
        )
    # Qwen3-MoE: norm_topk_prob (false in its config class, true in every released checkpoint); Mixtral: always.
    renormalise = bool(hf.get("norm_topk_prob", False)) if arch.name == "qwen3_moe" else True
    return dict(
        num_moe_experts=num_experts(hf),
        moe_ffn_hidden_size=expert_ffn(hf, arch),
        moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalise,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=model_cfg.moe_z_loss_coeff or None,
        moe_token_dispatcher_type=model_cfg.moe_token_dispatcher,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp or parallel.tp,
    )
