"""Policy losses, entropy and TIS weights against explicit loops, hand-worked values and analytic gradients.

float64 throughout; the references sum the same terms in another order, hence 1e-12.
"""

import math

import pytest
import torch

from mcore_rl.algorithms import (
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    pg_policy_loss,
    ppo_policy_loss,
    truncated_importance_weights,
)

from .helpers import fill_padding, mask_from_lengths, pad_right

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def _batch(seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths([4, 6, 0, 1, 6], 6, {1: [2]})
    old = -torch.rand(5, 6, generator=g, dtype=F64) * 2
    lp = old + spread * torch.randn(5, 6, generator=g, dtype=F64)
    adv = torch.randn(5, 6, generator=g, dtype=F64)
    return lp, old, adv, mask


# ---------------------------------------------------------------- PPO
def test_ppo_hand_worked_clip_higher_and_dual_clip():
    ratios = [1.5, 0.5, 1.5, 4.0]
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=F64)
    old = torch.zeros(1, 4, dtype=F64)
    lp = torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    loss, m = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=torch.ones(1, 4),
                              clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # per token: max(-1.5, -1.28) = -1.28 | max(0.5, 0.8) = 0.8 | max(1.5, 1.2) = 1.5 | min(max(4, 1.2), 3) = 3
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 1.5 + 3.0) / 4, abs=1e-12)
    loss.backward()
    # only token 2 (unclipped, A < 0) has a gradient: d(-A r)/d logprob = -A r = 1.5
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 1.5 / 4, 0.0]], dtype=F64), **TOL)
    assert m["clip_frac_high"].item() == 0.25 and m["clip_frac_low"].item() == 0.25
    assert m["clip_frac"].item() == 0.5 and m["dual_clip_frac"].item() == 0.25
    assert m["ratio_mean"].item() == pytest.approx(7.5 / 4) and m["ratio_max"].item() == pytest.approx(4.0)
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 4)
    assert m["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 4)


def naive_ppo(lp, old, adv, mask, lo, hi, c):
    """Per-token loss and analytic d loss / d logprob, by cases."""
    losses, grads = {}, {}
    for i in range(len(mask)):
        for t in range(len(mask[i])):
            if not mask[i][t]:
                continue
            a, r = adv[i][t], math.exp(lp[i][t] - old[i][t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            loss, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if c is not None and a < 0 and -a * c < loss:
                loss, grad = -a * c, 0.0
            losses[i, t], grads[i, t] = loss, grad
    return losses, grads


@pytest.mark.parametrize("clip_ratio_c", [None, 1.5])
def test_ppo_matches_naive_loss_and_gradient(clip_ratio_c):
    lp, old, adv, mask = _batch(spread=0.6)
    leaf = fill_padding(lp, mask).requires_grad_(True)
    loss, m = ppo_policy_loss(logprobs=leaf, old_logprobs=fill_padding(old, mask), advantages=fill_padding(adv, mask),
                              response_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=clip_ratio_c)
    loss.backward()
    losses, grads = naive_ppo(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.3, clip_ratio_c)
    n = len(losses)
    assert loss.item() == pytest.approx(sum(losses.values()) / n, rel=1e-12)
    expected = torch.zeros(5, 6, dtype=F64)
    for (i, t), g in grads.items():
        expected[i, t] = g / n
    torch.testing.assert_close(leaf.grad, expected, **TOL)  # also: exactly 0 (not NaN) on NaN padding
    assert 0 < m["clip_frac"].item() < 1  # the batch exercises both branches
    if clip_ratio_c is not None:
        assert m["dual_clip_frac"].item() > 0


def test_ppo_at_old_policy_is_minus_mean_advantage():
    lp, _, adv, mask = _batch()
    loss, m = ppo_policy_loss(logprobs=lp, old_logprobs=lp, advantages=adv, response_mask=mask)
    assert loss.item() == pytest.approx(-adv[mask.bool()].mean().item(), rel=1e-12)
    assert m["clip_frac"].item() == 0 and m["approx_kl"].item() == 0 and m["ratio_mean"].item() == 1


def test_token_weights_scale_each_token():
    lp, old, adv, mask = _batch()
    w = torch.rand(5, 6, dtype=F64)
    weighted, _ = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, token_weights=w,
                                  loss_agg_mode="seq-mean-token-sum")
    per_tok, _ = ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv * w, response_mask=mask,
                                 clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(weighted, per_tok, **TOL)  # w >= 0 commutes with the clipped max


# ---------------------------------------------------------------- GSPO
def test_gspo_matches_sequence_level_objective_and_gradient():
    lp, old, _, mask = _batch(spread=0.05)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3], dtype=F64)
    adv = seq_adv[:, None].expand(5, 6).contiguous()
    leaf = fill_padding(lp, mask).requires_grad_(True)
    loss, m = gspo_policy_loss(logprobs=leaf, old_logprobs=fill_padding(old, mask), advantages=fill_padding(adv, mask),
                               response_mask=mask, clip_ratio_low=0.01, clip_ratio_high=0.02)
    loss.backward()

    # the paper's sequence objective, one sequence at a time
    ref_leaf = lp.clone().requires_grad_(True)
    terms = []
    for i in range(5):
        idx = [t for t in range(6) if mask[i, t]]
        if not idx:
            continue
        s = torch.exp(sum(ref_leaf[i, t] - old[i, t] for t in idx) / len(idx))
        a = seq_adv[i]
        terms.append(-torch.minimum(s * a, s.clamp(1 - 0.01, 1 + 0.02) * a))
    ref_loss = sum(terms) / len(terms)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, **TOL)
    assert 0 < m["clip_frac"].item() < 1  # some sequences are clipped, some are not
    expected_seq_ratio = [math.exp(sum(lp[i, t] - old[i, t] for t in range(6) if mask[i, t]) / mask[i].sum())
                          for i in range(5) if mask[i].any()]
    assert m["seq_ratio_mean"].item() == pytest.approx(sum(expected_seq_ratio) / 4, rel=1e-12)


