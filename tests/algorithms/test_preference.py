"""DPO / cDPO / IPO / KTO against the papers' formulas written with `math`, and their analytic gradients."""

import math

import pytest
import torch

from mcore_rl.algorithms import dpo_loss, kto_kl_reference_point, kto_loss

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _pairs(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return [-10 * torch.rand(n, generator=g, dtype=F64) for _ in range(4)]  # pc, pr, rc, rr


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_sigmoid_matches_formula_and_gradient(label_smoothing):
    pc, pr, rc, rr = _pairs()
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    beta, eps, n = 0.3, label_smoothing, 6
    loss, m = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    loss.backward()
    expected, grad_c = 0.0, []
    for i in range(n):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        expected += (-(1 - eps) * math.log(sigmoid(beta * h)) - eps * math.log(sigmoid(-beta * h))) / n
        grad_c.append((-(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h)) / n)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(pc.grad, torch.tensor(grad_c, dtype=F64), **TOL)
    torch.testing.assert_close(pr.grad, -torch.tensor(grad_c, dtype=F64), **TOL)
    chosen = [beta * (pc[i].item() - rc[i].item()) for i in range(n)]
    rejected = [beta * (pr[i].item() - rr[i].item()) for i in range(n)]
    assert m["rewards_chosen"].item() == pytest.approx(sum(chosen) / n, rel=1e-12)
    assert m["reward_margin"].item() == pytest.approx((sum(chosen) - sum(rejected)) / n, rel=1e-12)
    assert m["reward_accuracy"].item() == sum(c > r for c, r in zip(chosen, rejected)) / n


def test_dpo_hand_worked():
    zero = torch.zeros(2, dtype=F64)
    loss, m = dpo_loss(torch.tensor([1.0, 0.0], dtype=F64), zero, zero, zero, beta=1.0)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2, rel=1e-12)
    assert m["reward_accuracy"].item() == 0.5  # the tie does not count as correct
    assert m["reward_margin"].item() == pytest.approx(0.5)


def test_ipo_matches_formula_and_gradient():
    pc, pr, rc, rr = _pairs(1)
    pc.requires_grad_(True)
    beta = 0.5
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
    loss.backward()
    hs = [(pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()) for i in range(6)]
    assert loss.item() == pytest.approx(sum((h - 1 / (2 * beta)) ** 2 for h in hs) / 6, rel=1e-12)
    torch.testing.assert_close(pc.grad, torch.tensor([2 * (h - 1.0) / 6 for h in hs], dtype=F64), **TOL)


def test_dpo_micro_batches_sum_to_full_loss():
    pc, pr, rc, rr = _pairs(2, n=7)
    full, _ = dpo_loss(pc, pr, rc, rr, beta=0.2, label_smoothing=0.05)
    parts = [dpo_loss(pc[s], pr[s], rc[s], rr[s], beta=0.2, label_smoothing=0.05, global_num_pairs=7)[0]
             for s in (slice(0, 3), slice(3, 4), slice(4, 7))]
    torch.testing.assert_close(sum(parts), full, **TOL)


def test_dpo_reference_gets_no_gradient_and_empty_batch_is_finite():
    pc, pr, rc, rr = _pairs(3)
    rc.requires_grad_(True)
    loss, _ = dpo_loss(pc, pr, rc, rr)
    assert not loss.requires_grad  # only the reference requires grad, and it is detached
    empty = torch.zeros(0, dtype=F64)
    loss, m = dpo_loss(empty, empty, empty, empty)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())


def test_dpo_errors_have_messages():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=r"^unknown loss_type 'hinge'; known: sigmoid, ipo$"):
        dpo_loss(x, x, x, x, loss_type="hinge")
    with pytest.raises(ValueError, match=r"^label_smoothing \(0.1\) applies to loss_type 'sigmoid' only, not 'ipo'$"):
        dpo_loss(x, x, x, x, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"^label_smoothing must be in \[0, 0.5\); got 0.5$"):
        dpo_loss(x, x, x, x, label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"^beta must be > 0; got 0$"):
        dpo_loss(x, x, x, x, beta=0)
    with pytest.raises(ValueError, match=r"^dpo_loss inputs must all be \[B\]; got shapes \[\(2,\), \(3,\)\]$"):
        dpo_loss(x, torch.zeros(3), x, x)


