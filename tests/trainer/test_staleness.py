"""check_staleness (trainer/async_rollout.py): which samples an asynchronous step trains on, and its metrics,
against counts worked out by hand."""

from mcore_rl.trainer.async_rollout import check_staleness
from mcore_rl.types import Sample


def sample(group: int, versions: list[int] | None) -> Sample:
    n = len(versions) if versions else 2
    return Sample(prompt_ids=[1], response_ids=[5] * n, rollout_logprobs=[-1.0] * n, finish_reason="stop",
                  group_id=group, versions=versions)


def test_groups_with_a_sample_too_far_behind_are_dropped_whole():
    # trainer at version 5, bound 2: behind = 5 - oldest token's version
    samples = [sample(0, [5, 5]), sample(0, [4, 5]),      # 0 and 1 behind
               sample(1, [3, 3]), sample(1, [2, 4]),      # 2 and 3 behind: group 1 goes
               sample(2, [3, 4])]                          # 2 behind, continued across a sync
    kept, m = check_staleness(samples, trainer_version=5, max_staleness=2)
    assert [s.group_id for s in kept] == [0, 0, 2]
    assert m["async/dropped_stale"] == 2.0
    assert m["async/staleness_max"] == 3.0
    assert m["async/staleness_mean"] == (0 + 1 + 2 + 3 + 2) / 5
    assert [m[f"async/staleness_hist/{d}"] for d in range(3)] == [0.2, 0.2, 0.4]
    assert m["async/staleness_hist/>2"] == 0.2
    assert m["async/partial_samples"] == 3.0  # [4, 5], [2, 4], [3, 4]


def test_samples_of_a_sync_run_count_as_current():
    samples = [sample(0, None), sample(0, None)]
    kept, m = check_staleness(samples, trainer_version=7, max_staleness=1)
    assert kept == samples
    assert m["async/staleness_max"] == 0.0 and m["async/staleness_hist/0"] == 1.0 and m["async/dropped_stale"] == 0.0


def test_policy_version_is_the_oldest_token():
    assert sample(0, [4, 2, 3]).policy_version == 2
    assert sample(0, None).policy_version is None
