"""rollout.backend.until_accepted: an SGLang request it refuses while busy (a cache flush), asked again until it is
accepted or the time is up; the last result comes back either way (the callers raise on a refusal)."""

import time

from mcore_rl.rollout.backend import outcome, until_accepted


def test_asks_again_until_accepted():
    answers = iter([(False, "busy"), (False, "busy"), (True, "flushed")])
    calls = []

    def flush():
        calls.append(time.monotonic())
        return next(answers)

    assert until_accepted(flush, timeout_s=5.0, every_s=0.01) == (True, "flushed")
    assert len(calls) == 3 and all(b - a >= 0.01 for a, b in zip(calls, calls[1:]))


def test_gives_back_the_last_refusal_when_time_is_up():
    calls = []

    def flush():
        calls.append(1)
        return {"success": False, "message": f"busy {len(calls)}"}

    t0 = time.monotonic()
    result = until_accepted(flush, timeout_s=0.1, every_s=0.02)
    assert outcome(result) == (False, f"busy {len(calls)}")
    assert 2 <= len(calls) and time.monotonic() - t0 >= 0.1
