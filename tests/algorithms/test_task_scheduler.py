"""TaskScheduler: the weighting rule and the task choice, against values worked out by hand."""

import math

import pytest

from mcore_rl.algorithms import TaskScheduler


def test_fixed_weighted_sum_trains_every_task_with_normalised_coefficients():
    s = TaskScheduler(["a", "b", "c"], [1.0, 2.0, 1.0])
    assert s.next_tasks() == [0, 1, 2]
    assert s.coefficients([0, 1, 2]) == pytest.approx([0.25, 0.5, 0.25])
    assert s.coefficients([0, 2]) == pytest.approx([0.5, 0.5])  # a task that dropped out: the rest renormalised
    s.observe({0: 1.0, 1: 5.0, 2: -3.0})
    s.observe({0: 9.0, 1: 5.0, 2: 3.0})
    s.observe({0: 2.0, 1: 1.0, 2: 0.0})
    assert s.weights == [1.0, 2.0, 1.0]  # fixed never moves


def test_alternating_is_smooth_weighted_round_robin():
    # weights 2:1 -> credits (a, b): +2,+1 -> a (2-3=-1, 1); +  -> (1, 2) -> b (1, -1); + -> (3, 0) -> a (0, 0)
    s = TaskScheduler(["a", "b"], [2.0, 1.0], combine="alternating")
    picks = [s.next_tasks()[0] for _ in range(6)]
    assert picks == [0, 1, 0, 0, 1, 0]
    assert s.coefficients([1]) == [1.0]
    # over any 3k steps each task trains in proportion to its weight
    s = TaskScheduler(["a", "b", "c"], [3.0, 2.0, 1.0], combine="alternating")
    picks = [s.next_tasks()[0] for _ in range(60)]
    assert [picks.count(i) for i in range(3)] == [30, 20, 10]


def test_auto_rule_by_hand():
    s = TaskScheduler(["a", "b"], [1.0, 2.0], weighting="auto", window=3, min_history=2, min_multiplier=0.5,
                      max_multiplier=3.0, smoothing=0.5)
    s.observe({0: 1.0, 1: 1.0})
    assert s.weights == [1.0, 2.0]  # one loss each: below min_history, weights stay at their base
    s.observe({0: 3.0, 1: 1.0})
    # std a = 1 (losses 1, 3), std b = 0; mean 0.5 -> multipliers clamp(2) = 2 and clamp(0) = 0.5
    # targets 1 x 2 = 2 and 2 x 0.5 = 1; smoothed 0.5 x old + 0.5 x target
    assert s.fluctuations() == pytest.approx([1.0, 0.0])
    assert s.weights == pytest.approx([1.5, 1.5])
    s.observe({0: 5.0, 1: 2.0})
    s.observe({0: 7.0, 1: 5.0})  # window 3 keeps (3, 5, 7) and (1, 2, 5)
    sa = math.sqrt(8 / 3)
    sb = math.sqrt(((1 - 8 / 3) ** 2 + (2 - 8 / 3) ** 2 + (5 - 8 / 3) ** 2) / 3)
    assert s.fluctuations() == pytest.approx([sa, sb])
    mean = (sa + sb) / 2
    w = [1.5, 1.5]
    # step 3 by the rule: std(1,3,5) = sqrt(8/3), std(1,1,2) = sqrt(2)/3
    s3a, s3b = math.sqrt(8 / 3), math.sqrt(2) / 3
    m3 = [min(max(x / ((s3a + s3b) / 2), 0.5), 3.0) for x in (s3a, s3b)]
    w = [0.5 * w[0] + 0.5 * 1.0 * m3[0], 0.5 * w[1] + 0.5 * 2.0 * m3[1]]
    m4 = [min(max(x / mean, 0.5), 3.0) for x in (sa, sb)]
    w = [0.5 * w[0] + 0.5 * 1.0 * m4[0], 0.5 * w[1] + 0.5 * 2.0 * m4[1]]
    assert s.weights == pytest.approx(w)


def test_auto_with_constant_losses_keeps_the_base():
    s = TaskScheduler(["a", "b"], [1.0, 3.0], weighting="auto", min_history=2, smoothing=0.0)
    for _ in range(4):
        s.observe({0: 0.5, 1: 0.5})
    assert s.weights == [1.0, 3.0]


def test_state_round_trip_continues_identically():
    a = TaskScheduler(["x", "y"], [1.0, 1.0], combine="alternating", weighting="auto", min_history=2)
    for k in range(5):
        (i,) = a.next_tasks()
        a.observe({i: float(k * k % 7)})
    b = TaskScheduler(["x", "y"], [1.0, 1.0], combine="alternating", weighting="auto", min_history=2)
    b.load_state_dict(a.state_dict())
    for k in range(5, 12):
        (i,) = a.next_tasks()
        (j,) = b.next_tasks()
        assert i == j
        a.observe({i: float(k % 3)})
        b.observe({j: float(k % 3)})
        assert a.weights == b.weights


def test_errors():
    with pytest.raises(ValueError, match="task names must be unique"):
        TaskScheduler(["a", "a"], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"base weights must be finite and > 0, got \[1.0, 0.0\]"):
        TaskScheduler(["a", "b"], [1.0, 0.0])
    s = TaskScheduler(["a", "b"], [1.0, 1.0])
    with pytest.raises(ValueError, match="task b: loss is nan; the run has diverged"):
        s.observe({1: float("nan")})
    with pytest.raises(ValueError, match=r"the checkpoint's tasks \['a', 'c'\] differ from the configured tasks"):
        s.load_state_dict({"names": ["a", "c"], "weights": [1, 1], "history": [[], []], "credits": [0, 0]})
