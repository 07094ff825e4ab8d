"""KL estimators, KL in the reward and in the loss, and the KL controllers / LR monitor."""

import math

import pytest
import torch

from mcore_rl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLLRMonitor,
    apply_kl_penalty,
    estimate_kl,
    kl_loss,
)

from .helpers import fill_padding, mask_from_lengths, pad_right

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def naive_kl(logp, ref, estimator):
    log_r = ref - logp
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1 - log_r}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_match_formulas(estimator):
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=F64)
    out = estimate_kl(logp, ref, estimator)
    for t in range(3):
        assert out[0, t].item() == pytest.approx(naive_kl(logp[0, t].item(), ref[0, t].item(), estimator), rel=1e-12)
    assert out[0, 2].item() == 0.0  # identical distributions


def test_estimators_are_unbiased_or_not_as_documented():
    """p = N(0, 1) policy, q = N(0.5, 1) reference: KL(p||q) = 0.125. k1 and k3 unbiased, k2 biased (slightly)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=g, dtype=F64)
    logp = -0.5 * x**2
    ref = -0.5 * (x - 0.5) ** 2
    # standard error of the k1 mean is 0.5 / sqrt(4e5) ~ 8e-4; 5 sigma
    assert estimate_kl(logp, ref, "k1").mean().item() == pytest.approx(0.125, abs=4e-3)
    assert estimate_kl(logp, ref, "k3").mean().item() == pytest.approx(0.125, abs=4e-3)
    assert (estimate_kl(logp, ref, "k3") >= 0).all() and (estimate_kl(logp, ref, "k2") >= 0).all()
    assert estimate_kl(logp, ref, "k3").std() < estimate_kl(logp, ref, "k1").std()


def test_clamping():
    logp = torch.tensor([0.0, 0.0, 0.0], dtype=F64)
    ref = torch.tensor([30.0, -3.0, 0.1], dtype=F64)
    out = estimate_kl(logp, ref, "k3", clamp=10.0)
    assert out[0].item() == 10.0  # exp(20) - 21 before the clamp: the log-ratio is first bounded to 20
    assert out[1].item() == pytest.approx(math.exp(-3) - 1 + 3, rel=1e-12)
    assert estimate_kl(logp, ref, "k1", clamp=2.0).tolist() == [-2.0, 2.0, -0.1]
    big = estimate_kl(torch.zeros(1), torch.tensor([500.0]), "k3")
    assert big.item() == pytest.approx(math.exp(20) - 21)  # finite even without clamp


def test_k2_gradient_is_the_kl_gradient_on_policy():
    """For a categorical policy, the expected gradient of k2 over y ~ pi equals grad KL(pi || ref) exactly."""
    logits = torch.tensor([0.3, -0.2, 1.0], dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5], dtype=F64), 0)
    logp = torch.log_softmax(logits, 0)
    p = logp.exp().detach()
    (p * estimate_kl(logp, ref, "k2")).sum().backward()  # E_{y~pi}[grad k2], samples held fixed
    grad_k2 = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits, 0)
    (logp.exp() * (logp - ref)).sum().backward()
    torch.testing.assert_close(grad_k2, logits.grad, **TOL)


def test_unknown_estimator_message():
    with pytest.raises(ValueError, match=r"^unknown KL estimator 'low_var_kl'; known: k1, k2, k3$"):
        estimate_kl(torch.zeros(1), torch.zeros(1), "low_var_kl")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths([3, 0, 4, 1], 4, {2: [1]})
    logp = -torch.rand(4, 4, generator=g, dtype=F64)
    ref = logp + 0.3 * torch.randn(4, 4, generator=g, dtype=F64)
    rewards = torch.randn(4, 4, generator=g, dtype=F64)
    return rewards, logp, ref, mask


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_apply_kl_penalty_matches_naive(estimator):
    rewards, logp, ref, mask = _batch()
    out, m = apply_kl_penalty(fill_padding(rewards, mask), fill_padding(logp, mask), fill_padding(ref, mask), mask,
                              kl_coef=0.05, estimator=estimator)
    kls, seq_sums = [], []
    expected = torch.zeros(4, 4, dtype=F64)
    for i in range(4):
        row = []
        for t in range(4):
            if mask[i, t]:
                kl = naive_kl(logp[i, t].item(), ref[i, t].item(), estimator)
                expected[i, t] = rewards[i, t].item() - 0.05 * kl
                row.append(kl)
        kls += row
        if row:
            seq_sums.append(sum(row))
    torch.testing.assert_close(out, expected, **TOL)
    assert m["kl"].item() == pytest.approx(sum(kls) / len(kls), rel=1e-12)
    assert m["kl_seq"].item() == pytest.approx(sum(seq_sums) / len(seq_sums), rel=1e-12)
    assert m["kl_coef"].item() == pytest.approx(0.05)


def test_kl_loss_matches_naive_and_ignores_padding():
    _, logp, ref, mask = _batch(1)
    leaf = pad_right(fill_padding(logp, mask), 2).requires_grad_(True)
    loss, m = kl_loss(leaf, pad_right(fill_padding(ref, mask), 2), pad_right(mask, 2, 0), estimator="k3",
                      loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    seqs = [[t for t in range(4) if mask[i, t]] for i in range(4)]
    nonempty = [i for i in range(4) if seqs[i]]
    expected = sum(sum(naive_kl(logp[i, t].item(), ref[i, t].item(), "k3") for t in seqs[i]) / len(seqs[i])
                   for i in nonempty) / len(nonempty)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # d k3 / d logp = 1 - exp(ref - logp)
    grad = torch.zeros(4, 6, dtype=F64)
    for i in nonempty:
        for t in seqs[i]:
            grad[i, t] = (1 - math.exp(ref[i, t].item() - logp[i, t].item())) / len(seqs[i]) / len(nonempty)
    torch.testing.assert_close(leaf.grad, grad, **TOL)
    assert m["kl"] > 0


def test_fixed_controller():
    c = FixedKLController(0.1)
    c.update(100.0, 64)
    assert c.value == 0.1
    c2 = FixedKLController(0.5)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.1
    with pytest.raises(ValueError, match=r"^kl_coef must be >= 0; got -1$"):
        FixedKLController(-1)


def test_adaptive_controller_hand_computation():
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    c.update(current_kl=7.2, n_steps=256)  # error = 7.2 / 6 - 1 = 0.2
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000), rel=1e-15)
    c.update(current_kl=torch.tensor(60.0), n_steps=256)  # error clipped to +0.2
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 0.0256) ** 2, rel=1e-15)
    c.update(current_kl=3.0, n_steps=1000)  # error = -0.5, clipped to -0.2
    v = 0.2 * (1 + 0.2 * 0.0256) ** 2 * (1 - 0.2 * 0.1)
    assert c.value == pytest.approx(v, rel=1e-15)
    c.update(current_kl=5.4, n_steps=500)  # error = -0.1
    v *= 1 - 0.1 * 0.05
    assert c.value == pytest.approx(v, rel=1e-15)


def test_adaptive_controller_resume_is_exact():
    kls = [7.0, 5.0, 9.0, 6.5, 1.0, 12.0]
    straight = AdaptiveKLController(0.1, 6.0, 1000)
    for kl in kls:
        straight.update(kl, 64)
    first = AdaptiveKLController(0.1, 6.0, 1000)
    for kl in kls[:3]:
        first.update(kl, 64)
    resumed = AdaptiveKLController(0.1, 6.0, 1000)
    resumed.load_state_dict(first.state_dict())
    for kl in kls[3:]:
        resumed.update(kl, 64)
    assert resumed.value == straight.value


def test_controller_errors_have_messages():
    with pytest.raises(ValueError, match=r"^target_kl must be > 0; got 0$"):
        AdaptiveKLController(0.1, 0, 100)
    with pytest.raises(ValueError, match=r"^horizon must be > 0; got -5$"):
        AdaptiveKLController(0.1, 1.0, -5)
    c = AdaptiveKLController(0.1, 1.0, 100)
    with pytest.raises(ValueError, match=r"^current_kl must be finite; got nan"):
        c.update(float("nan"), 8)
    with pytest.raises(ValueError, match=r"^n_steps \(500\) must be < horizon / 0.2 = 500, or the KL coefficient"):
        c.update(1.0, 500)
    with pytest.raises(ValueError, match=r"load_state_dict: missing \['value'\]; got keys \['kl_coef'\]"):
        c.load_state_dict({"kl_coef": 0.3})


def test_lr_monitor_rule_floor_and_resume():
    mon = KLLRMonitor(kl_target=0.1, decay_factor=0.5, min_lr_multiplier=0.2)
    assert mon.update(0.05) == 1.0 and not mon.decayed
    assert mon.update(0.1) == 1.0  # equal is not above the target
    assert mon.update(0.11) == 0.5 and mon.decayed
    assert mon.update(torch.tensor(0.3)) == 0.25
    state = mon.state_dict()
    assert mon.update(0.3) == 0.2 and mon.decayed  # floor
    assert mon.update(0.3) == 0.2 and not mon.decayed and mon.num_exceeded == 4
    assert mon.update(0.0) == 0.2  # never increases again
    resumed = KLLRMonitor(kl_target=0.1, decay_factor=0.5, min_lr_multiplier=0.2)
    resumed.load_state_dict(state)
    assert resumed.lr_multiplier == 0.25 and resumed.num_exceeded == 2
    assert resumed.update(0.3) == 0.2


def test_lr_monitor_errors():
    with pytest.raises(ValueError, match=r"^kl_target must be > 0; got 0$"):
        KLLRMonitor(0)
    with pytest.raises(ValueError, match=r"^decay_factor must be in \(0, 1\]; got 1.5$"):
        KLLRMonitor(0.1, decay_factor=1.5)
    with pytest.raises(ValueError, match=r"^min_lr_multiplier must be in \[0, 1\]; got 2$"):
        KLLRMonitor(0.1, min_lr_multiplier=2)
    with pytest.raises(ValueError, match=r"^measured_kl must be finite; got inf"):
        KLLRMonitor(0.1).update(float("inf"))
