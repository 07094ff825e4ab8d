"""RequestFeed: the requests a running Backend.generate takes while it runs (RolloutEngine.stream)."""

import threading

import pytest

from mcore_rl.rollout.backend import RequestFeed


def test_indices_order_close_and_wakes():
    wakes = []
    feed = RequestFeed()
    feed.set_waker(lambda: wakes.append(1))
    assert feed.put({"a": 1}) == 0 and feed.put({"a": 2}) == 1
    assert feed.take() == ([(0, {"a": 1}), (1, {"a": 2})], False)
    assert feed.take() == ([], False)
    assert feed.put({"a": 3}) == 2
    feed.close()
    assert feed.take() == ([(2, {"a": 3})], True) and len(wakes) == 4  # every put and the close woke it
    with pytest.raises(RuntimeError, match="put\\(\\) after close"):
        feed.put({})
    feed.set_waker(None)
    feed.close()
    assert len(wakes) == 4


def test_a_list_is_a_closed_feed():
    reqs = [{"i": i} for i in range(3)]
    feed = RequestFeed.of(reqs)
    assert feed.take() == (list(enumerate(reqs)), True)
    assert RequestFeed.of(feed) is feed


def test_puts_from_many_threads_get_distinct_indices():
    feed = RequestFeed()
    threads = [threading.Thread(target=lambda: [feed.put({}) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new, closed = feed.take()
    assert sorted(i for i, _ in new) == list(range(800)) and not closed
