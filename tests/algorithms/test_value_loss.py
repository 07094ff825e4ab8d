"""Clipped value loss against explicit loops and analytic gradients (float64, 1e-12)."""

import pytest
import torch

from mcore_rl.algorithms import value_loss

from .helpers import fill_padding, mask_from_lengths, pad_right

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths([3, 5, 0, 2], 5, {1: [1]})
    old = torch.randn(4, 5, generator=g, dtype=F64)
    values = old + 0.5 * torch.randn(4, 5, generator=g, dtype=F64)
    returns = torch.randn(4, 5, generator=g, dtype=F64)
    return values, old, returns, mask


def test_hand_worked_clipping():
    values = torch.tensor([[1.0, 0.0, 0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    returns = torch.tensor([[2.0, 1.0, -1.0]], dtype=F64)
    loss, m = value_loss(values, old, returns, torch.ones(1, 3), cliprange_value=0.2)
    # token 0: max((1-2)^2, (0.2-2)^2) = 3.24 (clipped); token 1: 1; token 2: max(2.25, (0.2+1)^2 = 1.44) = 2.25
    assert loss.item() == pytest.approx(0.5 * (3.24 + 1.0 + 2.25) / 3, abs=1e-12)
    loss.backward()
    # gradients: token 0 flows through the clipped branch, which is constant in values -> 0;
    # token 1: (v - R) / 3 = -1/3; token 2: (0.5 + 1) / 3 = 0.5
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.0 / 3, 0.5]], dtype=F64), **TOL)
    assert m["vf_clip_frac"].item() == pytest.approx(1.0 / 3)


@pytest.mark.parametrize("cliprange_value", [None, 0.2])
def test_matches_naive_loss_and_gradient(cliprange_value):
    values, old, returns, mask = _batch()
    leaf = fill_padding(values, mask).requires_grad_(True)
    loss, m = value_loss(leaf, fill_padding(old, mask), fill_padding(returns, mask), mask,
                         cliprange_value=cliprange_value, loss_agg_mode="seq-mean-token-sum")
    loss.backward()
    seqs = [[t for t in range(5) if mask[i, t]] for i in range(4)]
    nonempty = [i for i in range(4) if seqs[i]]
    expected_loss, grad = 0.0, torch.zeros(4, 5, dtype=F64)
    for i in nonempty:
        for t in seqs[i]:
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            err, g = (v - r) ** 2, 2 * (v - r)
            if cliprange_value is not None:
                vc = o + min(max(v - o, -cliprange_value), cliprange_value)
                inside = abs(v - o) < cliprange_value
                if (vc - r) ** 2 > err:
                    err, g = (vc - r) ** 2, (2 * (vc - r) if inside else 0.0)
            expected_loss += 0.5 * err / len(nonempty)
            grad[i, t] = 0.5 * g / len(nonempty)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(leaf.grad, grad, **TOL)
    if cliprange_value is not None:
        assert 0 < m["vf_clip_frac"].item() < 1


def test_metrics_and_padding():
    values, old, returns, mask = _batch(1)
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.3)
    loss_p, m_p = value_loss(pad_right(fill_padding(values, mask), 2), pad_right(fill_padding(old, mask), 2),
                             pad_right(fill_padding(returns, mask), 2), pad_right(mask, 2, 0), cliprange_value=0.3)
    torch.testing.assert_close(loss_p, loss, **TOL)
    for k in m:
        torch.testing.assert_close(m_p[k], m[k], **TOL)
    v, r = values[mask.bool()], returns[mask.bool()]
    assert m["vpred_mean"].item() == pytest.approx(v.mean().item(), rel=1e-12)
    assert m["explained_variance"].item() == pytest.approx(1 - (r - v).var().item() / r.var().item(), rel=1e-12)
    perfect, mp = value_loss(returns, returns, returns, mask)
    assert perfect.item() == 0.0 and mp["explained_variance"].item() == pytest.approx(1.0)


def test_empty_mask_is_finite_and_errors_have_messages():
    nan = torch.full((2, 3), float("nan"), dtype=F64)
    loss, m = value_loss(nan.clone().requires_grad_(True), nan, nan, torch.zeros(2, 3), cliprange_value=0.2)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match=r"^cliprange_value must be >= 0 or None; got -1$"):
        value_loss(nan, nan, nan, torch.ones(2, 3), cliprange_value=-1)
    with pytest.raises(ValueError, match=r"^returns must be \[B, T\] like response_mask \(2, 3\); got \(2, 2\)$"):
        value_loss(nan, nan, nan[:, :2], torch.ones(2, 3))
