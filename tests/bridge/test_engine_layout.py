"""The engine sync layout's bridge side: SGLang names and shapes per bridge entry, and which checkpoints it cannot
take. The layout choice: tests/weight_sync/test_plan.py; the name check: tests/weight_sync/test_loaders.py; the
engine parity itself: tests/weight_sync/test_sync_layout.py (dense), test_moe_sync.py (MoE); the MoE table against a
live engine's parameters: tests/rollout/test_moe_rollout.py.
"""

from __future__ import annotations

from mcore_rl.bridge.engine_layout import engine_tensors, unsupported_reason
from mcore_rl.bridge.maps import Dims, Kind, expand

MOE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 500, "num_experts_per_tok": 2}
QWEN3_MOE = dict(MOE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16, num_experts=4,
                 moe_intermediate_size=32)
MIXTRAL = dict(MOE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4)


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


def test_qwen3_moe_experts_are_slices_of_the_stacked_engine_parameters():
    # SGLang 0.5.17 FusedMoE (quantization/unquant.py create_weights, at TP=1): w13_weight [E, 2I, H] with expert
    # e = rows [gate_e; up_e], w2_weight [E, H, I]. One bridge entry per expert matrix -> one slice; I = 32 here.
    dims = Dims.from_hf(QWEN3_MOE)
    entries = [e for e in expand(QWEN3_MOE) if e.layer == 1 and e.expert == 3]
    assert [e.kind for e in entries] == [Kind.GATE_UP, Kind.ROW]
    assert engine_tensors(entries[0], dims) == [("model.layers.1.mlp.experts.w13_weight[3]", (64, 64))]
    assert engine_tensors(entries[1], dims) == [("model.layers.1.mlp.experts.w2_weight[3]", (64, 32))]
    table = _engine_table(QWEN3_MOE)
    assert table["model.layers.0.mlp.gate.weight"] == (4, 64)  # the router keeps its HF name
    assert table["model.layers.0.self_attn.qkv_proj.weight"] == (128, 64)
    assert {n for n in table if ".experts." in n} == {f"model.layers.{i}.mlp.experts.{w}[{e}]" for i in range(2)
                                                       for w in ("w13_weight", "w2_weight") for e in range(4)}
    assert not any(k in n for n in table for k in (".gate_proj.", ".up_proj.", ".down_proj.", "gate_up_proj"))
    # per layer: 2 norms, 2 q/k norms, qkv, o, router, 4 w13 and 4 w2 slices; embed, norm, lm_head
    assert len(table) == 2 * 15 + 3 and table["lm_head.weight"] == (512, 64)


def test_mixtral_experts_under_block_sparse_moe():
    dims = Dims.from_hf(MIXTRAL)
    table = _engine_table(MIXTRAL)
    assert table["model.layers.1.block_sparse_moe.experts.w13_weight[0]"] == (256, 64)  # [w1; w3], I = 128
    assert table["model.layers.1.block_sparse_moe.experts.w2_weight[0]"] == (64, 128)
    assert table["model.layers.1.block_sparse_moe.gate.weight"] == (4, 64)
    assert not any(".w1." in n or ".w3." in n or ".experts.0." in n for n in table)
    fc1 = next(e for e in expand(MIXTRAL) if e.expert == 2 and e.kind == Kind.GATE_UP)
    # the engine slice's rows are the entry's HF tensors in order: gate (w1), then up (w3)
    assert fc1.hf == ("model.layers.0.block_sparse_moe.experts.2.w1.weight",
                      "model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert engine_tensors(fc1, dims)[0][1][0] == sum(s[0] for s in fc1.hf_shapes(dims))


def test_unsupported_reasons():
    assert unsupported_reason(_hf()) is None
    assert unsupported_reason(QWEN3_MOE) is None and unsupported_reason(MIXTRAL) is None
    assert "quantized" in unsupported_reason(dict(MIXTRAL, quantization_config={"quant_method": "fp8"}))
    shared_experts = unsupported_reason({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"})
    assert "shared experts" in shared_experts
    assert "quantized (quantization_config.quant_method='gptq')" in unsupported_reason(
        _hf(quantization_config={"quant_method": "gptq"}))
    assert "unsupported architecture" in unsupported_reason({"architectures": ["GPT2LMHeadModel"]})
