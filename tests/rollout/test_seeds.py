"""Per-sample sampling seeds (mcore_rl/rollout/seeds.py), SGLang's seeded sampler on CPU
(mcore_rl/rollout/cpu_seeded_sampling.py), and a real engine: restarted with the same seeds it draws the same
samples bit for bit, whatever the request batching; another rollout.random_seed draws others."""

from __future__ import annotations

import struct

import pytest
import torch

from conftest import cpu_config
from mcore_rl.rollout import RolloutEngine
from mcore_rl.rollout.cpu_seeded_sampling import multinomial_with_seed, murmur_hash32
from mcore_rl.rollout.seeds import group_seeds, sample_seed
from mcore_rl.rollout.settings import server_args


def test_seed_is_a_pure_function_of_its_key():
    # a pinned value: the derivation must not change between versions, or resuming an older run diverges
    assert sample_seed(0, 0, 0) == sample_seed(0, 0, 0) == 5516887258528278866
    keys = [(0, 0, 0, 0, ""), (1, 0, 0, 0, ""), (0, 1, 0, 0, ""), (0, 0, 1, 0, ""), (0, 0, 0, 1, ""),
            (0, 0, 0, 0, "task:a"), (0, 10, 1, 0, ""), (0, 1, 10, 0, "")]
    seeds = [sample_seed(*k) for k in keys]
    assert len(set(seeds)) == len(keys)
    assert all(0 <= s < 2 ** 63 for s in seeds)  # SGLang holds seeds in an int64 tensor


def test_group_seeds_are_prompt_major():
    assert group_seeds(7, 4, 2, 3) == [sample_seed(7, g, j) for g in (4, 5) for j in range(3)]


def test_negative_positions_are_refused():
    with pytest.raises(ValueError, match="group_id must be >= 0, got -1"):
        sample_seed(0, -1, 0)


def _murmur3_x86_32(data: bytes) -> int:
    """Reference MurmurHash3_x86_32 (Appleby), hash seed 0, for a length that is a multiple of 4."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = 0
    for (k,) in struct.iter_unpack("<I", data):
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_cpu_hash_is_murmur3_of_seed_position_column():
    seeds = torch.tensor([0, 42, sample_seed(3, 5, 1), 2 ** 63 - 1])
    positions = torch.tensor([0, 7, 123456, 2 ** 31 + 5])
    cols = torch.tensor([0, 1, 511, 49151])
    got = murmur_hash32(seeds, positions, cols)
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, c in enumerate(cols.tolist()):
            expected = _murmur3_x86_32(struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p & 0xFFFFFFFF, c))
            assert int(got[i, j]) == expected, (s, p, c)


def test_seeded_gumbel_max_samples_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    num = 20000
    seeds = torch.tensor([sample_seed(0, g, 0) for g in range(num)])
    picks = multinomial_with_seed(probs.log().expand(num, -1), seeds, torch.zeros(num, dtype=torch.int64))
    freq = torch.bincount(picks.view(-1), minlength=4).double() / num
    # 4 standard errors of a frequency near 0.5 over 20,000 draws: 0.014
    assert torch.allclose(freq, probs, atol=0.014), freq
    again = multinomial_with_seed(probs.log().expand(num, -1), seeds, torch.zeros(num, dtype=torch.int64))
    assert torch.equal(picks, again)


def test_deterministic_switch_reaches_server_args():
    assert server_args(cpu_config(device="cpu"), "/m")["enable_deterministic_inference"] is True
    assert server_args(cpu_config(device="cuda"), "/m")["enable_deterministic_inference"] is False
    assert server_args(cpu_config(device="cpu", deterministic=False), "/m")["enable_deterministic_inference"] is False
    assert server_args(cpu_config(device="cuda", deterministic=True), "/m")["enable_deterministic_inference"] is True


@pytest.mark.slow
def test_restarted_engine_draws_the_same_samples(models):
    """Two engines, one after the other, sampling at temperature 1. The same seeds give the same tokens and
    log-probs bit for bit; sent in other batches, the same tokens and log-probs within 1e-5 (torch's CPU
    matmuls round differently for another number of rows: 1.5e-6 seen); rollout.random_seed=1 draws others."""
    prompts = [[5, 17, 33, 101, 7], [9, 250, 4]]

    def run(random_seed: int):
        engine = RolloutEngine(cpu_config(mode="engine", random_seed=random_seed), model_path=models["m0"])
        sampling = engine.default_sampling(temperature=1.0, max_new_tokens=10, ignore_eos=True)
        try:
            own = engine.generate(prompts, n=4, sampling=sampling, first_group_id=6)
            seed0 = engine.generate(prompts, n=4, sampling=sampling, sampling_seeds=group_seeds(0, 6, 2, 4))
            alone = [engine.generate([p], n=4, sampling=sampling, sampling_seeds=group_seeds(0, 6 + i, 1, 4))
                     for i, p in enumerate(prompts)]
        finally:
            engine.shutdown()
        return [[(s.response_ids, s.rollout_logprobs) for s in b.samples] for b in (own, seed0, *alone)]

    first = run(0)[0]
    other, again, *alone = run(1)
    assert again == first  # token ids and float log-probs, exactly
    assert len({tuple(ids) for ids, _ in first}) > 1  # the samples of a group differ: it really sampled
    for (ids, logprobs), (ids_alone, logprobs_alone) in zip(first, alone[0] + alone[1]):
        assert ids_alone == ids
        assert logprobs_alone == pytest.approx(logprobs, abs=1e-5, rel=0)
    differing = sum(a[0] != b[0] for a, b in zip(first, other))
    assert differing >= 6, f"random_seed=1 changed only {differing} of 8 samples"
