"""Expert parallelism inside data parallelism: the tiny Qwen3-MoE and Mixtral models of test_moe_parity.py on four
gloo processes (one launch of worker_moe.py), where dense data parallelism (DP 4) and expert parallelism overlap.

    ep1       DP 4, every rank holds all 4 experts (expert DP 4)
    ep2       DP 4 x EP 2: 2 experts per rank, expert DP 2 (the experts' gradients are reduced over 2 ranks, the
              dense parameters' over 4)
    ep4       DP 4 x EP 4: one expert per rank, expert DP 1
    ep2_etp2  DP 4 x EP 2 x expert-TP 2: each expert's matrices split over 2 ranks, expert DP 1 (routed tokens are
              gathered over the expert-TP group with uneven sizes: megatron_on_cpu's stand-ins)
    pp2_ep2   PP 2 x DP 2 x EP 2
    tp2_ep2   TP 2 x DP 2 x EP 2 with sequence parallelism (which Megatron requires for MoE at TP > 1; the local
              spec's norms are models/specs.py TorchNorm), aux and z losses on (the sequences have even lengths:
              see worker_moe.sequences)

Each rank trains on its dense-DP share of the same 8 sequences with the loss normalised by the global token count,
so every layout computes the same sums in another order: losses and gradient norms within 1e-6 relative of ep1
(fp32). Logits vs transformers <= 1e-4 and export bit-exact, as at two processes.

Run: nice -n 10 .venv/bin/python -m pytest tests/models/test_moe_dp_ep.py -q   (about 3-4 minutes on 2 cores)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.models.test_moe_parity import ARCHS, LOGITS_ATOL, TRAIN_RTOL, assert_exact
from tests.parallel.launcher import run_torchrun

HERE = Path(__file__).resolve().parent
WORLD = 4
LAYOUTS = [
    {"name": "ep1", "tp": 1, "pp": 1, "ep": 1},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2},
    {"name": "ep4", "tp": 1, "pp": 1, "ep": 4},
    {"name": "ep2_etp2", "tp": 1, "pp": 1, "ep": 2, "etp": 2},
    {"name": "pp2_ep2", "tp": 1, "pp": 2, "ep": 2},
    {"name": "tp2_ep2_sp", "tp": 2, "pp": 1, "ep": 2, "sp": True},
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    import torch
    import transformers

    from mcore_rl.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe_dp_ep")
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
    run_torchrun(HERE / "worker_moe.py", WORLD, root / "spec.json", root / "out", timeout=1200)
    out: dict = {}
    for rank in range(WORLD):
        for case in json.loads((root / "out" / f"rank{rank}.json").read_text()):
            out.setdefault((case["layout"], case["model"]), []).append(case)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_per_rank(results, arch):
    expected = {"ep1": 4, "ep2": 2, "ep4": 1, "ep2_etp2": 2, "pp2_ep2": 2, "tp2_ep2_sp": 2}
    got = {lay: sorted({c["num_local_experts"] for c in results[(lay, arch)]}) for lay in expected}
    assert got == {lay: [n] for lay, n in expected.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [lay["name"] for lay in LAYOUTS])
def test_logits_and_export(results, layout, arch):
    cases = results[(layout, arch)]
    diffs = [c["logits_max_abs_diff"] for c in cases if "logits_max_abs_diff" in c]
    assert diffs and max(diffs) <= LOGITS_ATOL, diffs
    for case in cases:
        assert_exact(case["export_all"])
    by_rank = {c["rank"]: c["export_dest"] for c in cases}
    assert_exact(by_rank[WORLD - 1])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout, reference", [("ep2", "ep1"), ("ep4", "ep1"), ("ep2_etp2", "ep1"),
                                                ("pp2_ep2", "ep1"), ("tp2_ep2_sp", "ep1")])
def test_training_matches_ep1(results, layout, reference, arch):
    ref = results[(reference, arch)][0]["train"]
    for case in results[(layout, arch)]:
        got = case["train"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=TRAIN_RTOL), (case["rank"], got, ref)
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=TRAIN_RTOL), (case["rank"], got, ref)
