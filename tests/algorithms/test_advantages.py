"""Advantage estimators against explicit-loop implementations and hand-worked values (float64, tolerance 1e-12:
the two sides differ only in summation order)."""

import math
import statistics

import pytest
import torch

from mcore_rl.algorithms import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    group_statistics,
    grpo_advantages,
    reinforce_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)

from .helpers import fill_padding, mask_from_lengths, pad_right

TOL = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


# ---------------------------------------------------------------- naive references (plain Python loops)
def naive_whiten(x, mask):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    out = [[0.0] * len(row) for row in x]
    for i in range(len(x)):
        for t in range(len(x[i])):
            if mask[i][t]:
                out[i][t] = (x[i][t] - mean) / math.sqrt(var + 1e-8)
    return out


def naive_gae(rewards, values, mask, gamma, lam):
    """Standard GAE on the compressed sequence of valid tokens of each row."""
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        idx = [t for t in range(len(rewards[i])) if mask[i][t]]
        gae = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = values[i][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            gae = delta + gamma * lam * gae
            adv[i][t] = gae
            ret[i][t] = gae + values[i][t]
    return adv, ret


def naive_returns(rewards, mask, gamma):
    out = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        running = 0.0
        for t in reversed(range(len(rewards[i]))):
            if mask[i][t]:
                running = rewards[i][t] + gamma * running
                out[i][t] = running
    return out


def naive_group_adv(scores, groups, kind, eps=1e-6):
    out = []
    for i, r in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        mean = sum(members) / len(members)
        if kind == "grpo":
            std = statistics.stdev(members) if len(members) > 1 else 0.0
            out.append((r - mean) / (std + eps))
        elif kind == "dr_grpo":
            out.append(r - mean)
        elif kind == "rloo":
            out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def broadcast(seq_adv, mask):
    return [[seq_adv[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(len(mask))]


# ---------------------------------------------------------------- fixtures
LENGTHS = [4, 7, 1, 0, 5, 7]
HOLES = {1: [2, 3], 4: [0]}  # tool-output tokens inside a response


def _token_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths(LENGTHS, 7, HOLES)
    rewards = torch.randn(6, 7, generator=g, dtype=F64)
    values = torch.randn(6, 7, generator=g, dtype=F64)
    return rewards, values, mask


SCORES = [1.0, 0.0, 0.5, 1.0, 1.0, 0.25, 0.0, 3.0]
GROUPS = [5, -1, 5, 3, -1, 5, 9, 3]  # unsorted, negative, sizes 3 / 2 / 2 / 1


def _outcome_batch():
    mask = mask_from_lengths([3, 5, 0, 2, 5, 1, 4, 5], 5, {4: [1]})
    return torch.tensor(SCORES, dtype=F64), torch.tensor(GROUPS), mask


# ---------------------------------------------------------------- GAE
def test_gae_hand_worked():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=F64)
    adv, ret = gae_advantages(token_rewards=rewards, values=values, response_mask=torch.ones(1, 3), gamma=0.9,
                              lam=0.8, whiten=False)
    # delta = [0.04, 0.03, 0.3]; A_2 = 0.3, A_1 = 0.03 + 0.72 * 0.3, A_0 = 0.04 + 0.72 * A_1
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]], dtype=F64), **TOL)
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]], dtype=F64), **TOL)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_naive_with_holes(gamma, lam):
    rewards, values, mask = _token_batch()
    adv, ret = gae_advantages(token_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam,
                              whiten=False)
    ref_adv, ref_ret = naive_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=F64), **TOL)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64), **TOL)
    adv_w, ret_w = gae_advantages(token_rewards=rewards, values=values, response_mask=mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv_w, torch.tensor(naive_whiten(ref_adv, mask.tolist()), dtype=F64), **TOL)
    torch.testing.assert_close(ret_w, ret, rtol=0, atol=0)  # returns are taken before whitening


def test_gae_ignores_padding_values_and_width():
    rewards, values, mask = _token_batch()
    adv, ret = gae_advantages(token_rewards=rewards, values=values, response_mask=mask, gamma=0.9, lam=0.9)
    wide_mask = pad_right(mask, 3, 0)
    adv_p, ret_p = gae_advantages(token_rewards=pad_right(fill_padding(rewards, mask), 3),
                                  values=pad_right(fill_padding(values, mask), 3), response_mask=wide_mask,
                                  gamma=0.9, lam=0.9)
    torch.testing.assert_close(adv_p[:, :7], adv, **TOL)
    torch.testing.assert_close(ret_p[:, :7], ret, **TOL)
    assert (adv_p[:, 7:] == 0).all() and (ret_p[:, 7:] == 0).all()


