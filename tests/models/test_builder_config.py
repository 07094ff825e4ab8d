"""HF config -> TransformerConfig: the fields the engine relies on, and the builder's user-facing errors."""

import pytest
import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.models.builder import padded_vocab_size, rope_kwargs, sliding_window, transformer_config


def hf(arch="qwen2", **overrides):
    base = {
        "architectures": {"qwen2": ["Qwen2ForCausalLM"], "llama": ["LlamaForCausalLM"],
                          "qwen3": ["Qwen3ForCausalLM"], "mistral": ["MistralForCausalLM"]}[arch],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    }
    base.update(overrides)
    return base


def test_fields_from_hf_config():
    cfg = transformer_config(hf(), ModelConfig(dtype="fp32"), ParallelConfig(tp=2))
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 128)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.add_qkv_bias and not cfg.qk_layernorm and cfg.gated_linear_unit
    assert cfg.params_dtype == torch.float32 and not cfg.bf16
    assert cfg.variable_seq_lengths  # the pipeline exchanges shapes: micro batches differ in length
    assert transformer_config(hf("llama"), ModelConfig(), ParallelConfig()).add_qkv_bias is False
    q3 = transformer_config(hf("qwen3", head_dim=32), ModelConfig(dtype="bf16"), ParallelConfig())
    assert q3.qk_layernorm and q3.kv_channels == 32 and q3.bf16 and q3.params_dtype == torch.bfloat16


@pytest.mark.parametrize("recompute, expected", [
    ("none", (None, None)), ("selective", ("selective", None)), ("full", ("full", "uniform")),
])
def test_recompute_settings(recompute, expected):
    cfg = transformer_config(hf(), ModelConfig(recompute=recompute), ParallelConfig())
    assert (cfg.recompute_granularity, cfg.recompute_method) == expected


def test_padded_vocab_size():
    assert padded_vocab_size(512, 1) == 512 and padded_vocab_size(515, 2) == 516 and padded_vocab_size(9, 4) == 12


def test_rope_scaling():
    assert rope_kwargs({"rope_theta": 5e5}) == {"rotary_base": 5e5}
    assert rope_kwargs({"rope_scaling": {"type": "linear", "factor": 2.0}})["seq_len_interpolation_factor"] == 2.0
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported; supported: default, linear"):
        rope_kwargs({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported \(only silu\)"),
    (dict(num_attention_heads=6, num_key_value_heads=6),
     r"num_attention_heads \(6\) is not divisible by parallel.tp \(4\)"),
    (dict(architectures=["GPT2LMHeadModel"]), r"unsupported architecture \(architectures=\['GPT2LMHeadModel'\]"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        transformer_config(hf(**overrides), ModelConfig(), ParallelConfig(tp=4 if "num_attention_heads" in overrides
                                                                          else 1))


@pytest.mark.parametrize("setting,expected", [("on", True), ("off", False),
                                              ("auto", torch.cuda.is_available())])
def test_fused_swiglu_setting(setting, expected):
    cfg = transformer_config(hf(), ModelConfig(fused_swiglu=setting), ParallelConfig())
    assert cfg.bias_activation_fusion is expected and cfg.gated_linear_unit


def test_fused_swiglu_value_is_checked():
    with pytest.raises(ValueError, match="model.fused_swiglu must be one of"):
        ModelConfig(fused_swiglu="yes")


@pytest.mark.parametrize("kwargs,message", [
    (dict(compile_rope="yes"), r"model.compile_rope must be one of \('off', 'on', 'auto'\), got 'yes'"),
    (dict(packed_rope=False, compile_rope="on"),
     "model.compile_rope=on compiles the packed RoPE path, which model.packed_rope=false turns off"),
    (dict(packed_attention="flash"), r"model.packed_attention must be one of .*, got 'flash'"),
])
def test_kernel_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_sliding_window_only_for_mistral():
    assert sliding_window(hf("mistral", sliding_window=4)) == 4
    assert sliding_window(hf("mistral", sliding_window=4, use_sliding_window=False)) is None
    assert sliding_window(hf("llama")) is None


def test_auto_attention_takes_transformer_engine_only_for_what_needs_it(monkeypatch):
    """model.attention=auto on a GPU with TE installed: the local SDPA spec for a dense model (faster there), TE's
    spec for sequence parallelism and for MoE grouped GEMMs. (This machine has neither TE nor a GPU: both are
    stood in for here. The choice is what is tested; this project's TE spec has not run on a GPU yet.)"""
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.models import builder

    monkeypatch.setattr(builder, "te_available", lambda: True)
    monkeypatch.setattr(builder.torch.cuda, "is_available", lambda: True)
    auto = ModelConfig(path="x", attention="auto")
    assert builder.use_te(auto) is False
    assert builder.use_te(auto, sequence_parallel=True) is True
    assert builder.use_te(auto, moe=True) is True
    assert builder.use_te(ModelConfig(path="x", attention="sdpa"), sequence_parallel=True, moe=True) is False
    assert builder.use_te(ModelConfig(path="x", attention="te")) is True
    monkeypatch.setattr(builder, "te_available", lambda: False)
    assert builder.use_te(auto, sequence_parallel=True) is False
    with pytest.raises(ValueError, match="model.attention=te but transformer_engine is not importable"):
        builder.use_te(ModelConfig(path="x", attention="te"))
