"""TrainEngine.multi_objective_step: each objective's gradient is clipped alone, then weighted and summed, then
the global clip and one Adam step; identical at TP=1, TP=2 and DP=2 (multi_objective_worker.py).

Tolerances (fp32, same math, only reduction order differs; see test_parity.py for the reasoning):
* norms: relative 1e-5 between Megatron's grad norm and a plain torch 2-norm, and between layouts;
* gradients: per tensor max |diff| <= 1e-5 x its max |grad| (the combined gradient against the formula computed
  independently in float64 from each objective's gradient alone, and every layout against TP=1);
* weights after the step: abs 1e-5 (1% of one Adam step of lr 1e-3).
A wrong coefficient, a clip applied to the sum instead of each part, or an objective's gradient lost or counted
twice (e.g. reduced over DP twice) is off by O(1) of the gradient scale.
"""

import json

import pytest

from tests.engine.multi_objective_worker import CLIPS, GLOBAL_CLIP

RTOL = 1e-5
PARAM_ATOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models, torchrun):
    out = tmp_path_factory.mktemp("multi_objective")
    torchrun("multi_objective_worker.py", 1, "reference", out, tiny_models)
    torchrun("multi_objective_worker.py", 2, "layout", out, tiny_models, "2,1", "1,1")
    return out


def _read(out, tag):
    return [json.loads(p.read_text()) for p in sorted((out / tag).glob("rank*.json"))]


def test_reference_clips_each_objective_then_combines(runs):
    (rep,) = _read(runs, "tp1_pp1_dp1")
    for megatron, plain in zip(rep["norms_alone"], rep["plain_norms"]):
        assert megatron == pytest.approx(plain, rel=RTOL)
    assert rep["norms_step"] == pytest.approx(rep["norms_alone"], rel=RTOL)
    # the setup exercises both cases: objective b is clipped (its norm is far above its clip), and so is the sum
    assert rep["norms_alone"][1] > 5 * CLIPS[1] and rep["clip_coefs"][1] < 0.2
    assert rep["clip_coefs"] == pytest.approx([min(1.0, c / n) for c, n in zip(CLIPS, rep["plain_norms"])], rel=RTOL)
    assert rep["expected_total"] > GLOBAL_CLIP
    assert rep["combined_norm"] == pytest.approx(rep["expected_total"], rel=RTOL)
    diff = rep["combined_vs_expected"]
    assert diff["rel"] <= RTOL, diff


@pytest.mark.parametrize("tag", ["tp2_pp1_dp1", "tp1_pp1_dp2"])
def test_layout_matches_tp1(runs, tag):
    (ref,) = _read(runs, "tp1_pp1_dp1")
    reports = _read(runs, tag)
    assert len(reports) == 2
    for rep in reports:
        assert rep["norms_alone"] == pytest.approx(ref["norms_alone"], rel=RTOL)
        assert rep["clip_coefs"] == pytest.approx(ref["clip_coefs"], rel=RTOL)
        assert rep["combined_norm"] == pytest.approx(ref["combined_norm"], rel=RTOL)
        assert rep["losses"] == pytest.approx(ref["losses"], rel=RTOL)
        for name in ("a", "b", "combined"):
            assert rep["diff"][name]["rel"] <= RTOL, (name, rep["diff"][name])
        assert rep["diff"]["params"]["abs"] <= PARAM_ATOL, rep["diff"]["params"]
