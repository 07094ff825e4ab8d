"""Loss aggregation: each mode against explicit loops, and exactness of the micro-batch / DP convention.

Splitting tests compare float64 sums of the same terms in a different order, so they hold to 1e-12.
"""

import pytest
import torch

from mcore_rl.algorithms import LOSS_AGG_MODES, aggregate_loss, compute_global_normalizers, compute_policy_loss

from .helpers import fill_padding, mask_from_lengths, pad_right

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)
MAX_LEN = 12  # the "rollout max response length" for seq-mean-token-sum-norm, larger than any padded width


def naive_aggregate(loss, mask, mode, max_len=MAX_LEN):
    rows = [[loss[i][t] for t in range(len(mask[i])) if mask[i][t]] for i in range(len(mask))]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / max(sum(len(r) for r in rows), 1)
    per_seq = {
        "seq-mean-token-sum": lambda r: sum(r),
        "seq-mean-token-mean": lambda r: sum(r) / len(r),
        "seq-mean-token-sum-norm": lambda r: sum(r) / max_len,
    }[mode]
    return sum(per_seq(r) for r in nonempty) / max(len(nonempty), 1)


LENGTHS = [5, 9, 0, 1, 7, 3, 9, 2]
HOLES = {1: [3, 4], 4: [0, 6]}


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = mask_from_lengths(LENGTHS, 9, HOLES)
    old = -torch.rand(8, 9, generator=g, dtype=F64) * 3
    logprobs = old + 0.4 * torch.randn(8, 9, generator=g, dtype=F64)  # enough spread that clipping is active
    adv = torch.randn(8, 9, generator=g, dtype=F64)
    return logprobs, old, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_naive_loops(mode):
    g = torch.Generator().manual_seed(1)
    mask = mask_from_lengths(LENGTHS, 9, HOLES)
    loss_mat = torch.randn(8, 9, generator=g, dtype=F64)
    out = aggregate_loss(fill_padding(loss_mat, mask), mask, mode, max_response_length=MAX_LEN)
    expected = naive_aggregate(loss_mat.tolist(), mask.tolist(), mode)
    assert out.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_hand_worked_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 4.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_response_length=5).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "token-mean", global_num_tokens=20).item() == pytest.approx(0.5)
    out = aggregate_loss(loss, mask, "seq-mean-token-sum", global_num_seqs=torch.tensor(5))
    assert out.item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_rows_and_columns_do_not_change_loss(mode):
    loss_mat = torch.randn(8, 9, dtype=F64)
    mask = mask_from_lengths(LENGTHS, 9, HOLES)
    ref = aggregate_loss(loss_mat, mask, mode, max_response_length=MAX_LEN)
    wide = pad_right(fill_padding(loss_mat, mask), 3)
    wide_mask = torch.cat([pad_right(mask, 3, 0), torch.zeros(2, 12, dtype=mask.dtype)])
    wide = torch.cat([wide, torch.full((2, 12), float("nan"), dtype=F64)])
    torch.testing.assert_close(aggregate_loss(wide, wide_mask, mode, max_response_length=MAX_LEN), ref, **TOL)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_gives_zero_loss_and_zero_grad(mode):
    x = torch.full((2, 3), float("nan"), dtype=F64, requires_grad=True)
    loss = aggregate_loss(x, torch.zeros(2, 3), mode, max_response_length=4)
    loss.backward()
    assert loss.item() == 0.0
    assert (x.grad == 0).all()


def test_mode_errors_have_messages():
    with pytest.raises(ValueError, match=r"^unknown loss_agg_mode 'token_mean'; known: token-mean, seq-mean-"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "token_mean")
    with pytest.raises(ValueError, match=r"needs max_response_length > 0 \(got None\); pass the rollout's maximum"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "seq-mean-token-sum-norm")


def test_compute_global_normalizers_counts():
    masks = [mask_from_lengths([3, 0, 2], 4), mask_from_lengths([1], 1), mask_from_lengths([0, 5], 6, {1: [0]})]
    norm = compute_global_normalizers(masks)
    assert norm.num_tokens.item() == 3 + 2 + 1 + 4
    assert norm.num_seqs.item() == 4  # rows with no response token are not sequences
    with pytest.raises(ValueError, match=r"needs at least one micro-batch mask"):
        compute_global_normalizers([])


