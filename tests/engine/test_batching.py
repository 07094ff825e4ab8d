"""Token-budget splitting, padding / packing layouts and unpacking (pure functions)."""

import pytest
import torch

from mcore_rl.engine.batching import (make_micro_batches, pack_sequences, pad_micro_batch, pad_sequences,
                                      split_by_token_budget, unpack)


def seqs(lengths):
    return [{"input_ids": torch.arange(100 * i, 100 * i + n), "loss_mask": torch.ones(n),
             "adv": torch.full((n,), float(i))} for i, n in enumerate(lengths)]


def test_split_respects_budget_and_covers_every_sequence_once():
    lengths = [11, 7, 16, 5, 13, 9, 20, 4, 30, 1]
    bins = split_by_token_budget(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    # first-fit-decreasing needs ceil(116 / 32) = 4 bins here
    assert len(bins) == 4
    assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)


def test_split_min_bins_and_multiple_of():
    lengths = [5, 5, 5, 5, 5]
    assert len(split_by_token_budget(lengths, 100)) == 1
    bins = split_by_token_budget(lengths, 100, min_bins=2, multiple_of=4)
    assert len(bins) == 4 and all(bins)
    with pytest.raises(ValueError, match="5 sequences cannot fill 6 micro batches"):
        split_by_token_budget(lengths, 100, min_bins=6)


def test_split_too_long_sequence_names_the_budget():
    with pytest.raises(ValueError, match=r"sequence 1 has 40 tokens, more than the micro-batch token budget "
                                         r"max_tokens=32"):
        split_by_token_budget([3, 40], 32)


def test_padded_layout():
    mb = pad_sequences(seqs([3, 5]), [0, 1], pad_id=7)
    assert mb.input_ids.tolist() == [[0, 1, 2, 7, 7], [100, 101, 102, 103, 104]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    assert mb.valid_mask.sum().item() == 8 and not mb.packed
    assert mb["adv"][1].tolist() == [1.0] * 5 and mb["loss_mask"][0].tolist() == [1, 1, 1, 0, 0]


def test_packed_layout_thd():
    mb = pack_sequences(seqs([3, 5, 2]), [2, 0, 1], pad_to_multiple_of=4)
    assert mb.input_ids.shape == (1, 12) and mb.packed
    assert mb.input_ids[0, :10].tolist() == [200, 201, 0, 1, 2, 100, 101, 102, 103, 104]
    assert mb.position_ids[0].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    p = mb.packed_seq_params
    assert p.qkv_format == "thd"
    # the padding to a multiple of 4 is its own segment
    assert p.cu_seqlens_q.tolist() == [0, 2, 5, 10, 12] and p.cu_seqlens_q.dtype == torch.int32
    assert p.max_seqlen_q == 5 and mb.seq_starts == [0, 2, 5] and mb.indices == [2, 0, 1]
    assert mb.valid_mask[0].tolist() == [True] * 10 + [False] * 2


def test_moving_keeps_shared_bounds_shared():
    """Queries and keys share one bounds tensor; a move to another device must keep it one tensor, since the RoPE
    and attention caches key on identity (two copies made every layer of a GPU forward rebuild the cos / sin).
    The meta device stands in for a GPU here: like a GPU, and unlike the CPU, .to() makes a new tensor there."""
    mb = pack_sequences(seqs([3, 5, 2]), [0, 1, 2], pad_to_multiple_of=4)
    p = mb.packed_seq_params
    assert p.cu_seqlens_q is p.cu_seqlens_kv
    mb.to("meta")
    assert p.cu_seqlens_q.device.type == "meta" and p.cu_seqlens_q is p.cu_seqlens_kv
    assert mb.input_ids.device.type == "meta" and mb["adv"].device.type == "meta"
    assert p.mcore_rl_host_bounds[1] == [0, 3, 8, 10, 12]


def test_logit_positions_come_from_the_host_mask_after_a_move():
    """The update and the graphed forward find the logit positions from the host's copy of the loss mask, also
    after a pass moved the micro batch to the GPU (reading a device mask would be a host sync per micro batch);
    on the meta device a read would fail outright."""
    from mcore_rl.models import lm_head

    mb = pack_sequences(seqs([3, 5, 2]), [0, 1, 2], pad_to_multiple_of=4)
    expected = lm_head.positions(mb["loss_mask"])
    mb.to("meta")
    (rows, cols), empty = mb.logit_positions()
    assert rows.device.type == "cpu" and not empty
    assert torch.equal(rows, expected[0][0]) and torch.equal(cols, expected[0][1])
    assert mb.logit_positions()[0][1] is cols  # found once


def test_pad_micro_batch_to_common_shape():
    mb = pack_sequences(seqs([3, 2]), [0, 1])
    big = pad_micro_batch(mb, 8)
    assert big.input_ids.shape == (1, 8)
    assert big.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert big.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    padded = pad_micro_batch(pad_sequences(seqs([3, 2]), [0, 1]), 4, rows=3)
    assert padded.input_ids.shape == (3, 4) and padded.valid_mask.sum() == 5 and padded["adv"].shape == (3, 4)
    with pytest.raises(ValueError, match=r"cannot pad a \[1, 5\] micro batch to \[1, 4\]"):
        pad_micro_batch(mb, 4)


@pytest.mark.parametrize("packed", [True, False])
def test_unpack_restores_original_order(packed):
    data = seqs([11, 7, 16, 5, 13])
    mbs = make_micro_batches(data, max_tokens=20, packed=packed)
    outs = [mb.input_ids.float() * 2 for mb in mbs]
    back = unpack(outs, mbs)
    assert [b.tolist() for b in back] == [(s["input_ids"].float() * 2).tolist() for s in data]


def test_make_micro_batches_fixed_size_and_errors():
    mbs = make_micro_batches(seqs([3, 4, 5]), micro_batch_size=2, packed=False)
    assert [mb.indices for mb in mbs] == [[0, 1], [2]]
    with pytest.raises(ValueError, match="give exactly one of max_tokens"):
        make_micro_batches(seqs([3]), max_tokens=8, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"field 'loss_mask' has shape \(2,\), expected \(3,\)"):
        make_micro_batches([{"input_ids": torch.arange(3), "loss_mask": torch.ones(2)}], max_tokens=8)
    with pytest.raises(ValueError, match="2 micro batches of 2 sequences, but at least 1 and a multiple of 4"):
        make_micro_batches(seqs([3, 4, 5]), micro_batch_size=2, multiple_of=4)
