"""The engine sync layout's bridge side: SGLang names and shapes per bridge entry, and which checkpoints it cannot
take. The layout choice: tests/weight_sync/test_plan.py; the name check: tests/weight_sync/test_loaders.py; the
engine parity itself: tests/weight_sync/test_sync_layout.py.
"""

from __future__ import annotations

from mcore_rl.bridge.engine_layout import engine_tensors, unsupported_reason
from mcore_rl.bridge.maps import Dims, expand


def _hf(arch: str = "qwen2", tied: bool = False, vocab: int = 500, **extra) -> dict:
    model_type, cls = {"qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                       "llama": ("llama", "LlamaForCausalLM")}[arch]
    return {"architectures": [cls], "model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
            "num_hidden_layers": 2, "tie_word_embeddings": tied, **extra}


def _engine_table(hf: dict) -> dict[str, tuple[int, ...]]:
    dims = Dims.from_hf(hf)
    return dict(t for e in expand(hf) if e.export for t in engine_tensors(e, dims))


def test_qwen2_untied_engine_names_and_shapes():
    # Worked out from SGLang 0.5.17 models/qwen2.py: q 4 heads x 16 = 64 rows, k and v 2 x 16 = 32 rows each;
    # gate and up 96 rows each; vocab 500 padded to 512 (multiple of 64).
    table = _engine_table(_hf())
    assert table["model.embed_tokens.weight"] == (512, 64)
    assert table["lm_head.weight"] == (512, 64)
    assert table["model.layers.1.self_attn.qkv_proj.weight"] == (128, 64)
    assert table["model.layers.1.self_attn.qkv_proj.bias"] == (128,)
    assert table["model.layers.1.mlp.gate_up_proj.weight"] == (192, 64)
    assert table["model.layers.1.self_attn.o_proj.weight"] == (64, 64)
    assert table["model.layers.1.mlp.down_proj.weight"] == (64, 96)
    assert table["model.layers.1.input_layernorm.weight"] == (64,)
    assert table["model.norm.weight"] == (64,)
    assert not any(k in n for n in table for k in (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj."))
    assert len(table) == 2 + 2 * 7 + 1  # embed, lm_head; per layer 2 norms, qkv w+b, o, gate_up, down; norm


def test_tied_sends_no_lm_head_and_qwen3_keeps_qk_norms():
    tied = _engine_table(_hf(tied=True))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"] == (512, 64)
    q3 = _engine_table(_hf("qwen3", vocab=512))
    assert q3["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert q3["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert "model.layers.0.self_attn.qkv_proj.bias" not in q3  # qwen3 and llama: no q/k/v bias
    assert q3["model.embed_tokens.weight"] == (512, 64)  # already a multiple of 64: no padding


def test_unsupported_reasons():
    assert unsupported_reason(_hf()) is None
    assert "quantized (quantization_config.quant_method='gptq')" in unsupported_reason(
        _hf(quantization_config={"quant_method": "gptq"}))
    assert "unsupported architecture" in unsupported_reason({"architectures": ["GPT2LMHeadModel"]})