# ---------------------------------------------------------------- micro-batch / DP exactness
def _trim(rows, *tensors):
    """Slice rows and trim to this micro batch's own padded width (dynamic padding)."""
    mask = tensors[-1][rows]
    width = max(int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 1, 1)
    return [t[rows, :width] for t in tensors]


LOSS_FNS = {
    "ppo": lambda lp, old, adv, m, **agg: compute_policy_loss(
        "ppo", logprobs=lp, old_logprobs=old, advantages=adv, response_mask=m, clip_ratio_low=0.2,
        clip_ratio_high=0.28, clip_ratio_c=3.0, **agg)[0],
    "gspo": lambda lp, old, adv, m, **agg: compute_policy_loss(
        "gspo", logprobs=lp, old_logprobs=old, advantages=adv, response_mask=m, clip_ratio_low=0.05,
        clip_ratio_high=0.08, **agg)[0],
}


@pytest.mark.parametrize("loss_name", list(LOSS_FNS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_and_dp_shards_reproduce_full_batch(mode, loss_name):
    loss_fn = LOSS_FNS[loss_name]
    logprobs, old, adv, mask = _batch()
    old, adv = fill_padding(old, mask), fill_padding(adv, mask)

    full_lp = fill_padding(logprobs, mask).requires_grad_(True)
    full_loss = loss_fn(full_lp, old, adv, mask, loss_agg_mode=mode, max_response_length=MAX_LEN)
    full_loss.backward()
    grad_full = torch.nan_to_num(full_lp.grad, nan=0.0)
    assert grad_full.abs().sum() > 0

    # 1) three uneven micro batches on one rank: contributions sum to the full loss, grads accumulate
    lp = fill_padding(logprobs, mask).requires_grad_(True)
    splits = [[0, 1, 2], [3, 4], [5, 6, 7]]
    micro = [_trim(rows, lp, old, adv, mask) for rows in splits]
    norm = compute_global_normalizers([m for *_, m in micro])
    agg = dict(loss_agg_mode=mode, max_response_length=MAX_LEN, global_num_tokens=norm.num_tokens,
               global_num_seqs=norm.num_seqs)
    total = sum(loss_fn(*mb, **agg) for mb in micro)
    total.backward()
    torch.testing.assert_close(total, full_loss, **TOL)
    torch.testing.assert_close(torch.nan_to_num(lp.grad, nan=0.0), grad_full, **TOL)

    # 2) two DP ranks x two micro batches, Megatron convention: each micro batch returns
    #    contribution * num_microbatches * dp_size; the schedule divides by num_microbatches; DDP averages.
    dp, num_micro = 2, 2
    shards = [[[0, 1], [2, 3]], [[4, 5, 6], [7]]]
    rank_leaves = [fill_padding(logprobs, mask)[sum(s, [])].clone().requires_grad_(True) for s in shards]
    rank_micro = []
    for leaf, shard in zip(rank_leaves, shards):
        rows = sum(shard, [])
        local = [[rows.index(r) for r in mb] for mb in shard]
        rank_micro.append([_trim(idx, leaf, old[rows], adv[rows], mask[rows]) for idx in local])
    norm = compute_global_normalizers([m for rank in rank_micro for *_, m in rank])  # == all-reduce over DP
    agg.update(global_num_tokens=norm.num_tokens, global_num_seqs=norm.num_seqs)
    rank_losses = []
    for rank in rank_micro:
        loss = sum(loss_fn(*mb, **agg) * num_micro * dp / num_micro for mb in rank)
        loss.backward()
        rank_losses.append(loss)
    torch.testing.assert_close(sum(rank_losses) / dp, full_loss, **TOL)  # the logged DP-mean loss
    grad_dp = torch.cat([torch.nan_to_num(leaf.grad, nan=0.0) for leaf in rank_leaves]) / dp  # DDP grad mean
    torch.testing.assert_close(grad_dp, grad_full, **TOL)


def test_local_normalisation_is_not_exact_under_micro_batching():
    """Guard for the test above: without global normalisers, token-mean of micro batches is a different loss."""
    logprobs, old, adv, mask = _batch()
    full = LOSS_FNS["ppo"](logprobs, old, adv, mask, loss_agg_mode="token-mean")
    parts = [LOSS_FNS["ppo"](*_trim(rows, logprobs, old, adv, mask), loss_agg_mode="token-mean") / 2
             for rows in ([0, 1, 2, 3], [4, 5, 6, 7])]
    assert abs((sum(parts) - full).item()) > 1e-3
