"""Pure parts of the bridge: architecture maps, TP split / merge, bucket and shard planning. No processes."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.bridge.export import PlanItem, plan_buckets
from mcore_rl.bridge.hf_io import parse_size, plan_shards
from mcore_rl.bridge.maps import ARCH_MAPS, Dims, Kind, Where, arch_map, expand, expected_hf_tensors, resolve_name
from mcore_rl.bridge.transforms import from_shards, padded_vocab, shard_shape, to_shard
from mcore_rl.models.arch import ARCHS


def hf_config(arch="llama", tied=False, **kw):
    cls = ARCHS[arch].hf_class
    cfg = dict(architectures=[cls], model_type=arch, hidden_size=8, intermediate_size=12, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=10, tie_word_embeddings=tied)
    if ARCHS[arch].moe:  # mixture of experts: Qwen3-MoE's and Mixtral's names for the expert count and size
        cfg.update(num_experts=4, num_local_experts=4, moe_intermediate_size=6, num_experts_per_tok=2)
    cfg.update(kw)
    return cfg


# ---- maps ----------------------------------------------------------------------------------------------------------
def test_every_supported_architecture_has_a_map():
    assert set(ARCH_MAPS) == set(ARCHS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_map_follows_arch_flags(arch):
    names = [n for e in expand(hf_config(arch)) for n in e.hf]
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == ARCHS[arch].qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == ARCHS[arch].qk_norm


def test_llama_names_shapes_and_order():
    hf = hf_config("llama")
    shapes = expected_hf_tensors(hf)
    # head_dim 2, 4 heads, 2 kv heads: q 8 rows, k/v 4 rows
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (8, 8)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (4, 8)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (8, 8)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (8, 12)
    assert shapes["lm_head.weight"] == (10, 8)
    assert len(shapes) == 1 + 2 * 9 + 2  # embed, 2 layers of 9 tensors, norm, lm_head
    entries = expand(hf)
    assert entries[0].hf == ("model.embed_tokens.weight",) and entries[0].where == Where.PRE
    assert entries[-1].hf == ("lm_head.weight",) and entries[-1].where == Where.POST
    qkv = [e for e in entries if e.kind == Kind.QKV]
    assert qkv[0].mcore == ("self_attention.linear_qkv.weight",) and qkv[0].layer == 0


def test_qwen3_head_dim_from_config():
    hf = hf_config("qwen3", head_dim=3)
    shapes = expected_hf_tensors(hf)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (12, 8)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (8, 12)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (3,)


def test_tied_embeddings_export_no_lm_head_but_load_the_last_stage_copy():
    entries = expand(hf_config("qwen2", tied=True))
    exported = [n for e in entries if e.export for n in e.hf]
    assert "lm_head.weight" not in exported
    copy = [e for e in entries if not e.export]
    assert len(copy) == 1 and copy[0].hf == ("model.embed_tokens.weight",)
    assert copy[0].mcore == ("output_layer.weight",)


def test_layer_norm_names_of_both_layer_specs():
    norm = next(e for e in expand(hf_config()) if e.hf == ("model.layers.0.input_layernorm.weight",))
    assert resolve_name(norm.mcore, {"input_layernorm.weight"}) == "input_layernorm.weight"  # local spec
    te = {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight"}
    assert resolve_name(norm.mcore, te) == "self_attention.linear_qkv.layer_norm_weight"  # TE spec
    mlp = next(e for e in expand(hf_config()) if e.hf == ("model.layers.0.post_attention_layernorm.weight",))
    assert resolve_name(mlp.mcore, {"mlp.linear_fc1.layer_norm_weight"}) == "mlp.linear_fc1.layer_norm_weight"


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        arch_map({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    for spec in ARCHS.values():
        assert spec.hf_class in str(err.value)


def test_architecture_comes_from_config_not_names():
    # A Qwen2 checkpoint in a folder called "llama" is still Qwen2: the map never sees a path.
    assert arch_map(hf_config("qwen2", _name_or_path="/models/llama-7b")).name == "qwen2"


@pytest.mark.parametrize("switch, message", [
    (dict(mlp_bias=True), "mlp_bias=True is not supported"),
    (dict(attention_bias=True), "it also puts a bias on o_proj"),
])
def test_builder_refuses_switches_the_map_cannot_carry(switch, message):
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.builder import transformer_config

    with pytest.raises(ValueError, match=message):
        transformer_config(hf_config("llama", **switch), ModelConfig(dtype="fp32"), ParallelConfig())


def test_builder_refuses_qwen_sliding_window_layers():
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.builder import transformer_config

    hf = hf_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        transformer_config(hf, ModelConfig(dtype="fp32"), ParallelConfig())


# ---- transforms: hand-worked layouts ---------------------------------------------------------------------------
DIMS = Dims(hidden=1, ffn=4, num_heads=4, num_groups=2, head_dim=1, vocab=5)


def rows(*values):
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


def test_qkv_interleaves_query_groups():
    q, k, v = rows(0, 1, 2, 3), rows(10, 11), rows(20, 21)
    # Group 0 holds q heads 0,1 with k0, v0; group 1 q heads 2,3 with k1, v1.
    full = to_shard(Kind.QKV, [q, k, v], tp=1, rank=0, dims=DIMS)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert to_shard(Kind.QKV, [q, k, v], tp=2, rank=1, dims=DIMS).flatten().tolist() == [2, 3, 11, 21]


def test_qkv_bias_is_one_dimensional():
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    assert to_shard(Kind.QKV, [q, k, v], tp=2, rank=0, dims=DIMS).tolist() == [0, 1, 10, 20]


def test_gate_up_fused_per_rank():
    gate, up = rows(0, 1, 2, 3), rows(10, 11, 12, 13)
    assert to_shard(Kind.GATE_UP, [gate, up], tp=2, rank=1, dims=DIMS).flatten().tolist() == [2, 3, 12, 13]
    assert to_shard(Kind.GATE_UP, [gate, up], tp=1, rank=0, dims=DIMS).flatten().tolist() == [0, 1, 2, 3,
                                                                                               10, 11, 12, 13]


def test_vocab_padding_rows_are_zero():
    emb = torch.arange(10.0).reshape(5, 2)
    assert padded_vocab(5, 2) == 6
    last = to_shard(Kind.VOCAB, [emb], tp=2, rank=1, dims=DIMS)
    assert last.tolist() == [[6, 7], [8, 9], [0, 0]]
    # tp=8: rank 5 holds only rows past the vocabulary
    assert padded_vocab(5, 8) == 8
    assert to_shard(Kind.VOCAB, [emb], tp=8, rank=6, dims=DIMS).tolist() == [[0, 0]]


def test_row_parallel_splits_input_features():
    w = torch.arange(8.0).reshape(2, 4)
    assert to_shard(Kind.ROW, [w], tp=2, rank=1, dims=DIMS).tolist() == [[2, 3], [6, 7]]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", list(Kind))
def test_split_then_merge_is_identity(kind, tp):
    dims = Dims(hidden=8, ffn=12, num_heads=8, num_groups=4, head_dim=2, vocab=11)
    g = torch.Generator().manual_seed(tp)
    shapes = {Kind.REPLICATED: [(8,)], Kind.ROW: [(8, 16)], Kind.VOCAB: [(11, 8)],
              Kind.QKV: [(16, 8), (8, 8), (8, 8)], Kind.GATE_UP: [(12, 8), (12, 8)]}[kind]
    hf = [torch.randn(*s, generator=g) for s in shapes]
    shards = [to_shard(kind, hf, tp, r, dims) for r in range(tp)]
    assert all(tuple(s.shape) == shard_shape(kind, shapes, tp, dims) for s in shards)
    merged = from_shards(kind, shards, dims)
    assert len(merged) == len(hf) and all(torch.equal(a, b) for a, b in zip(merged, hf))


def test_to_shard_reads_only_slices_of_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    q, k, v = torch.randn(16, 8), torch.randn(8, 8), torch.randn(8, 8)
    save_file({"q": q, "k": k, "v": v}, str(tmp_path / "w.safetensors"))
    dims = Dims(hidden=8, ffn=12, num_heads=8, num_groups=4, head_dim=2, vocab=11)
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        lazy = to_shard(Kind.QKV, [f.get_slice(n) for n in "qkv"], 2, 1, dims)
    assert torch.equal(lazy, to_shard(Kind.QKV, [q, k, v], 2, 1, dims))


# ---- planning ------------------------------------------------------------------------------------------------------
def item(i, numel, owner=0):
    return PlanItem(i, (f"t{i}",), ((numel,),), torch.float32, owner, Kind.REPLICATED)


def test_buckets_respect_bound_owner_and_oversized_tensors():
    items = [item(0, 10), item(1, 10), item(2, 30), item(3, 5), item(4, 5, owner=1), item(5, 5, owner=1)]
    plan = plan_buckets(items, bucket_bytes=80)  # 20 fp32 elements
    assert [[it.index for it in b.items] for b in plan] == [[0, 1], [2], [3], [4, 5]]
    assert [b.owner for b in plan] == [0, 0, 0, 1]
    assert plan[1].nbytes == 120 and len(plan[1].items) == 1  # bigger than the bound: alone
    assert all(b.nbytes <= 80 for b in plan if len(b.items) > 1)


def test_shard_plan_like_transformers():
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([], 8) == []


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500kb") == 500_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("five gigs")
