"""Routing replay's plumbing without running a model: the switch (model.moe_routing_replay) and where it is
refused, the rollout routes in token space (trainer/batch.token_routes), and micro batches of per-token fields with
dimensions of their own (engine/batching). The end-to-end checks are in test_moe_replay.py."""

import pytest
import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.engine.batching import make_micro_batches, pad_micro_batch
from mcore_rl.models.builder import transformer_config
from mcore_rl.rollout.engine import _route_shape
from mcore_rl.trainer.batch import sample_sequences, token_routes
from mcore_rl.types import Sample
from tests.models.test_moe_config import BASE, qwen3_moe

DENSE = dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2")


def test_switch_reaches_megatron_and_is_off_by_default():
    assert not transformer_config(qwen3_moe(), ModelConfig(dtype="fp32"), ParallelConfig()).moe_enable_routing_replay
    cfg = transformer_config(qwen3_moe(), ModelConfig(dtype="fp32", moe_routing_replay=True), ParallelConfig())
    assert cfg.moe_enable_routing_replay


def test_dense_model_refuses_replay():
    with pytest.raises(ValueError, match=r"model.moe_routing_replay=true replays mixture-of-experts routes, but "
                                         r"Qwen2ForCausalLM is dense .*set model.moe_routing_replay=false"):
        transformer_config(DENSE, ModelConfig(dtype="fp32", moe_routing_replay=True), ParallelConfig())


def test_rollout_route_shape_from_config_json(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe()))
    assert _route_shape(str(tmp_path)) == (4, 2, 4)
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; .* is dense"):
        _route_shape(str(tmp_path))
    with pytest.raises(ValueError, match="needs the checkpoint's config.json"):
        _route_shape("")


def test_root_config_asks_the_engine_for_routes():
    from mcore_rl.config.root import RLConfig

    assert not RLConfig(model=ModelConfig(path="x")).rollout.return_routed_experts
    assert RLConfig(model=ModelConfig(path="x", moe_routing_replay=True)).rollout.return_routed_experts


def sample(p, r, routes=True):
    n = p + r - 1
    routed = torch.arange(n * 4 * 2, dtype=torch.int32).remainder(4).to(torch.uint8).view(n, 4, 2)
    return Sample(list(range(p)), list(range(r)), [0.0] * r, "stop", routed_experts=routed if routes else None)


def test_token_routes_cover_every_token():
    s = sample(3, 4)
    (routes,) = token_routes([s])
    assert routes.shape == (7, 4, 2) and routes.dtype == torch.uint8
    assert torch.equal(routes[:6], s.routed_experts)
    assert routes[6].tolist() == [[0, 1]] * 4  # the token the engine never ran forward: any k distinct experts
    assert token_routes([sample(3, 4, routes=False)]) is None
    seqs = sample_sequences([s])
    assert seqs.routed_experts is not None and "routed_experts" in seqs.for_engine()[0]
    assert sample_sequences([s], with_routes=False).routed_experts is None


def test_token_routes_errors():
    with pytest.raises(ValueError, match="1 of 2 samples carry no routed experts"):
        token_routes([sample(3, 4), sample(2, 2, routes=False)])
    bad = sample(3, 4)
    bad.routed_experts = bad.routed_experts[:-1]
    with pytest.raises(ValueError, match="a sample of 7 tokens carries routes for 5"):
        token_routes([bad])


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batches_carry_fields_with_trailing_dimensions(packed):
    seqs = [{"input_ids": torch.arange(n), "routed_experts": torch.full((n, 4, 2), n, dtype=torch.uint8)}
            for n in (3, 5)]
    (mb,) = make_micro_batches(seqs, max_tokens=16, packed=packed)
    routes = mb["routed_experts"]
    if packed:
        assert routes.shape == (1, 8, 4, 2) and routes[0, :3].eq(3).all() and routes[0, 3:].eq(5).all()
    else:
        assert routes.shape == (2, 5, 4, 2) and routes[0, :3].eq(3).all() and routes[0, 3:].eq(0).all()
    grown = pad_micro_batch(mb, 10, 1 if packed else 3)
    assert grown["routed_experts"].shape[2:] == (4, 2) and grown["routed_experts"].shape[1] == 10
    with pytest.raises(ValueError, match=r"field 'routed_experts' has shape \(2, 4, 2\), expected \(3,\)"):
        make_micro_batches([{"input_ids": torch.arange(3), "routed_experts": torch.zeros(2, 4, 2)}], max_tokens=8)