# ---------------------------------------------------------------- discounted returns / REINFORCE++
def test_discounted_returns_hand_worked_and_naive():
    r = torch.tensor([[1.0, 0.0, 2.0, 9.0]], dtype=F64)
    m = torch.tensor([[1, 0, 1, 0]])  # the masked 9.0 and the masked 0.0 are skipped, not discounted over
    torch.testing.assert_close(discounted_returns(r, m, gamma=0.5), torch.tensor([[2.0, 0.0, 2.0, 0.0]], dtype=F64))
    rewards, _, mask = _token_batch(1)
    out = discounted_returns(rewards, mask, gamma=0.9)
    torch.testing.assert_close(out, torch.tensor(naive_returns(rewards.tolist(), mask.tolist(), 0.9), dtype=F64), **TOL)


def test_reinforce_plus_plus_matches_naive():
    rewards, _, mask = _token_batch(2)
    adv, ret = reinforce_plus_plus_advantages(token_rewards=fill_padding(rewards, mask), response_mask=mask, gamma=0.95)
    ref_ret = naive_returns(rewards.tolist(), mask.tolist(), 0.95)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64), **TOL)
    torch.testing.assert_close(adv, torch.tensor(naive_whiten(ref_ret, mask.tolist()), dtype=F64), **TOL)


def test_reinforce_plus_plus_baseline_matches_naive():
    scores, groups, mask = _outcome_batch()
    adv, ret = reinforce_plus_plus_baseline_advantages(scores=scores, group_ids=groups, response_mask=mask)
    centred = broadcast(naive_group_adv(SCORES, GROUPS, "dr_grpo"), mask.tolist())
    torch.testing.assert_close(ret, torch.tensor(centred, dtype=F64), **TOL)
    torch.testing.assert_close(adv, torch.tensor(naive_whiten(centred, mask.tolist()), dtype=F64), **TOL)


def test_scores_to_token_rewards_puts_score_on_last_response_token():
    mask = mask_from_lengths([3, 0, 4], 5, {2: [3]})
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    expected = torch.zeros(3, 5)
    expected[0, 2] = 1.0
    expected[2, 2] = 3.0  # last *selected* token; the zero-length row gets nothing
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- outcome estimators
@pytest.mark.parametrize("kind,fn", [("grpo", grpo_advantages), ("dr_grpo", dr_grpo_advantages),
                                     ("rloo", rloo_advantages)])
def test_group_estimators_match_naive(kind, fn):
    scores, groups, mask = _outcome_batch()
    adv, ret = fn(scores=scores, group_ids=groups, response_mask=mask)
    expected = torch.tensor(broadcast(naive_group_adv(SCORES, GROUPS, kind), mask.tolist()), dtype=F64)
    torch.testing.assert_close(adv, expected, **TOL)
    torch.testing.assert_close(ret, adv, rtol=0, atol=0)


def test_grpo_hand_worked_and_dr_grpo_equivalence():
    mask = torch.ones(3, 1)
    adv, _ = grpo_advantages(scores=torch.tensor([1.0, 0.0, 0.0], dtype=F64), group_ids=torch.tensor([0, 0, 0]),
                             response_mask=mask, eps=0.0)
    # mean 1/3, unbiased std sqrt(1/3)
    third = 1.0 / 3.0
    torch.testing.assert_close(adv[:, 0], torch.tensor([2 * third, -third, -third], dtype=F64) / math.sqrt(third),
                               **TOL)
    scores, groups, mask = _outcome_batch()
    a, _ = grpo_advantages(scores=scores, group_ids=groups, response_mask=mask, norm_by_std=False)
    b, _ = dr_grpo_advantages(scores=scores, group_ids=groups, response_mask=mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rloo_hand_worked():
    adv, _ = rloo_advantages(scores=torch.tensor([1.0, 0.0, 0.5, 4.0], dtype=F64), group_ids=torch.tensor([0, 0, 0, 1]),
                             response_mask=torch.ones(4, 2))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.75, 0.0, 0.0], dtype=F64), **TOL)
    assert (adv[:, 0] == adv[:, 1]).all()


