"""HF config.json -> Megatron-Core TransformerConfig and GPTModel: the actor, the reference and the critic.

    hf = load_hf_config(path)
    actor = build_model(hf, ModelConfig(path=path), ParallelConfig(tp=2))
    critic = build_model(hf, model_cfg, parallel_cfg, value_head=True)

`build_model` returns a `BuiltModel`: `chunks`, one GPTModel per virtual pipeline stage held by this rank (a list
of one without virtual pipelining), with random weights (load real ones through mcore_rl.bridge); `info`, what the
engine and the bridge need to know about them (`ModelInfo`); and `logit_rows`, through which the engine tells the
output layer where to compute logits (models/lm_head.py). Parallel state must be initialised first
(mcore_rl.parallel.initialize).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.models import lm_head, moe, rope
from mcore_rl.models.arch import resolve_arch
from mcore_rl.models.specs import block_spec, layer_spec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and the bridge need to know about a built model, beyond its modules."""

    vocab_size: int
    """The checkpoint's vocabulary size. The output layer is padded to a multiple of parallel.tp; the engine masks
    the logits past this."""
    is_critic: bool = False
    """A critic: its output layer is a scalar value head (outputs "values"; no HF causal-LM counterpart)."""
    lm_head: str = "all"
    """Where the output layer runs: ModelConfig.lm_head, or "all" for a critic and with sequence parallelism
    (lm_head.effective_mode)."""


@dataclass
class BuiltModel:
    """build_model's result: this rank's chunks, the facts about them, and the output layer's row selection."""

    chunks: list[GPTModel]
    info: ModelInfo
    logit_rows: lm_head.LogitRows
    """Set by the engine around each forward call; read by the output layers' hooks (lm_head.install)."""
    router_hooks: moe.RouterHooks | None = None
    """Mixture-of-experts models: routing replay and router statistics, driven by the engine (models/moe.py)."""


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def use_te(model_cfg: ModelConfig, sequence_parallel: bool = False, moe: bool = False) -> bool:
    """Transformer Engine's layer spec or the local one. auto takes TE, where it is importable on a GPU, for what
    only it gives: sequence parallelism at TP > 1, and a mixture of experts' grouped GEMMs. Elsewhere the local
    spec with torch SDPA is the faster of the two (TE's attention was 1.8-2.2x slower than SDPA at 0.5B shapes on
    the H200, docs/performance.md)."""
    if model_cfg.attention == "te":
        if not te_available():
            raise ValueError("model.attention=te but transformer_engine is not importable; use auto or sdpa")
        return True
    return (model_cfg.attention == "auto" and (sequence_parallel or moe) and te_available()
            and torch.cuda.is_available())


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or the older rope_theta/rope_scaling."""
    params = hf.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        kind = params.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(params, rope_type=kind))
    scaling = hf.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return hf.get("rope_theta", 10000.0), scaling


def rope_kwargs(hf: dict) -> dict:
    """GPTModel keyword arguments for the checkpoint's rotary embedding; unsupported scalings are refused."""
    theta, scaling = _rope(hf)
    kwargs = {"rotary_base": theta}
    if scaling is None:
        return kwargs
    kind = scaling["rope_type"]
    if kind == "linear":
        kwargs["seq_len_interpolation_factor"] = float(scaling["factor"])
    elif kind == "llama3":
        # Megatron's llama3 scaling hard-codes low/high frequency factors 1 and 4 and 8192 original positions.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in expected.items():
            if float(scaling.get(key, want)) != want:
                raise ValueError(f"llama3 rope scaling with {key}={scaling[key]} is not supported (only {want})")
        kwargs["rope_scaling"] = True
        kwargs["rope_scaling_factor"] = float(scaling["factor"])
    else:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")
    return kwargs


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of tp holding the vocabulary; padded logits are masked out by the engine."""
    return -(-vocab_size // tp) * tp


def validate_layout(hf: dict, parallel: ParallelConfig) -> None:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    layers = hf["num_hidden_layers"]
    if heads % parallel.tp:
        raise ValueError(
            f"num_attention_heads ({heads}) is not divisible by parallel.tp ({parallel.tp}); "
            f"use a parallel.tp that divides {heads}"
        )
    if groups % parallel.tp:
        raise ValueError(
            f"num_key_value_heads / query groups ({groups}) is not divisible by parallel.tp ({parallel.tp}); "
            f"each tensor-parallel rank needs whole query groups: use a parallel.tp that divides {groups}"
        )
    stages = parallel.pp * (parallel.vpp or 1)
    if layers % stages:
        what = "parallel.pp x parallel.vpp" if parallel.vpp else "parallel.pp"
        raise ValueError(
            f"num_hidden_layers ({layers}) is not divisible by parallel.pp ({parallel.pp})"
            + (f" x parallel.vpp ({parallel.vpp}) = {stages}" if parallel.vpp else "")
            + f"; every pipeline stage holds the same number of layers: choose {what} dividing {layers}"
        )
    if hf.get("num_experts") or hf.get("num_local_experts"):
        moe.validate_experts(hf, parallel)


def _refuse_unmapped_features(hf: dict, arch) -> None:
    """Config switches the Megatron model below cannot express: refused rather than silently ignored."""
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported: this Megatron model has no MLP biases")
    if hf.get("attention_bias") and not arch.qkv_bias:
        raise ValueError(
            f"attention_bias=True is not supported for {arch.hf_class}: it also puts a bias on o_proj, which this "
            "Megatron model (add_bias_linear=False) has no place for"
        )
    sliding = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
    if arch.name in ("qwen2", "qwen3", "qwen3_moe") and sliding:
        layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", layers) else "full_attention"
            for i in range(layers)]
        if "sliding_attention" in kinds:
            raise ValueError(
                f"{arch.hf_class} with use_sliding_window=True (sliding window on some layers) is not supported; "
                "set use_sliding_window=false in config.json if sequences never exceed sliding_window"
            )


def transformer_config(hf: dict, model_cfg: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    arch = resolve_arch(hf)
    validate_layout(hf, parallel)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
    _refuse_unmapped_features(hf, arch)
    dtype = TORCH_DTYPES[model_cfg.dtype]
    heads = hf["num_attention_heads"]
    recompute = {}
    if model_cfg.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif model_cfg.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=model_cfg.recompute_num_layers)
    sp = parallel.sequence_parallel and parallel.tp > 1
    moe_kwargs = moe.moe_fields(hf, arch, model_cfg, parallel)
    # The pipeline exchanges shapes because micro batches differ in length; Megatron's allgather token dispatcher
    # refuses variable lengths, and moe_fields allows it only without a pipeline, where nothing is exchanged.
    variable_lengths = moe_kwargs.get("moe_token_dispatcher_type", "alltoall") != "allgather"
    moe_kwargs.setdefault("moe_token_dispatcher_type", "alltoall")  # unused without MoE
    cfg = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias or bool(hf.get("attention_bias", False)),
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        sequence_parallel=sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model_cfg.dtype == "bf16",
        fp16=model_cfg.dtype == "fp16",
        # Weights are replaced by real checkpoints; CPU init keeps random init identical across layouts.
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        init_method_std=hf.get("initializer_range", 0.02),
        variable_seq_lengths=variable_lengths,
        moe_grouped_gemm=arch.moe and moe.grouped_gemm(model_cfg, use_te(model_cfg, sp, moe=True)),
        **moe_kwargs,
        masked_softmax_fusion=False,
        bias_activation_fusion=model_cfg.fused_swiglu == "on" or (model_cfg.fused_swiglu == "auto"
                                                                  and torch.cuda.is_available()),
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        **recompute,
    )
    return cfg


def sliding_window(hf: dict) -> int | None:
    """The attention window of every layer (Mistral), or None for full causal attention. Qwen's per-layer
    windows are refused by transformer_config."""
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) and resolve_arch(hf).name in ("mistral",
                                                                                              "mixtral"):
        return int(window)
    return None


class ValueHead(torch.nn.Module):
    """Scalar head of the critic: replaces the LM output layer, replicated across tensor-parallel ranks.

    Called like Megatron's output layer: `head(hidden [s, b, h], weight=None, ...) -> ([s, b, 1], None)`.
    With sequence parallelism each TP rank sees a slice of the sequence, so its gradient is marked for the
    TP all-reduce Megatron applies to sequence-parallel parameters.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, std: float, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        with torch.no_grad():
            if std > 0:
                self.weight.normal_(0.0, std)
            else:
                self.weight.zero_()
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        return F.linear(hidden, self.weight, self.bias), None