# ---------------------------------------------------------------- vanilla PG
def test_pg_matches_naive_loss_and_gradient():
    lp, old, adv, mask = _batch()
    leaf = fill_padding(lp, mask).requires_grad_(True)
    loss, m = pg_policy_loss(logprobs=leaf, advantages=fill_padding(adv, mask), response_mask=mask,
                             loss_agg_mode="seq-mean-token-mean", old_logprobs=old)
    loss.backward()
    rows = [[t for t in range(6) if mask[i, t]] for i in range(5)]
    nonempty = [i for i in range(5) if rows[i]]
    expected = sum(sum(-adv[i, t].item() * lp[i, t].item() for t in rows[i]) / len(rows[i]) for i in nonempty) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    grad = torch.zeros(5, 6, dtype=F64)
    for i in nonempty:
        for t in rows[i]:
            grad[i, t] = -adv[i, t] / len(rows[i]) / len(nonempty)
    torch.testing.assert_close(leaf.grad, grad, **TOL)
    assert set(m) == {"ppo_kl", "approx_kl"}


# ---------------------------------------------------------------- padding, edge cases, errors
@pytest.mark.parametrize("fn", [ppo_policy_loss, gspo_policy_loss, pg_policy_loss])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_padding_never_changes_loss_or_metrics(fn, mode):
    lp, old, adv, mask = _batch()
    kwargs = dict(old_logprobs=old, advantages=adv) if fn is not pg_policy_loss else dict(advantages=adv)
    ref_loss, ref_m = fn(logprobs=lp, response_mask=mask, loss_agg_mode=mode, **kwargs)
    wide_mask = pad_right(mask, 2, 0)
    padded = {k: pad_right(fill_padding(v, mask), 2) for k, v in kwargs.items()}
    leaf = pad_right(fill_padding(lp, mask), 2).requires_grad_(True)
    loss, m = fn(logprobs=leaf, response_mask=wide_mask, loss_agg_mode=mode, **padded)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert set(m) == set(ref_m)
    for k in m:
        torch.testing.assert_close(m[k], ref_m[k], **TOL)
        assert not m[k].requires_grad and m[k].dim() == 0
    assert (leaf.grad[wide_mask == 0] == 0).all()


