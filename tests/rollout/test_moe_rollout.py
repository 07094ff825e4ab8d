"""SGLang 0.5.17 generating with mixture-of-experts models on CPU, fp32, through RolloutEngine: tiny Qwen3-MoE and
Mixtral (4 experts, top-2, mcore_rl.testing.make_tiny_hf_model) against HF transformers, the fused expert layout
the engine holds, and HF-layout weight syncs with per-expert names.

SGLang runs its own torch-native MoE path here (TopK.forward_native, UnquantizedFusedMoEMethod.forward_native ->
moe_forward_native): no sgl_kernel op is involved (docs/rollout.md, "MoE on CPU"). Observed on the CPU machines:
greedy tokens equal HF `generate` for 16 new tokens, log-probs within 9.5e-7 (Qwen3-MoE) and 1.4e-6 (Mixtral) of
HF's log-softmax (LOGPROB_TOL 1e-4).
The engine-layout table of the bridge (mcore_rl.bridge.engine_layout: experts as slices `experts.w13_weight[e]` /
`w2_weight[e]` of SGLang's stacked parameters) names exactly the live engine's parameters with their shapes, and a
sync of HF tensors repacked into that layout (several buckets, tensors that are no views of one buffer) gives the
same greedy tokens and log-probs as HF. Syncs from a Megatron actor: tests/weight_sync/test_moe_sync.py.
One engine per architecture serves the module (25-80 s to start); the sync tests leave it holding seed 0 again.

Run: nice -n 10 .venv/bin/python -m pytest tests/rollout/test_moe_rollout.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import LOGPROB_TOL, HFReference, buckets, cpu_config, hf_weights
from mcore_rl.rollout import RolloutEngine
from mcore_rl.testing import make_tiny_hf_model

NUM_NEW_MOE = 16
NUM_EXPERTS = 4  # make_tiny_hf_model's MoE configs
# HF checkpoint names of one layer's MoE block: module prefix, and (gate, up, down) names of expert e.
HF_MOE_NAMES = {
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
}


@dataclass
class MoECase:
    arch: str
    paths: dict[int, str]            # seed -> HF folder
    refs: dict[int, HFReference]
    prompts: dict[int, list]         # seed -> [(prompt, HF greedy response)] without near-ties
    engine: RolloutEngine


@pytest.fixture(scope="module", params=tuple(HF_MOE_NAMES))
def moe(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    paths = {seed: str(make_tiny_hf_model(root / f"seed{seed}", arch=arch, seed=seed)) for seed in (0, 1)}
    refs = {seed: HFReference(path) for seed, path in paths.items()}
    prompts = {seed: ref.stable_prompts(num=4, num_new=NUM_NEW_MOE) for seed, ref in refs.items()}
    engine = RolloutEngine(cpu_config(mode="engine"), model_path=paths[0])
    yield MoECase(arch, paths, refs, prompts, engine)
    engine.shutdown()


def assert_matches_hf(engine: RolloutEngine, ref: HFReference, prompts) -> float:
    """Greedy tokens equal HF generate's and log-probs HF's log-softmax (LOGPROB_TOL); returns the largest gap."""
    sampling = engine.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW_MOE, ignore_eos=True)
    batch = engine.generate([p for p, _ in prompts], sampling=sampling)
    gap = 0.0
    for sample, (prompt, expected) in zip(batch.samples, prompts):
        assert sample.response_ids == expected, (prompt, sample.response_ids, expected)
        ref_lp = ref.logprobs(prompt, sample.response_ids)
        got = torch.tensor(sample.rollout_logprobs)
        torch.testing.assert_close(got, ref_lp, atol=LOGPROB_TOL, rtol=0)
        gap = max(gap, float((got - ref_lp).abs().max()))
    return gap


def test_greedy_and_logprobs_equal_hf(moe):
    # the prompts twice over, in requests of 4: several requests decode together, so experts see mixed batches
    gap = assert_matches_hf(moe.engine, moe.refs[0], moe.prompts[0] * 2)
    print(f"{moe.arch}: largest |SGLang - HF| log-prob gap {gap:.2e}")


def test_engine_holds_fused_experts(moe):
    """The layout an engine-layout sync must send: per layer `experts.w13_weight` [E, 2I, H] whose expert e is
    [gate_e; up_e] (rows), `experts.w2_weight` [E, H, I] = down_e, and the router `gate.weight` [E, H] as in HF."""
    hf = dict(hf_weights(moe.paths[0]))
    params = moe.engine.weights.save_parameters()
    prefix, (gate, up, down) = HF_MOE_NAMES[moe.arch]
    layers = sorted({int(name.split(".")[2]) for name in hf if name.startswith("model.layers.")})
    assert layers
    for layer in layers:
        block = f"model.layers.{layer}.{prefix}"
        w13, w2 = params[block + "experts.w13_weight"], params[block + "experts.w2_weight"]
        inter, hidden = hf[f"{block}experts.0.{gate}.weight"].shape
        assert w13.shape == (NUM_EXPERTS, 2 * inter, hidden) and w2.shape == (NUM_EXPERTS, hidden, inter)
        for e in range(NUM_EXPERTS):
            expert = f"{block}experts.{e}."
            assert torch.equal(w13[e], torch.cat([hf[expert + gate + ".weight"], hf[expert + up + ".weight"]]))
            assert torch.equal(w2[e], hf[expert + down + ".weight"])
        assert torch.equal(params[block + "gate.weight"], hf[block + "gate.weight"])
        assert not any(f"{block}experts.{e}." in name for name in params for e in range(NUM_EXPERTS))
    shapes = moe.engine.weights.engine_parameters()
    assert shapes.keys() == params.keys()
    assert all(shapes[name] == tuple(t.shape) for name, t in params.items())


def test_hf_layout_sync_with_per_expert_names(moe):
    engine, version = moe.engine, moe.engine.weight_version
    named = hf_weights(moe.paths[1])
    assert any(".experts.3." in name for name, _ in named)  # the Hub's per-expert names, not fused tensors
    # the two seeds disagree on these prompts, so matching seed 1 afterwards shows the new weights were applied
    assert any(moe.refs[0].greedy(p, NUM_NEW_MOE)[0] != r for p, r in moe.prompts[1])
    # 7 buckets: some split one expert's gate and up, which SGLang writes into two halves of one w13 slice
    with engine.weights.weight_update():
        for bucket in buckets(named, 7):
            engine.weights.update_bucket(bucket)
    assert engine.weight_version == version + 1
    assert_matches_hf(engine, moe.refs[1], moe.prompts[1])
    with engine.weights.weight_update():
        for bucket in buckets(hf_weights(moe.paths[0]), 2):
            engine.weights.update_bucket(bucket)
    assert engine.weight_version == version + 2
    assert_matches_hf(engine, moe.refs[0], moe.prompts[0])


def engine_layout_tensors(hf_path: str, arch: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in the engine layout, built from the bridge's table: each entry's HF tensors back to
    back (fused q/k/v, gate/up, an expert's [gate; up]) plus the vocabulary's zero padding rows."""
    from mcore_rl.bridge.engine_layout import engine_tensors
    from mcore_rl.bridge.maps import Dims, expand
    from mcore_rl.models.arch import load_hf_config

    hf = load_hf_config(hf_path)
    dims, weights = Dims.from_hf(hf), dict(hf_weights(hf_path))
    out = []
    for entry in expand(hf):
        if not entry.export:
            continue
        (name, shape), = engine_tensors(entry, dims)
        flat = torch.cat([weights[n].reshape(-1) for n in entry.hf])
        padded = torch.zeros(torch.Size(shape).numel(), dtype=flat.dtype)
        padded[:flat.numel()] = flat
        out.append((name, padded.view(shape)))
    return out


