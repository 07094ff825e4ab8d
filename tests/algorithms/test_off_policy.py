"""Off-policy corrections against an independent plain-Python loop, edge cases, argument errors and routing.

float64 throughout unless a test says otherwise; the loop sums the same terms in another order and uses
math.exp(x) - 1 where torch uses expm1, hence rtol = atol = 1e-12.
"""

import math

import pytest
import torch

from mcore_rl.algorithms import (
    compute_correction,
    get_correction,
    list_corrections,
    seq_mask,
    seq_tis,
    token_mask,
    token_tis,
    truncated_importance_weights,
)
from mcore_rl.algorithms import registry

from .helpers import fill_padding, mask_from_lengths, pad_right

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)
MAX_LOG = 20.0  # the documented clamp of log ratios before exp
KEYS = {"ratio_mean", "ratio_max", "truncated_frac", "masked_frac", "mismatch_kl"}
SEQ_KEYS = KEYS | {"seq_ratio_mean", "seq_ratio_max"}


def _batch(seed=0, spread=0.3):
    """Ragged rows, an empty row (2), holes inside rows 1 and 4 (tool tokens), NaN on every masked position."""
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths([5, 7, 0, 1, 7, 3], 7, {1: [2, 3], 4: [0, 6]})
    old = -torch.rand(6, 7, generator=g, dtype=F64) * 2
    rollout = old + spread * torch.randn(6, 7, generator=g, dtype=F64)
    return fill_padding(old, mask), fill_padding(rollout, mask), mask


def reference(name, old, rollout, mask, cap=None, low=None, high=None, weight_by_ratio=False, seq_ratio="geometric"):
    """(weights as nested lists, metrics as floats), one row and one token at a time."""
    old, rollout, mask = old.tolist(), rollout.tolist(), mask.tolist()
    weights, ratios, kls, seq_ratios = [], [], [], []
    num_valid = num_truncated = num_masked = 0
    for o_row, r_row, m_row in zip(old, rollout, mask):
        valid = [t for t in range(len(m_row)) if m_row[t]]
        log_r = {t: o_row[t] - r_row[t] for t in valid}
        row = [0.0] * len(m_row)
        for t in valid:
            ratios.append(math.exp(min(log_r[t], MAX_LOG)))
            x = max(min(log_r[t], MAX_LOG), -MAX_LOG)
            kls.append(math.exp(x) - 1.0 - x)
        num_valid += len(valid)
        if name in ("token_tis", "token_mask"):
            for t in valid:
                rho = math.exp(min(log_r[t], MAX_LOG))
                if name == "token_tis":
                    row[t] = min(rho, cap)
                    num_truncated += rho > cap
                elif low <= rho <= high:
                    row[t] = rho if weight_by_ratio else 1.0
                else:
                    num_masked += 1
        else:
            total = 0.0
            for t in valid:
                total += log_r[t]
            if seq_ratio == "geometric" and valid:
                total /= len(valid)
            rho = math.exp(min(total, MAX_LOG))
            if valid:
                seq_ratios.append(rho)
            for t in valid:
                if name == "seq_tis":
                    row[t] = min(rho, cap)
                    num_truncated += rho > cap
                elif low <= rho <= high:
                    row[t] = 1.0
                else:
                    num_masked += 1
        weights.append(row)
    n = max(num_valid, 1)
    metrics = {
        "ratio_mean": sum(ratios) / n,
        "ratio_max": max(ratios, default=0.0),
        "truncated_frac": num_truncated / n,
        "masked_frac": num_masked / n,
        "mismatch_kl": sum(kls) / n,
    }
    if name.startswith("seq"):
        metrics["seq_ratio_mean"] = sum(seq_ratios) / max(len(seq_ratios), 1)
        metrics["seq_ratio_max"] = max(seq_ratios, default=0.0)
    return weights, metrics


