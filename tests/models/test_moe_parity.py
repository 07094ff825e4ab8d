"""Tiny Qwen3-MoE and Mixtral (4 experts, top-2, fp32) on Megatron's MoE layer at EP1, EP2 (alltoall and allgather
dispatchers) and PP2, in one 2-process gloo launch (worker_moe.py). Expert-TP 2 runs in test_moe_dp_ep.py (four
processes: expert TP needs EP > 1 as well, models/moe.validate_experts says why).

Logits vs transformers: max abs diff <= 1e-4 (observed <= 1.2e-6 with logits of magnitude about 2.5). Megatron
routes on the top-k logits then softmaxes them, HF softmaxes all experts, takes the top k and renormalises: the same
numbers up to float32 rounding; experts and attention differ only in summation order. Routing never flips here (a
flip would move a logit by 0.1 or more).
Weights exported back are compared bit for bit (the bridge only slices and concatenates).
Training (two Adam steps, aux loss 0.01 and z-loss 0.001): EP2 vs EP1 losses within 1e-6 relative and grad norms
within 1e-6 relative (observed: losses 1.3e-7, grad norms 4e-8): expert parallelism moves tokens, not sums, except
for the order of the DP gradient all-reduce of the experts; PP2 (one data-parallel rank) vs EP1 (two) the same,
with the aux losses on: the engine weights them as token means over the whole update (docs/moe.md), and each
micro batch holds one sequence, so the objective does not depend on how the sequences are dealt to ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.launcher import run_torchrun

HERE = Path(__file__).resolve().parent
ARCHS = ("qwen3_moe", "mixtral")
LAYOUTS = [
    {"name": "ep1", "tp": 1, "pp": 1, "ep": 1},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2},
    {"name": "ep2_allgather", "tp": 1, "pp": 1, "ep": 2, "dispatcher": "allgather"},
    {"name": "pp2", "tp": 1, "pp": 2, "ep": 1},
]
LOGITS_ATOL = 1e-4
TRAIN_RTOL = 1e-6
WORLD = 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    import torch
    import transformers

    from mcore_rl.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe_parity")
    input_ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    models = []
    for seed, arch in enumerate(ARCHS):
        path = make_tiny_hf_model(root / arch, arch, seed=seed)
        with torch.no_grad():
            logits = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(input_ids).logits
        torch.save({"input_ids": input_ids, "logits": logits}, str(path) + ".ref.pt")
        models.append({"key": arch, "dir": str(path), "ref": str(path) + ".ref.pt"})
    spec = {"models": models, "layouts": LAYOUTS, "bucket_bytes": 64 * 1024}
    (root / "spec.json").write_text(json.dumps(spec))
    run_torchrun(HERE / "worker_moe.py", WORLD, root / "spec.json", root / "out", timeout=900)
    out: dict = {}
    for rank in range(WORLD):
        for case in json.loads((root / "out" / f"rank{rank}.json").read_text()):
            out.setdefault((case["layout"], case["model"]), []).append(case)
    return out


def assert_exact(export: dict):
    assert export["received"] and export["names_equal"] and export["hf_order"] and export["stable_order"]
    assert export["mismatched"] == [], f"tensors differing from the HF checkpoint: {export['mismatched']}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_logits_match_transformers(results, layout, arch):
    diffs = [c["logits_max_abs_diff"] for c in results[(layout, arch)] if "logits_max_abs_diff" in c]
    assert diffs and max(diffs) <= LOGITS_ATOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_export_is_the_hf_state_dict(results, layout, arch):
    cases = results[(layout, arch)]
    for case in cases:
        assert_exact(case["export_all"])
    by_rank = {c["rank"]: c["export_dest"] for c in cases}
    assert_exact(by_rank[WORLD - 1])
    assert not by_rank[0]["received"] and by_rank[0]["nones"] == by_rank[0]["num_buckets"]


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_are_split_by_expert_parallelism(results, arch):
    assert {c["num_local_experts"] for c in results[("ep1", arch)]} == {4}
    assert {c["num_local_experts"] for c in results[("ep2", arch)]} == {2}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout, reference", [("ep2", "ep1"), ("ep2_allgather", "ep1"), ("pp2", "ep1")])
def test_training_matches_the_reference_layout(results, layout, reference, arch):
    ref = results[(reference, arch)][0]["train"]
    for case in results[(layout, arch)]:
        got = case["train"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TRAIN_RTOL)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TRAIN_RTOL)