def test_engine_layout_table_is_the_live_engines(moe):
    """Every name and shape the bridge sends in the engine layout against SGLang's own parameters (complete: every
    stacked expert parameter gets all of its slices)."""
    from mcore_rl.weight_sync.loaders import check_names

    sending = {n: tuple(t.shape) for n, t in engine_layout_tensors(moe.paths[0], moe.arch)}
    engine = moe.engine.weights.engine_parameters()
    check_names(sending, engine, "the bridge's engine-layout table")
    prefix, _ = HF_MOE_NAMES[moe.arch]
    stacked = f"model.layers.0.{prefix}experts.w13_weight"
    assert sending[stacked + "[3]"] == engine[stacked][1:] and engine[stacked][0] == NUM_EXPERTS


def test_engine_layout_sync_of_expert_slices(moe):
    engine, version = moe.engine, moe.engine.weight_version
    named = engine_layout_tensors(moe.paths[1], moe.arch)
    assert any(n.endswith("w13_weight[3]") for n, _ in named)
    with engine.weights.weight_update():  # 5 buckets: one layer's expert slices cross bucket cuts
        for bucket in buckets(named, 5):
            engine.weights.update_bucket(bucket, layout="engine")
    assert engine.weight_version == version + 1
    assert_matches_hf(engine, moe.refs[1], moe.prompts[1])
    engine.weights.update_weights_from_disk(moe.paths[0])
    assert_matches_hf(engine, moe.refs[0], moe.prompts[0])