def _check(name, old, rollout, mask, **params):
    weights, metrics = get_correction(name)(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, **params)
    ref_weights, ref_metrics = reference(name, old, rollout, mask, **params)
    torch.testing.assert_close(weights, torch.tensor(ref_weights, dtype=F64), **TOL)
    assert set(metrics) == set(ref_metrics) == (SEQ_KEYS if name.startswith("seq") else KEYS)
    for key, value in ref_metrics.items():
        assert metrics[key].dim() == 0
        assert metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key
    return weights, metrics


# ---------------------------------------------------------------- against the loop
CASES = [
    ("token_tis", dict(cap=1.3)),
    ("token_tis", dict(cap=1.1)),
    ("token_mask", dict(low=0.8, high=1.25)),
    ("token_mask", dict(low=0.8, high=1.25, weight_by_ratio=True)),
    ("token_mask", dict(low=0.0, high=1.5)),
    ("seq_mask", dict(low=0.95, high=1.05, seq_ratio="geometric")),
    ("seq_mask", dict(low=0.7, high=1.4, seq_ratio="product")),
    ("seq_tis", dict(cap=1.02, seq_ratio="geometric")),
    ("seq_tis", dict(cap=1.2, seq_ratio="product")),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,params", CASES)
def test_matches_loop_on_ragged_batch_with_holes(name, params, seed):
    old, rollout, mask = _batch(seed)
    weights, metrics = _check(name, old, rollout, mask, **params)
    assert weights.dtype == F64 and (weights[mask == 0] == 0).all()
    # a wider padded batch changes nothing: padding (NaN here) never leaks
    wide_w, wide_m = get_correction(name)(old_logprobs=pad_right(old, 3), rollout_logprobs=pad_right(rollout, 3),
                                          response_mask=pad_right(mask, 3, 0).long(), **params)
    torch.testing.assert_close(wide_w[:, :7], weights, rtol=0, atol=0)
    assert (wide_w[:, 7:] == 0).all()
    for key in metrics:
        torch.testing.assert_close(wide_m[key], metrics[key], **TOL)


@pytest.mark.parametrize("name,params", CASES)
def test_cases_exercise_both_branches(name, params):
    """Guard on the cases above: with seed 0 some valid tokens are truncated/masked and some are not."""
    old, rollout, mask = _batch(0)
    _, m = reference(name, old, rollout, mask, **params)
    frac = m["truncated_frac"] if name.endswith("tis") else m["masked_frac"]
    assert 0.0 < frac < 1.0


def test_token_tis_is_truncated_importance_weights():
    old, rollout, mask = _batch(3)
    weights, _ = token_tis(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, cap=1.2)
    torch.testing.assert_close(weights, truncated_importance_weights(old, rollout, mask, cap=1.2), rtol=0, atol=0)


def test_truncated_importance_weights_unchanged():
    """The function the trainer calls, positionally, still gives min(exp(old - rollout), cap), 0 on padding."""
    old, rollout, mask = _batch(4, spread=1.0)
    w = truncated_importance_weights(old, rollout, mask, 2.0)
    ref, _ = reference("token_tis", old, rollout, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor(ref, dtype=F64), **TOL)
    assert w.dtype == F64 and not w.requires_grad


# ---------------------------------------------------------------- edge cases
@pytest.mark.parametrize("name,params", CASES)
def test_all_masked_gives_zeros_not_nan(name, params):
    old, rollout, _ = _batch(0)
    mask = torch.zeros(6, 7, dtype=torch.long)
    weights, metrics = get_correction(name)(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, **params)
    assert (weights == 0).all()
    for key, value in metrics.items():
        assert value.item() == 0.0, key
    empty = torch.zeros(0, 7, dtype=F64)
    weights, metrics = get_correction(name)(old_logprobs=empty, rollout_logprobs=empty,
                                            response_mask=empty.long(), **params)
    assert weights.shape == (0, 7) and all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,params", CASES)
def test_extreme_log_ratios_stay_finite(name, params, dtype):
    old = torch.tensor([[100.0, -100.0, 0.0], [100.0, 100.0, 0.0], [-100.0, -100.0, -100.0]], dtype=dtype)
    rollout = torch.zeros(3, 3, dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    weights, metrics = get_correction(name)(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, **params)
    assert weights.dtype == (F64 if dtype == F64 else torch.float32)  # at least float32
    assert torch.isfinite(weights).all() and all(torch.isfinite(v) for v in metrics.values())
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(MAX_LOG), rel=1e-6)
    if dtype == F64:
        _check(name, old, rollout, mask, **params)


def test_extreme_log_ratios_hand_worked():
    old = torch.tensor([[100.0, -100.0, 0.0]], dtype=F64)
    rollout = torch.zeros(1, 3, dtype=F64)
    mask = torch.ones(1, 3)
    w, m = token_tis(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, math.exp(-100.0), 1.0]], dtype=F64), rtol=1e-12, atol=0)
    assert m["truncated_frac"].item() == pytest.approx(1 / 3)
    w, m = token_mask(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
    assert w.tolist() == [[0.0, 0.0, 1.0]] and m["masked_frac"].item() == pytest.approx(2 / 3)
    # product: 100 - 100 + 0 = 0 (ratio 1, kept); geometric the same
    for seq_ratio in ("product", "geometric"):
        w, _ = seq_mask(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, seq_ratio=seq_ratio)
        assert w.tolist() == [[1.0, 1.0, 1.0]]


def test_cap_and_band_edges_reached_exactly():
    """A ratio equal to the cap keeps its weight and is not counted as truncated; the band [low, high] is closed."""
    lr = torch.tensor([[0.5, 0.0]], dtype=F64)
    edge = torch.exp(lr[0, 0]).item()  # the ratio exactly as the functions compute it
    zeros, mask = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2)
    for fn in (token_tis, seq_tis):
        w, m = fn(old_logprobs=lr[:, :1], rollout_logprobs=zeros[:, :1], response_mask=mask[:, :1], cap=edge)
        assert w.item() == edge and m["truncated_frac"].item() == 0.0
    w, m = token_tis(old_logprobs=lr, rollout_logprobs=zeros, response_mask=mask, cap=1.0)
    assert w.tolist() == [[1.0, 1.0]] and m["truncated_frac"].item() == 0.5
    w, m = token_mask(old_logprobs=lr, rollout_logprobs=zeros, response_mask=mask, low=0.5, high=edge)
    assert w.tolist() == [[1.0, 1.0]] and m["masked_frac"].item() == 0.0
    low_edge = torch.exp(-lr[0, 0]).item()
    w, m = token_mask(old_logprobs=-lr, rollout_logprobs=zeros, response_mask=mask, low=low_edge, high=2.0)
    assert w.tolist() == [[1.0, 1.0]] and m["masked_frac"].item() == 0.0
    w, m = seq_mask(old_logprobs=lr[:, :1], rollout_logprobs=zeros[:, :1], response_mask=mask[:, :1], high=edge)
    assert w.tolist() == [[1.0]] and m["masked_frac"].item() == 0.0


