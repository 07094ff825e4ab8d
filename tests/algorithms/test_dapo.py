"""DAPO dynamic-sampling filter and soft overlong punishment, against hand-worked values and loops."""

import random

import pytest
import torch

from mcore_rl.algorithms import dynamic_sampling_filter, overlong_penalty


def test_filter_hand_worked():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.7])
    groups = torch.tensor([3, 3, 8, 8, -2, -2, 4, 9])
    # group 3 mixed -> keep; 8 all correct, -2 all wrong, 4 and 9 single samples -> drop
    keep, dropped = dynamic_sampling_filter(scores, groups)
    assert keep.tolist() == [True, True, False, False, False, False, False, False]
    assert dropped == 4 and isinstance(dropped, int)


def test_filter_matches_naive_on_random_groups():
    rng = random.Random(0)
    groups = [rng.randrange(10) for _ in range(60)]
    scores = [float(rng.random() < 0.3) if g % 3 else 0.5 for g in groups]  # groups 0, 3, 6, 9 constant
    keep, dropped = dynamic_sampling_filter(torch.tensor(scores), torch.tensor(groups))
    by_group = {}
    for s, g in zip(scores, groups):
        by_group.setdefault(g, []).append(s)
    varied = {g for g, s in by_group.items() if max(s) != min(s)}
    assert keep.tolist() == [g in varied for g in groups]
    assert dropped == len(by_group) - len(varied)


def test_filter_tolerance_and_edge_cases():
    scores = torch.tensor([0.5, 0.5 + 1e-9, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    assert dynamic_sampling_filter(scores, groups)[0].tolist() == [True, True, True, True]
    assert dynamic_sampling_filter(scores, groups, atol=1e-6)[0].tolist() == [False, False, True, True]
    keep, dropped = dynamic_sampling_filter(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert keep.shape == (0,) and dropped == 0
    with pytest.raises(ValueError, match=r"^group_ids must be an integer tensor \(got torch.float32\)$"):
        dynamic_sampling_filter(scores, groups.float())
    with pytest.raises(ValueError, match=r"^scores and group_ids must both be \[B\]; got \(4,\) and \(3,\)$"):
        dynamic_sampling_filter(scores, groups[:3])


def test_overlong_penalty_dapo_equation():
    # L_max = 20, L_cache = 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    out = overlong_penalty(lengths, max_length=20, buffer_length=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]), rtol=0, atol=1e-7)
    assert out.dtype == torch.float32
    scaled = overlong_penalty(lengths.double(), max_length=20, buffer_length=4, penalty_factor=0.5)
    assert scaled.dtype == torch.float64 and scaled.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_overlong_penalty_errors():
    lengths = torch.tensor([1])
    with pytest.raises(ValueError, match=r"^buffer_length must be in \(0, max_length=10\]; got 0$"):
        overlong_penalty(lengths, max_length=10, buffer_length=0)
    with pytest.raises(ValueError, match=r"^buffer_length must be in \(0, max_length=10\]; got 11$"):
        overlong_penalty(lengths, max_length=10, buffer_length=11)
    with pytest.raises(ValueError, match=r"^max_length must be > 0; got 0$"):
        overlong_penalty(lengths, max_length=0, buffer_length=1)
