"""Every parallel layout trains like TP=1: log-probs, entropy, values, losses, gradients and weights after two Adam
steps, for a tiny Llama (untied embeddings) and a tiny Qwen2 (tied embeddings), fp32 on CPU with gloo.

Three torchrun launches (parity_worker.py): the TP=1 reference (1 process); TP=2 (+ selective and full
recompute), PP=2, DP=2 and PP=2 x VPP=2 one after another in one 2-process world; TP=2 x PP=2 and TP=2 x DP=2 in
one 4-process world. Layouts use packed micro batches under a token budget (each DP rank its share of the
sequences); the reference uses padded ones.

Tolerances. Everything is fp32 and the same math; only the order of floating-point reductions differs (TP splits
the hidden contractions and the vocabulary sums, PP/DP move the gradient sums over micro batches and ranks,
packing changes GEMM shapes). Measured worst cases across all layouts are in brackets:
* per-token log-probs / entropies / values (magnitudes ~1-7): abs 5e-6 [1.9e-6: entropy vs a plain
  log_softmax]; a few fp32 ulps of the logsumexp.
* losses, grad norms, summed metrics: relative 1e-5 [5e-7].
* gradients: per tensor, max |diff| <= 1e-5 x that tensor's max |grad| [1.1e-6]: sums of ~100 token
  contributions reordered, a few ulps of the largest element. A real bug (a missing DP / PP contribution, a
  wrong normaliser, a swapped shard) is off by O(1) of the scale.
* weights after two Adam steps (lr 1e-3, eps 1e-6): abs 1e-5 = 1% of one step [1.1e-6]. Adam divides each
  element by its own gradient RMS, which turns a 1e-8 reduction-order difference in a small gradient into a
  visible (but << lr) weight difference; gradients are compared directly above, so scale errors that Adam's
  normalisation would hide are caught there.
* recompute selective / full vs none: gradients bit-identical [0] (same kernels, recomputed).
"""

import json
from pathlib import Path

import pytest

from tests.engine import engine_cases as C

TOKEN_ATOL = 5e-6
SCALAR_RTOL = 1e-5
GRAD_RTOL = 1e-5
PARAM_ATOL = 1e-5

