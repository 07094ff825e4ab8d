import threading

import pytest

from mcore_rl.rewards.calls import TimeoutPool


@pytest.fixture
def pool():
    p = TimeoutPool(2)
    yield p
    p.close()


def test_results_come_back_in_order(pool):
    results = pool.map(lambda x: x * x, list(range(50)), timeout_s=None)
    assert [r.value for r in results] == [x * x for x in range(50)]
    assert all(r.ok for r in results)


def test_exceptions_of_any_kind_are_captured(pool):
    def fn(x):
        if x == 1:
            raise SystemExit("user code called sys.exit")
        if x == 2:
            raise KeyError("k")
        return x

    results = pool.map(fn, [0, 1, 2, 3], timeout_s=5.0)
    assert [r.ok for r in results] == [True, False, False, True]
    assert isinstance(results[1].error, SystemExit) and "sys.exit" in results[1].traceback
    assert "KeyError: 'k'" in results[2].traceback
    assert [r.value for r in pool.map(lambda x: x + 1, [1, 2], timeout_s=5.0)] == [2, 3]  # workers survived


def test_hung_calls_are_abandoned_and_workers_replaced():
    release = threading.Event()
    pool = TimeoutPool(1)
    try:
        # One worker and two calls that hang: each times out in turn, and the call queued behind them still runs.
        results = pool.map(lambda x: release.wait(60) if x == "hang" else x, ["hang", "hang", "ok"], timeout_s=0.3)
        assert [r.timed_out for r in results] == [True, True, False]
        assert results[2].value == "ok"
        assert pool.num_abandoned == 2
        assert [r.value for r in pool.map(str.upper, ["a", "b"], timeout_s=5.0)] == ["A", "B"]
    finally:
        release.set()
        pool.close()


def test_pool_needs_a_worker():
    with pytest.raises(ValueError, match=r"num_workers \(0\) must be positive"):
        TimeoutPool(0)