def test_sequence_ratio_ignores_holes_and_padding():
    """Geometric mean over the valid tokens only: holes must not count in the length."""
    old = torch.tensor([[0.2, 5.0, 0.4, 9.0]], dtype=F64)
    rollout = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0]])
    w, m = seq_tis(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, cap=10.0)
    expected = math.exp((0.2 + 0.4) / 2)
    torch.testing.assert_close(w, torch.tensor([[expected, 0.0, expected, 0.0]], dtype=F64), **TOL)
    assert m["seq_ratio_mean"].item() == pytest.approx(expected, rel=1e-12)
    w, _ = seq_tis(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask, cap=10.0, seq_ratio="product")
    assert w[0, 0].item() == pytest.approx(math.exp(0.6), rel=1e-12)


def test_no_grad_and_float32_promotion():
    old, rollout, mask = _batch(0)
    old = old.float().requires_grad_(True)
    weights, metrics = token_tis(old_logprobs=old, rollout_logprobs=rollout.to(torch.bfloat16), response_mask=mask)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert not any(v.requires_grad for v in metrics.values())


# ---------------------------------------------------------------- argument errors
def _args():
    old, rollout, mask = _batch(0)
    return dict(old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)


@pytest.mark.parametrize("fn", [token_tis, seq_tis])
@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_bad_cap(fn, cap):
    with pytest.raises(ValueError, match=rf"^cap must be > 0 \(the largest weight a token or sequence may get, "
                                         rf"e\.g\. 2\.0\); got {cap}$"):
        fn(**_args(), cap=cap)