LAUNCHES = {
    # fixture name -> (processes, layouts "TP,PP,VPP[,flags]")
    "two_process_layouts": (2, ["2,1,0,recompute", "1,2,0", "1,1,0", "1,2,2"]),
    "four_process_layouts": (4, ["2,2,0", "2,1,0"]),
}
LAYOUTS = {  # test id -> (result folder, fixture)
    "tp2": ("tp2_pp1_vpp0_dp1", "two_process_layouts"),
    "pp2": ("tp1_pp2_vpp0_dp1", "two_process_layouts"),
    "dp2": ("tp1_pp1_vpp0_dp2", "two_process_layouts"),
    "pp2_vpp2": ("tp1_pp2_vpp2_dp1", "two_process_layouts"),
    "tp2_pp2": ("tp2_pp2_vpp0_dp1", "four_process_layouts"),
    "tp2_dp2": ("tp2_pp1_vpp0_dp2", "four_process_layouts"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_models, torchrun):
    out = tmp_path_factory.mktemp("parity")
    torchrun("parity_worker.py", 1, "reference", out, tiny_models)
    return out, json.loads((out / "ref" / "rank0.json").read_text())


def _launch(reference, tiny_models, torchrun, name):
    out, _ = reference
    nproc, layouts = LAUNCHES[name]
    torchrun("parity_worker.py", nproc, "layout", out, tiny_models, *layouts)
    return out


@pytest.fixture(scope="module")
def two_process_layouts(reference, tiny_models, torchrun):
    return _launch(reference, tiny_models, torchrun, "two_process_layouts")


@pytest.fixture(scope="module")
def four_process_layouts(reference, tiny_models, torchrun):
    return _launch(reference, tiny_models, torchrun, "four_process_layouts")


def rank_reports(folder: Path) -> list[dict]:
    files = sorted(folder.glob("rank*.json"))
    assert files, f"no results in {folder}"
    return [json.loads(f.read_text()) for f in files]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("arch", list(C.ARCHS))
def test_reference_engine_equals_plain_autograd(reference, arch):
    """TP=1: the engine's micro-batched, globally normalised loss and gradients equal one plain autograd pass
    over the whole batch (full-vocabulary log_softmax); padded and packed micro batches agree; logits only at the
    loss tokens (model.lm_head=loss_tokens) equal logits everywhere (all) there, with the same gradients."""
    _, ref = reference
    r = ref[arch]
    assert r["plain_vs_engine_loss"] <= SCALAR_RTOL * abs(r["losses"][0])
    assert r["plain_vs_engine_grads"]["rel"] <= GRAD_RTOL, r["plain_vs_engine_grads"]
    for key in ("plain_vs_engine_logprobs", "plain_vs_engine_entropy", "plain_vs_engine_logprobs_t07",
                "packed_vs_padded_logprobs", "packed_vs_padded_entropy"):
        assert r[key] <= TOKEN_ATOL, (key, r[key])
    # model.lm_head: loss_tokens (default) leaves every other token 0; all computes them too (the prompt's
    # log-probs are non-zero there) and gives the same loss and gradients (the extra rows feed no loss)
    assert r["engine_outside_loss_mask"] == 0.0
    assert r["plain_vs_lm_head_all_logprobs"] <= TOKEN_ATOL and r["plain_vs_lm_head_all_entropy"] <= TOKEN_ATOL
    assert r["lm_head_all_prompt_logprobs"] > 0.0
    assert rel(r["lm_head_all_loss"], r["losses"][0]) <= SCALAR_RTOL
    assert r["lm_head_all_vs_loss_tokens_grads"]["rel"] <= GRAD_RTOL, r["lm_head_all_vs_loss_tokens_grads"]
    assert rel(r["packed_loss"], r["losses"][0]) <= SCALAR_RTOL
    assert r["packed_vs_padded_grads"]["rel"] <= GRAD_RTOL, r["packed_vs_padded_grads"]
    # the loss actually moved: two steps of lr 1e-3 on the same batch
    assert r["losses"][1] < r["losses"][0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_tp1(request, reference, layout):
    folder, fixture = LAYOUTS[layout]
    out = request.getfixturevalue(fixture)
    _, ref = reference
    for rank, report in enumerate(rank_reports(out / folder)):
        for arch in C.ARCHS:
            r, base = report[arch], ref[arch]
            where = f"{layout} rank {rank} {arch}"
            for key in ("logprobs", "entropy", "logprobs_t07", "values"):
                assert r[f"{key}_diff"] <= TOKEN_ATOL, (where, key, r[f"{key}_diff"])
            for a, b in zip(r["losses"], base["losses"]):
                assert rel(a, b) <= SCALAR_RTOL, (where, "loss", a, b)
            for a, b in zip(r["grad_norms"], base["grad_norms"]):
                assert rel(a, b) <= SCALAR_RTOL, (where, "grad norm", a, b)
            for m, mb in zip(r["metrics"], base["metrics"]):
                for key in mb:
                    assert rel(m[key], mb[key]) <= SCALAR_RTOL, (where, key, m[key], mb[key])
            assert rel(r["critic_loss"], base["critic_loss"]) <= SCALAR_RTOL, where
            for key in ("grads1", "critic_grads1"):
                assert r[key]["rel"] <= GRAD_RTOL, (where, key, r[key])
            assert r["params2"]["abs"] <= PARAM_ATOL, (where, r["params2"])
            for recompute in ("selective", "full"):
                if f"recompute_{recompute}_grads1" in r:
                    assert r[f"recompute_{recompute}_grads1"]["rel"] <= GRAD_RTOL, where
                    assert r[f"recompute_{recompute}_vs_none"]["abs"] == 0.0, (where, recompute)
        if "vocab_parallel_fn" in report:
            fn = report["vocab_parallel_fn"]
            assert fn["logprobs"] <= TOKEN_ATOL and fn["entropy"] <= TOKEN_ATOL, fn
            assert fn["grad"] <= GRAD_RTOL * fn["grad_scale"], fn
            assert fn["padding_grad"] == 0.0, fn


def test_recompute_was_checked(two_process_layouts):
    report = rank_reports(two_process_layouts / LAYOUTS["tp2"][0])[0]
    assert {"recompute_selective_vs_none", "recompute_full_vs_none"} <= set(report["llama"])
    assert "vocab_parallel_fn" in report
