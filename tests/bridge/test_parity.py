"""HF -> Megatron -> HF on tiny random models of every architecture, tied and untied, at TP1, TP2, PP2, TP2xPP2
(and PP2 with two virtual stages for the export), all in one 4-process torchrun launch (worker_parity.py).

Tolerance of the logits: max abs diff <= 1e-4 in fp32 against transformers. Logits are O(1) here (max |logit|
about 2.6); the only differences are summation order (TP splits the reductions of the attention output and MLP
down projections across ranks and sums the partials with an all-reduce; Megatron fuses q/k/v and gate/up into one
matmul each), a few float32 ulps per layer: observed 0 at TP1 and <= 2e-6 at TP2. 1e-4 leaves 50x headroom, while
a permuted head, a swapped norm or a wrong vocab slice moves logits by 0.1 or more.
Weights are compared bit-exactly (torch.equal): the bridge only copies, slices and concatenates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MODELS = [f"{a}_{t}" for a in ARCHS for t in ("untied", "tied")]
LAYOUTS = [(2, 2, None), (2, 1, None), (1, 2, None), (1, 1, None), (1, 2, 2)]  # the first saves the checkpoint
LAYOUT_NAMES = ["tp2_pp2", "tp2_pp1", "tp1_pp2", "tp1_pp1", "tp1_pp2_vpp2"]
FORWARD_LAYOUTS = LAYOUT_NAMES[:4]  # the test's hand-written pipeline forward has no interleaved schedule
BUCKET_BYTES = 64 * 1024  # smaller than the embedding (512 x 64 fp32 = 128 KiB): it must get a bucket of its own
EMBEDDING_BYTES = 512 * 64 * 4
CKPT_MODEL = "qwen2_tied"  # q/k/v biases, and a tied embedding whose copy sits on the last pipeline stage
LOGITS_ATOL = 1e-4
WORLD = 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tiny_models, torchrun, tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    """(layout, model) -> the per-rank findings of worker_parity.py (one torchrun launch for the whole module)."""
    root = tmp_path_factory.mktemp("parity")
    # reference logits sit beside each model folder (conftest.tiny_models)
    models = [{"key": f"{arch}_{'tied' if tied else 'untied'}", "dir": str(path), "ref": str(path) + ".ref.pt"}
              for (arch, tied), path in tiny_models.items()]
    spec = {"models": models, "layouts": LAYOUTS, "bucket_bytes": BUCKET_BYTES,
            "ckpt_dir": str(root / "ckpt"), "ckpt_model": CKPT_MODEL}
    (root / "spec.json").write_text(json.dumps(spec))
    torchrun(HERE / "worker_parity.py", WORLD, [root / "spec.json", root / "out"])
    out: dict = {}
    for rank in range(WORLD):
        for case in json.loads((root / "out" / f"rank{rank}.json").read_text()):
            out.setdefault((case["layout"], case["model"]), []).append(case)
    return out


def assert_exact(export: dict):
    assert export["received"]
    assert export["names_equal"], "exported names differ from the HF checkpoint's"
    assert export["mismatched"] == [], f"tensors differing from the HF checkpoint: {export['mismatched']}"
    assert export["hf_order"] and export["stable_order"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", FORWARD_LAYOUTS)
def test_logits_match_transformers(results, layout, model):
    diffs = [c["logits_max_abs_diff"] for c in results[(layout, model)] if "logits_max_abs_diff" in c]
    assert len(diffs) == WORLD // int(layout.split("_pp")[1])  # every last-stage rank computed logits
    assert max(diffs) <= LOGITS_ATOL


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_export_to_all_ranks_is_the_hf_state_dict(results, layout, model):
    cases = results[(layout, model)]
    assert len(cases) == WORLD
    for case in cases:
        assert_exact(case["export_all"])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_export_to_one_destination_rank(results, layout, model):
    by_rank = {c["rank"]: c["export_dest"] for c in results[(layout, model)]}
    assert_exact(by_rank[WORLD - 1])
    for rank in range(WORLD - 1):
        assert not by_rank[rank]["received"]
        assert by_rank[rank]["nones"] == by_rank[rank]["num_buckets"]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_export_casts_to_the_requested_dtype(results, layout):
    for case in results[(layout, "llama_untied")]:
        assert_exact(case["export_bf16"])


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_export_throughput_report(results, layout):
    tp, pp = int(layout[2]), int(layout.split("_pp")[1][0])
    for case in results[(layout, "llama_untied")]:
        report = case["measure"]
        assert report["gbytes"] * 1e9 == pytest.approx(case["hf_bytes"], rel=1e-12)
        assert report["seconds"] > 0 and report["seconds_per_gb"] > 0
        assert (report["tp"], report["pp"]) == (tp, pp)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_critic_loads_everything_but_its_value_head(results, layout):
    for case in results[(layout, "llama_untied")]:
        critic = case["critic"]
        assert not critic["unlike_actor"], critic["unlike_actor"]  # parameter -> max |diff| from the actor's
        assert critic["num_shared"] > 0 and critic["bind_reads_critic"]
        assert "no HF causal-LM counterpart" in critic["export_refused"]


@pytest.mark.parametrize("model", ["llama_untied", "qwen3_tied"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_buckets_stay_within_the_bound(results, layout, model):
    for case in results[(layout, model)]:
        export = case["export_all"]
        plan = export["plan"]  # [(bytes, number of parameters)]
        assert export["bucket_bytes"] == [b for b, _ in plan]  # what was received is what was planned
        assert all(b <= BUCKET_BYTES for b, n in plan if n > 1)
        oversized = [(b, n) for b, n in plan if b > BUCKET_BYTES]
        assert oversized and all(n == 1 for _, n in oversized)  # embedding (and lm_head): alone
        assert max(export["bucket_bytes"]) == EMBEDDING_BYTES  # the largest bucket ever held


@pytest.mark.parametrize("layout", LAYOUT_NAMES[1:])
def test_dist_checkpoint_saved_at_tp2pp2_loads_at_other_layouts(results, layout):
    assert any(c.get("ckpt_saved") for c in results[(LAYOUT_NAMES[0], CKPT_MODEL)])
    for case in results[(layout, CKPT_MODEL)]:
        assert_exact(case["ckpt_export"])