def test_group_statistics():
    mean, std, size = group_statistics(torch.tensor(SCORES, dtype=F64), torch.tensor(GROUPS))
    for i in range(len(SCORES)):
        members = [SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == GROUPS[i]]
        assert size[i].item() == len(members)
        assert mean[i].item() == pytest.approx(sum(members) / len(members), abs=1e-12)
        assert std[i].item() == pytest.approx(statistics.stdev(members) if len(members) > 1 else 0.0, abs=1e-12)


@pytest.mark.parametrize("baseline", ["batch_mean", "none", "tensor"])
def test_reinforce_baselines(baseline):
    scores, _, mask = _outcome_batch()
    b = torch.arange(8, dtype=F64) if baseline == "tensor" else baseline
    adv, _ = reinforce_advantages(scores=scores, response_mask=mask, baseline=b)
    offset = {"batch_mean": sum(SCORES) / len(SCORES), "none": 0.0}
    seq = [SCORES[i] - (i if baseline == "tensor" else offset[baseline]) for i in range(8)]
    torch.testing.assert_close(adv, torch.tensor(broadcast(seq, mask.tolist()), dtype=F64), **TOL)


def test_reinforce_bad_baseline_message():
    scores, _, mask = _outcome_batch()
    with pytest.raises(ValueError, match=r"^unknown baseline 'mean'; use 'batch_mean', 'none' or a \[B\] tensor$"):
        reinforce_advantages(scores=scores, response_mask=mask, baseline="mean")


# ---------------------------------------------------------------- edge cases stay finite
OUTCOME_FNS = [grpo_advantages, dr_grpo_advantages, rloo_advantages, reinforce_plus_plus_baseline_advantages]


@pytest.mark.parametrize("fn", OUTCOME_FNS)
@pytest.mark.parametrize("case", ["all_equal", "singletons", "empty_masks", "empty_batch"])
def test_outcome_edge_cases_are_finite(fn, case):
    if case == "empty_batch":
        scores, groups, mask = torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.long), torch.zeros(0, 4)
    else:
        scores = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=F64)
        groups = torch.tensor([0, 1, 2, 3]) if case == "singletons" else torch.tensor([0, 0, 1, 1])
        mask = torch.zeros(4, 4) if case == "empty_masks" else mask_from_lengths([4, 0, 2, 1], 4)
    adv, ret = fn(scores=scores, group_ids=groups, response_mask=mask)
    assert adv.shape == mask.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv == 0).all()  # no variance in any group: no signal anywhere


def test_token_estimators_edge_cases_are_finite():
    for mask in (torch.zeros(3, 4), mask_from_lengths([1, 0, 0], 4)):
        r = torch.ones(3, 4, dtype=F64)
        for adv, ret in (gae_advantages(token_rewards=r, values=r, response_mask=mask),
                         reinforce_plus_plus_advantages(token_rewards=r, response_mask=mask)):
            assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
            assert (adv == 0).all()  # a single token whitens to 0


def test_outcome_estimators_ignore_padding_width():
    scores, groups, mask = _outcome_batch()
    for fn in OUTCOME_FNS:
        adv, _ = fn(scores=scores, group_ids=groups, response_mask=mask)
        adv_wide, _ = fn(scores=scores, group_ids=groups, response_mask=pad_right(mask, 4, 0))
        torch.testing.assert_close(adv_wide[:, :5], adv, **TOL)
        assert (adv_wide[:, 5:] == 0).all()


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"^group_ids must be \[B\] like scores \(3,\); got \(2,\)$"):
        grpo_advantages(scores=torch.zeros(3), group_ids=torch.zeros(2, dtype=torch.long),
                        response_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"group_ids must be an integer tensor \(got torch.float32\)"):
        rloo_advantages(scores=torch.zeros(3), group_ids=torch.zeros(3), response_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"^scores must be \[B\] and response_mask \[B, T\]; got scores \(3,\)"):
        grpo_advantages(scores=torch.zeros(3), group_ids=torch.zeros(3, dtype=torch.long),
                        response_mask=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"^values must be \[B, T\] like response_mask \(2, 3\); got \(2, 4\)$"):
        gae_advantages(token_rewards=torch.zeros(2, 3), values=torch.zeros(2, 4), response_mask=torch.ones(2, 3))


def test_estimators_do_not_track_gradients():
    values = torch.randn(2, 3, dtype=F64, requires_grad=True)
    adv, ret = gae_advantages(token_rewards=torch.ones(2, 3, dtype=F64), values=values, response_mask=torch.ones(2, 3))
    assert not adv.requires_grad and not ret.requires_grad