@pytest.mark.parametrize("z0_in", [0.7, -0.3])
def test_kto_matches_formula_and_gradient(z0_in):
    g = torch.Generator().manual_seed(4)
    pc, rc = -5 * torch.rand(4, generator=g, dtype=F64), -5 * torch.rand(4, generator=g, dtype=F64)
    pr, rr = -5 * torch.rand(3, generator=g, dtype=F64), -5 * torch.rand(3, generator=g, dtype=F64)
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    beta, lam_d, lam_u = 0.2, 1.0, 1.33
    loss, m = kto_loss(pc, pr, rc, rr, torch.tensor(z0_in, dtype=F64), beta=beta, desirable_weight=lam_d,
                       undesirable_weight=lam_u)
    loss.backward()
    z0 = max(z0_in, 0.0)  # the paper's reference point is never negative
    total, grad_c, grad_r = 0.0, [], []
    for i in range(4):
        x = beta * ((pc[i].item() - rc[i].item()) - z0)
        total += lam_d * (1 - sigmoid(x))
        grad_c.append(-lam_d * beta * sigmoid(x) * (1 - sigmoid(x)) / 7)
    for i in range(3):
        y = beta * (z0 - (pr[i].item() - rr[i].item()))
        total += lam_u * (1 - sigmoid(y))
        grad_r.append(lam_u * beta * sigmoid(y) * (1 - sigmoid(y)) / 7)
    assert loss.item() == pytest.approx(total / 7, rel=1e-12)
    torch.testing.assert_close(pc.grad, torch.tensor(grad_c, dtype=F64), **TOL)
    torch.testing.assert_close(pr.grad, torch.tensor(grad_r, dtype=F64), **TOL)
    assert m["kl_ref_point"].item() == z0


def test_kto_one_sided_batches_and_reference_point():
    pc, rc = torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-1.5, -2.0], dtype=F64)
    empty = torch.zeros(0, dtype=F64)
    loss, m = kto_loss(pc, empty, rc, empty, 0.0, beta=1.0)
    assert loss.item() == pytest.approx(((1 - sigmoid(0.5)) + 0.5) / 2, rel=1e-12)
    assert m["rewards_rejected"].item() == 0.0
    loss, _ = kto_loss(empty, empty, empty, empty, 0.0)
    assert loss.item() == 0.0
    z0 = kto_kl_reference_point(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.5]))
    assert z0.item() == pytest.approx((1.0 - 0.5) / 2) and not z0.requires_grad
    assert kto_kl_reference_point(torch.tensor([-3.0]), torch.tensor([-1.0])).item() == 0.0


def test_kto_micro_batches_sum_and_errors():
    g = torch.Generator().manual_seed(5)
    pc, rc, pr, rr = (-3 * torch.rand(4, generator=g, dtype=F64) for _ in range(4))
    full, _ = kto_loss(pc, pr, rc, rr, 0.2)
    parts = [kto_loss(pc[s], pr[s], rc[s], rr[s], 0.2, global_num_examples=8)[0] for s in (slice(0, 1), slice(1, 4))]
    torch.testing.assert_close(sum(parts), full, **TOL)
    with pytest.raises(ValueError, match=r"^policy/ref shapes must match: chosen \(4,\) vs \(3,\)"):
        kto_loss(pc, pr, rc[:3], rr, 0.0)
    with pytest.raises(ValueError, match=r"^desirable_weight \(-1\) and undesirable_weight \(1.0\) must be >= 0$"):
        kto_loss(pc, pr, rc, rr, 0.0, desirable_weight=-1)
