"""MoE models (tiny Qwen3-MoE and Mixtral: 4 experts, top-2) synced from a real Megatron actor into the real SGLang
engine (CPU, fp32) in the engine layout (at EP=2, experts as slices of SGLang's stacked `experts.w13_weight` /
`w2_weight`, spread over several buckets and gathered from both EP ranks) and the shared layout (at EP=1, the engine
copying from the actor's own expert parameters), in one 2-process launch (moe_sync_worker.py; one engine per
model, 3-6 min on the 2-core CPU machines).

Each layout leaves every engine parameter bit-identical to an HF-layout sync of the same actor (both end in one
copy of the same fp32 values); the engine layout's greedy tokens equal HF transformers' generate on the actor's
checkpoint and its log-probs HF's log-softmax within LOGPROB_TOL (1e-4; tests/rollout/test_moe_rollout.py observed
<= 1.4e-6 for these models). weight_sync.layout=auto picks engine at EP=2 and shared at EP=1.
Pure parts: tests/bridge/test_engine_layout.py (names, shapes), test_plan.py (the choice), test_loaders.py (slices).
"""

from __future__ import annotations

import json

import pytest

from mcore_rl.testing import make_tiny_hf_model
from tests.parallel.launcher import run_torchrun
from tests.weight_sync.conftest import ROOT

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4
ARCHS = ("qwen3_moe", "mixtral")


def test_engine_and_shared_layouts_equal_hf_layout(tmp_path):
    paths = []
    for arch in ARCHS:
        paths += [make_tiny_hf_model(tmp_path / arch / f"seed{seed}", arch=arch, seed=seed) for seed in (0, 1)]
    out = run_torchrun(ROOT / "tests" / "weight_sync" / "moe_sync_worker.py", 2, tmp_path, *paths, timeout=1200)
    results = json.loads((tmp_path / "result.json").read_text())
    assert sorted(results) == sorted(ARCHS), out[-3000:]
    for arch, r in results.items():
        assert r["ep2_layout"] == "engine" and r["ep1_layout"] == "shared", (arch, r)
        # the experts of one layer arrive in several buckets (16 KiB: one expert matrix each, or less)
        assert r["num_buckets"] > 8 and r["max_buckets_per_layer_experts"] > 1, (arch, r)
        assert r["slice_names"] and all("_weight[" in n for n in r["slice_names"]), (arch, r["slice_names"])
        assert r["seed0_vs_hf_transformers"]["greedy_equal"] < 4, (arch, r)  # the control: seeds disagree
        for key in ("engine_ep2_vs_hf_transformers", "shared_vs_hf_transformers"):
            assert r[key]["greedy_equal"] == r[key]["greedy_compared"] == 4, (arch, key, r[key])
            assert r[key]["logprob_gap"] <= LOGPROB_TOL, (arch, key, r[key])
        assert r["engine_ep2_equals_hf_layout"] and r["unchanged_by_sync"] == [], (arch, r)
        assert r["shared_equals_hf_layout"] and r["shared_in_place_equals_engine"], (arch, r)
        assert r["unchanged_by_perturbed_sync"] == [], (arch, r["unchanged_by_perturbed_sync"])
        prefix = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
        assert f"model.layers.3.{prefix}.experts.w13_weight" in r["names"], (arch, r["names"])
        print(f"{arch}: engine layout (EP2) log-prob gap {r['engine_ep2_vs_hf_transformers']['logprob_gap']:.2e}, "
              f"shared (EP1) {r['shared_vs_hf_transformers']['logprob_gap']:.2e}; {r['num_buckets']} buckets")
