import json

import numpy as np
import pytest

from mcore_rl.config.data import DataConfig
from mcore_rl.data import EpochSampler, load_prompt_dataset, shard_batch
from mcore_rl.data.synthetic import make_arithmetic_rows, write_jsonl


def draw(sampler, num_batches):
    return [sampler.next_indices() for _ in range(num_batches)]


def test_every_epoch_is_a_seeded_permutation_and_batches_run_across_epochs():
    n, batch = 10, 4
    sampler = EpochSampler(list(range(n)), batch, seed=3)
    stream = [i for b in draw(sampler, 5) for i in b]  # 20 items: exactly epochs 0 and 1
    epoch0, epoch1 = stream[:n], stream[n:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    # Independent formula for the order: numpy's generator seeded with [seed, epoch].
    assert epoch0 == list(np.random.default_rng([3, 0]).permutation(n))
    assert epoch1 == list(np.random.default_rng([3, 1]).permutation(n))
    assert epoch0 != epoch1
    assert (sampler.epoch, sampler.offset, sampler.num_consumed) == (2, 0, 20)
    # Batch 3 straddles the epoch end: the last two of epoch 0, then the first two of epoch 1.
    assert draw(EpochSampler(list(range(n)), batch, seed=3), 3)[2] == epoch0[8:] + epoch1[:2]


def test_same_seed_same_order_other_seed_other_order_and_no_shuffle():
    data = list(range(50))
    assert draw(EpochSampler(data, 8, seed=1), 10) == draw(EpochSampler(data, 8, seed=1), 10)
    assert draw(EpochSampler(data, 8, seed=1), 10) != draw(EpochSampler(data, 8, seed=2), 10)
    assert draw(EpochSampler(data, 4, shuffle=False), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_batch_larger_than_dataset_cycles():
    sampler = EpochSampler(["a", "b", "c"], 7, shuffle=False)
    assert sampler.next_batch() == ["a", "b", "c", "a", "b", "c", "a"]
    assert sampler.epoch == 2 and sampler.offset == 1


@pytest.mark.parametrize("stop_after", [0, 1, 2, 5, 7])
def test_resumed_sampler_draws_exactly_what_an_uninterrupted_one_draws(stop_after):
    data = list(range(13))  # not a multiple of the batch size, so batches straddle epoch ends
    uninterrupted = draw(EpochSampler(data, 5, seed=11), 12)

    first = EpochSampler(data, 5, seed=11)
    before = draw(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    resumed = EpochSampler(data, 5, seed=11)
    resumed.load_state_dict(state)
    assert before + draw(resumed, 12 - stop_after) == uninterrupted


def test_resume_with_real_prompts_gives_the_same_prompt_ids(tmp_path, tokenizer):
    path = write_jsonl(make_arithmetic_rows(23, seed=5), tmp_path / "train.jsonl")
    cfg = DataConfig(train_files=[str(path)], seed=7)

    def batches(sampler, k):
        return [[item.prompt_ids for item in sampler.next_batch()] for _ in range(k)]

    dataset = load_prompt_dataset(cfg, tokenizer)
    uninterrupted = batches(EpochSampler(dataset, 6, seed=cfg.seed), 9)
    run = EpochSampler(dataset, 6, seed=cfg.seed)
    head = batches(run, 4)
    state = run.state_dict()
    # A new process: the dataset is loaded again from the files.
    restarted = EpochSampler(load_prompt_dataset(cfg, tokenizer), 6, seed=cfg.seed)
    restarted.load_state_dict(state)
    assert head + batches(restarted, 5) == uninterrupted


def test_resume_refuses_a_different_order():
    state = EpochSampler(list(range(10)), 2, seed=1).state_dict()
    for sampler, key in [
        (EpochSampler(list(range(10)), 2, seed=2), "seed"),
        (EpochSampler(list(range(11)), 2, seed=1), "num_items"),
        (EpochSampler(list(range(10)), 2, seed=1, shuffle=False), "shuffle"),
    ]:
        with pytest.raises(ValueError, match=f"saved with {key}=.* but this sampler has {key}="):
            sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="impossible position"):
        EpochSampler(list(range(10)), 2, seed=1).load_state_dict({**state, "offset": 10})


def test_a_different_batch_size_may_resume_from_the_same_position():
    data = list(range(9))
    ref = EpochSampler(data, 3, seed=0)
    ref_stream = [i for b in draw(ref, 6) for i in b]
    a = EpochSampler(data, 3, seed=0)
    draw(a, 2)
    b = EpochSampler(data, 2, seed=0)
    b.load_state_dict(a.state_dict())
    assert [i for batch in draw(b, 6) for i in batch] == ref_stream[6:18]


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="dataset is empty"):
        EpochSampler([], 2)
    with pytest.raises(ValueError, match=r"batch_size \(0\) must be positive"):
        EpochSampler([1], 0)


def test_shard_batch_slices_contiguously_and_checks_divisibility():
    batch = list(range(8))
    assert [shard_batch(batch, r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="global batch of 8 does not split evenly over 3 data-parallel ranks"):
        shard_batch(batch, 0, 3)
    with pytest.raises(ValueError, match=r"rank \(4\) must be in \[0, world_size=4\)"):
        shard_batch(batch, 4, 4)