@pytest.mark.parametrize("fn", [token_mask, seq_mask])
@pytest.mark.parametrize("low,high", [(1.0, 2.0), (0.5, 1.0), (-0.1, 2.0), (2.0, 0.5), (float("nan"), 2.0)])
def test_bad_band(fn, low, high):
    with pytest.raises(ValueError, match=rf"^the band must satisfy 0 <= low < 1 < high \(ratios pi_old / pi_rollout "
                                         rf"inside it are kept, e\.g\. low=0\.5, high=2\.0\); got low={low}, "
                                         rf"high={high}$"):
        fn(**_args(), low=low, high=high)


@pytest.mark.parametrize("fn", [seq_mask, seq_tis])
def test_bad_seq_ratio(fn):
    with pytest.raises(ValueError, match=r"^seq_ratio must be 'geometric' \(exp of the mean token log ratio\) or "
                                         r"'product' \(exp of the sum\); got 'arithmetic'$"):
        fn(**_args(), seq_ratio="arithmetic")


@pytest.mark.parametrize("name", ["token_tis", "token_mask", "seq_mask", "seq_tis"])
def test_shape_mismatch(name):
    args = _args()
    args["rollout_logprobs"] = args["rollout_logprobs"][:, :5]
    with pytest.raises(ValueError, match=r"^rollout_logprobs must be \[B, T\] like response_mask \(6, 7\); "
                                         r"got \(6, 5\)$"):
        get_correction(name)(**args)


def test_keyword_only():
    old, rollout, mask = _batch(0)
    with pytest.raises(TypeError):
        token_tis(old, rollout, mask)


# ---------------------------------------------------------------- registry
def test_registered_names():
    assert list_corrections() == ["seq_mask", "seq_tis", "token_mask", "token_tis"]
    assert get_correction("token_tis") is token_tis and get_correction("seq_mask") is seq_mask


@pytest.mark.parametrize("name", ["token_tis", "token_mask", "seq_mask", "seq_tis"])
def test_one_bundle_routes_to_every_correction(name):
    bundle = dict(_args(), cap=1.1, low=0.9, high=1.1, weight_by_ratio=True, seq_ratio="product")
    weights, metrics = compute_correction(name, **bundle)
    direct = get_correction(name)
    accepted = registry._PARAMS[direct]
    ref_w, ref_m = direct(**{k: v for k, v in bundle.items() if k in accepted})
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=0)
    assert metrics.keys() == ref_m.keys()
    _check(name, bundle["old_logprobs"], bundle["rollout_logprobs"], bundle["response_mask"],
           **{k: v for k, v in bundle.items() if k in accepted and k not in _args()})


def test_unknown_name_typo_and_missing_input():
    with pytest.raises(ValueError, match=r"^unknown off-policy correction 'tis'; known: seq_mask, seq_tis, token_mask, "
                                         r"token_tis$"):
        compute_correction("tis", **_args())
    with pytest.raises(ValueError, match=r"^unknown keyword argument\(s\) \['cap_'\] for off-policy correction "
                                         r"'token_tis'"):
        compute_correction("token_tis", cap_=2.0, **_args())
    args = _args()
    args["rollout_logprobs"] = None
    with pytest.raises(ValueError, match=r"^off-policy correction 'seq_tis' needs rollout_logprobs= "):
        compute_correction("seq_tis", **args)
    with pytest.raises(ValueError, match=r"^off-policy correction 'token_tis' is already registered"):
        registry.register_correction("token_tis")(lambda *, response_mask: response_mask)