def _norms_in_model_dtype(model, dtype: torch.dtype) -> None:
    """Megatron's local spec builds torch.nn.RMSNorm, which ignores params_dtype: its weights would stay fp32 in a
    bf16 model. The HF model and the rollout engine keep them in the model dtype, and with a bf16 input and fp32
    weights torch falls back from its fused RMSNorm kernel to the unfused composite on GPUs. The fp32 master copy
    is the optimizer's, as for every other bf16 parameter."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)


def build_model(
    hf: dict,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    value_head: bool = False,
) -> BuiltModel:
    """This rank's GPTModel chunks (one per virtual pipeline stage), on the current device, and their ModelInfo."""
    cfg = transformer_config(hf, model_cfg, parallel)
    if cfg.num_moe_experts:
        moe.define_missing_te_names()
    if value_head:  # the critic is another network: the policy's routes are not its routing decisions
        cfg.moe_enable_routing_replay = False
    te = use_te(model_cfg, cfg.sequence_parallel, moe=bool(cfg.num_moe_experts))
    spec = layer_spec(cfg, te, sliding_window(hf), model_cfg.packed_attention)  # MoE: from cfg
    # packed micro batches: RoPE in one call per layer, no host sync (models/rope.py)
    rope.install(model_cfg.packed_rope, model_cfg.compile_rope)
    info = ModelInfo(vocab_size=hf["vocab_size"], is_critic=value_head,
                     lm_head=lm_head.effective_mode(model_cfg.lm_head, is_critic=value_head,
                                                    sequence_parallel=cfg.sequence_parallel))
    logit_rows = lm_head.LogitRows()
    tied = bool(hf.get("tie_word_embeddings", False)) and not value_head
    vocab = padded_vocab_size(hf["vocab_size"], parallel.tp)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    chunks = []
    for vp in range(parallel.vpp or 1):
        vp_stage = vp if parallel.vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=block_spec(cfg, spec, te, vp_stage),
            vocab_size=vocab,
            max_sequence_length=max(model_cfg.max_seq_len, hf.get("max_position_embeddings", 0)),
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            vp_stage=vp_stage,
            **rope_kwargs(hf),
        )
        if value_head and post:
            model.output_layer = ValueHead(
                hf["hidden_size"], cfg.params_dtype, model_cfg.critic_value_head_std, cfg.sequence_parallel
            )
        _norms_in_model_dtype(model, cfg.params_dtype)
        model.to(device)
        if lm_head.selects_rows(model, info.lm_head):
            lm_head.install(model, logit_rows)
        chunks.append(model)
    hooks = moe.RouterHooks(chunks, cfg) if cfg.num_moe_experts else None
    return BuiltModel(chunks, info, logit_rows, hooks)
