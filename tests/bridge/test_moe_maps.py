"""The mixture-of-experts rows of the bridge maps (pure): one entry per global expert, HF names and shapes."""

from mcore_rl.bridge.maps import Dims, Kind, expand, expected_hf_tensors
from mcore_rl.bridge.transforms import from_shards, to_shard

HF = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 512, "num_experts_per_tok": 2}
QWEN3_MOE = dict(HF, architectures=["Qwen3MoeForCausalLM"], head_dim=16, num_experts=4, moe_intermediate_size=32)
MIXTRAL = dict(HF, architectures=["MixtralForCausalLM"], num_local_experts=4)


def test_qwen3_moe_experts_and_router():
    experts = [e for e in expand(QWEN3_MOE) if e.expert is not None]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    fc1 = next(e for e in experts if e.layer == 1 and e.expert == 3 and e.kind == Kind.GATE_UP)
    assert fc1.hf == ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    assert fc1.mcore == ("mlp.experts.local_experts.{k}.linear_fc1.weight", "mlp.experts.linear_fc1.weight{k}")
    shapes = expected_hf_tensors(QWEN3_MOE)
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.0.mlp.experts.2.down_proj.weight"] == (64, 32)
    assert "model.layers.0.mlp.gate_proj.weight" not in shapes  # no dense MLP
    assert "model.layers.0.self_attn.q_norm.weight" in shapes


def test_mixtral_names_and_expert_size():
    shapes = expected_hf_tensors(MIXTRAL)
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.block_sparse_moe.experts.0.w1.weight"] == (128, 64)  # gate
    assert shapes["model.layers.1.block_sparse_moe.experts.0.w3.weight"] == (128, 64)  # up
    assert shapes["model.layers.1.block_sparse_moe.experts.0.w2.weight"] == (64, 128)  # down
    assert Dims.from_hf(MIXTRAL).num_experts == 4


def test_expert_gate_up_split_uses_the_expert_size():
    import torch

    dims = Dims.from_hf(QWEN3_MOE)
    gate, up = torch.randn(32, 64), torch.randn(32, 64)
    shards = [to_shard(Kind.GATE_UP, [gate, up], 2, r, dims) for r in range(2)]
    assert shards[0].shape == (32, 64) and torch.equal(shards[1][:16], gate[16:])
    back = from_shards(Kind.GATE_UP, shards, dims)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