@pytest.mark.parametrize("fn", [ppo_policy_loss, gspo_policy_loss, pg_policy_loss])
def test_empty_and_zero_length_batches_are_finite(fn):
    for mask in (torch.zeros(3, 4), torch.zeros(0, 4)):
        b = mask.shape[0]
        leaf = torch.full((b, 4), float("nan"), dtype=F64, requires_grad=True)
        kwargs = dict(advantages=torch.full((b, 4), float("nan"), dtype=F64))
        if fn is not pg_policy_loss:
            kwargs["old_logprobs"] = torch.full((b, 4), float("nan"), dtype=F64)
        loss, m = fn(logprobs=leaf, response_mask=mask, **kwargs)
        loss.backward()
        assert loss.item() == 0.0 and (leaf.grad == 0).all()
        assert all(torch.isfinite(v) for v in m.values())


def test_extreme_log_ratios_stay_finite_in_float32():
    lp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    loss, m = ppo_policy_loss(logprobs=lp, old_logprobs=torch.zeros(1, 2), advantages=torch.tensor([[-1.0, 1.0]]),
                              response_mask=torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_argument_errors_have_messages():
    lp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match=r"^clip_ratio_c \(dual-clip bound\) must be > 1 or None to disable"):
        ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_c=0.9)
    with pytest.raises(ValueError, match=r"^clip_ratio_low must be in \[0, 1\]"):
        ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_low=1.5)
    with pytest.raises(ValueError, match=r"^clip_ratio_high must be >= 0; got -0.1$"):
        gspo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv, response_mask=mask, clip_ratio_high=-0.1)
    with pytest.raises(ValueError, match=r"^advantages must be \[B, T\] like response_mask \(5, 6\); got \(5, 5\)$"):
        ppo_policy_loss(logprobs=lp, old_logprobs=old, advantages=adv[:, :5], response_mask=mask)


# ---------------------------------------------------------------- entropy
def naive_entropy(logits_row):
    z = max(logits_row)
    exps = [math.exp(v - z) for v in logits_row]
    total = sum(exps)
    return -sum(e / total * math.log(e / total) for e in exps)


def test_entropy_from_logits_matches_naive_and_bounds():
    logits = torch.randn(2, 3, 7, dtype=F64) * 3
    h = entropy_from_logits(logits)
    for i in range(2):
        for t in range(3):
            assert h[i, t].item() == pytest.approx(naive_entropy(logits[i, t].tolist()), rel=1e-12)
    uniform = entropy_from_logits(torch.zeros(1, 1, 50))
    assert uniform.item() == pytest.approx(math.log(50), rel=1e-6)
    assert entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_entropy_bonus_from_logits_or_entropy():
    logits = torch.randn(3, 4, 5, dtype=F64, requires_grad=True)
    mask = mask_from_lengths([4, 0, 2], 4)
    a = entropy_bonus(mask, logits=logits, loss_agg_mode="seq-mean-token-mean")
    h = entropy_from_logits(logits.detach())
    expected = (h[0].mean() + h[2, :2].mean()) / 2
    torch.testing.assert_close(a, expected, **TOL)
    b = entropy_bonus(mask, entropy=h, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(a, b, **TOL)
    a.backward()
    assert (logits.grad[1] == 0).all() and logits.grad[0].abs().sum() > 0
    with pytest.raises(ValueError, match=r"^entropy_bonus needs exactly one of entropy="):
        entropy_bonus(mask)
    with pytest.raises(ValueError, match=r"^entropy_bonus needs exactly one of entropy="):
        entropy_bonus(mask, entropy=h, logits=logits)


# ---------------------------------------------------------------- truncated importance sampling
def test_truncated_importance_weights_hand_worked():
    old = torch.tensor([[0.0, 0.0, 0.0, 5.0]], dtype=F64)
    rollout = torch.tensor([[0.0, math.log(2.0), -math.log(3.0), float("nan")]], dtype=F64)
    w = truncated_importance_weights(old, rollout, torch.tensor([[1, 1, 1, 0]]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 2.0, 0.0]], dtype=F64), **TOL)  # 3 capped at 2
    with pytest.raises(ValueError, match=r"^cap must be > 0; got 0$"):
        truncated_importance_weights(old, rollout, torch.ones(1, 4), cap=0)
