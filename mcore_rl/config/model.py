"""Model: which HF checkpoint, precision, attention implementation and activation recompute."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("auto", "sdpa", "te", "local")
FUSED_SWIGLU = ("auto", "on", "off")
LM_HEAD = ("loss_tokens", "all")


@dataclass
class ModelConfig:
    path: str = ""
    """HF checkpoint folder (config.json + safetensors + tokenizer). Its config picks the architecture."""
    dtype: str = "bf16"
    """Compute dtype of the weights: bf16 / fp16 keep fp32 master weights in the optimizer; fp32 is exact."""
    attention: str = "auto"
    """auto: Transformer Engine when importable, else torch SDPA. sdpa / te / local force one."""
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
        if self.recompute_num_layers < 1:
            raise ValueError(f"model.recompute_num_layers must be >= 1, got {self.recompute_num_layers}")
