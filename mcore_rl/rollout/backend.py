"""What RolloutEngine needs from an SGLang deployment, and the waiting logic both deployments share.

Two implementations: `InProcessBackend` (sglang.Engine in this process, scheduler in child processes) and
`ServerBackend` (an HTTP server we launch or attach to). Every call that can block on SGLang is waited for
here, in small steps, so that a dead engine or an expired deadline becomes a RolloutEngineError within about
`POLL_S` instead of a hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from typing import Any, Callable, Sequence

from mcore_rl.rollout.errors import RolloutEngineError

POLL_S = 0.2


class Backend:
    """Base: a one-thread executor for engine calls plus liveness-checked waiting. Subclasses implement the
    SGLang operations; each returns SGLang's own result (`(success, message)` or an object) or raises."""

    name = "backend"

    def __init__(self) -> None:
        # One call at a time: SGLang's in-process client is not safe to drive from two threads at once, and
        # weight operations must not overlap either.
        self._call_lock = threading.Lock()
        self._broken: str | None = None

    # -- liveness ---------------------------------------------------------------------------------------------
    def dead_reason(self) -> str | None:
        """None while the engine can serve; otherwise what happened (a process died, a call timed out...)."""
        return self._broken

    def check_alive(self, doing: str) -> None:
        reason = self.dead_reason()
        if reason is not None:
            raise RolloutEngineError(f"SGLang {self.name} is not usable ({reason}); cannot {doing}. "
                                     "Shut this RolloutEngine down and create a new one.")

    # -- calls ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> cf.Future:
        return run_in_thread(fn, *args, lock=self._call_lock, **kwargs)

    def wait(self, future: cf.Future, doing: str, timeout_s: float, on_timeout: Callable[[], None] | None = None):
        """Result of `future`, or RolloutEngineError when the engine dies or `timeout_s` passes first.

        A call that times out leaves SGLang in an unknown state (it may still apply the update later), so the
        backend is marked unusable unless `on_timeout` cleans up (generation aborts its requests instead)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=POLL_S)
            except cf.TimeoutError:
                pass
            reason = self.dead_reason()
            if reason is not None:
                raise RolloutEngineError(f"SGLang {self.name} failed while trying to {doing}: {reason}")
            if time.monotonic() > deadline:
                if on_timeout is not None:
                    on_timeout()
                else:
                    self._broken = f"'{doing}' did not finish within {timeout_s:g} s"
                raise RolloutEngineError(
                    f"SGLang {self.name}: '{doing}' did not finish within {timeout_s:g} s "
                    "(rollout.request_timeout_s). Raise the timeout if the work is just slow; otherwise check the "
                    "engine's log for a stuck or overloaded scheduler.")

    def call(self, doing: str, timeout_s: float, fn: Callable[..., Any], *args, **kwargs):
        self.check_alive(doing)
        return self.wait(self.submit(fn, *args, **kwargs), doing, timeout_s)

    # -- to implement -----------------------------------------------------------------------------------------
    def generate(self, requests: list[dict] | RequestFeed, timeout_s: float, max_concurrent: int,
                 on_done: Callable[[int, list[dict]], None]) -> None:
        """Run generate requests (GenerateReqInput fields), at most `max_concurrent` at once; call
        on_done(index, outputs) as each finishes. Each request must finish within `timeout_s` of its start.
        `requests` is a list, or a RequestFeed whose requests may arrive while this runs (it returns once the
        feed is closed and every request it gave has finished; after feed.abort(), once the requests in flight
        have returned what they had, with no on_done for the requests never sent)."""
        raise NotImplementedError

    def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session if this SGLang has one; return whether it did."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class RequestFeed:
    """Generate requests handed to a running Backend.generate call, from any thread: multi-turn rollouts send a
    trajectory's next turn as soon as its tool has replied, while other trajectories still generate.

        feed = RequestFeed()
        thread: backend.generate(feed, timeout_s, max_concurrent, on_done)    # returns after close + drain
        feed.put(request) -> index (the index on_done reports) ... feed.close()

    A list of requests is the feed that holds them and is closed (what Backend.generate makes of a list)."""

    def __init__(self, requests: Sequence[dict] = (), *, closed: bool = False):
        self._lock = threading.Lock()
        self._new: list[tuple[int, dict]] = []
        self._count = 0
        self._closed = False
        self._aborted = False
        self._wake: Callable[[], None] | None = None
        for request in requests:
            self.put(request)
        if closed:
            self.close()

    @classmethod
    def of(cls, requests: list[dict] | RequestFeed) -> RequestFeed:
        return requests if isinstance(requests, RequestFeed) else cls(requests, closed=True)

    def put(self, request: dict) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("RequestFeed.put() after close()")
            index = self._count
            self._count += 1
            self._new.append((index, request))
            wake = self._wake
        if wake is not None:
            wake()
        return index

    def close(self) -> None:
        """No more requests: the generate call returns once those given have finished."""
        with self._lock:
            self._closed = True
            wake = self._wake
        if wake is not None:
            wake()

    def abort(self) -> None:
        """Stop early: the generate call aborts the requests in flight (SGLang returns what each has generated
        so far, finish_reason abort), sends none of those not yet sent (no on_done for them), and returns."""
        with self._lock:
            self._closed = self._aborted = True
            wake = self._wake
        if wake is not None:
            wake()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def take(self) -> tuple[list[tuple[int, dict]], bool]:
        """(index, request) of every request put since the last take, and whether the feed is closed."""
        with self._lock:
            new, self._new = self._new, []
            return new, self._closed

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """The generate call's way to be woken by put() and close() (None when it returns)."""
        with self._lock:
            self._wake = wake


class Interrupt:
    """A handle that stops generate calls early from another thread (RolloutEngine.generate(interrupt=...)):
    fire() aborts the RequestFeed of every call attached now or later. Asynchronous rollouts fire it at a weight
    sync and continue the unfinished samples with the new weights (mcore_rl.rollout.partial)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._feeds: list[RequestFeed] = []
        self._fired = False

    @property
    def fired(self) -> bool:
        return self._fired

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            feeds = list(self._feeds)
        for feed in feeds:
            feed.abort()

    def attach(self, feed: RequestFeed) -> None:
        with self._lock:
            self._feeds.append(feed)
            fired = self._fired
        if fired:
            feed.abort()


def run_in_thread(fn: Callable[..., Any], *args, lock: threading.Lock | None = None, **kwargs) -> cf.Future:
    """fn(*args, **kwargs) on a daemon thread (holding `lock` if given), as a Future. Not a ThreadPoolExecutor:
    its workers are joined at interpreter exit, so a call stuck on a dead engine would hang the program's exit."""
    future: cf.Future = cf.Future()

    def run():
        with lock if lock is not None else contextlib.nullcontext():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=f"sglang-call-{getattr(fn, '__name__', 'fn')}").start()
    return future


def check_result(result: Any, doing: str) -> str:
    """SGLang returns (success, message[, ...]) tuples or objects with .success/.message; raise on failure."""
    success, message = outcome(result)
    if not success:
        raise RolloutEngineError(f"SGLang refused to {doing}: {message}")
    return message


def until_accepted(call: Callable[[], Any], timeout_s: float, every_s: float = 0.05) -> Any:
    """`call()` (an SGLang request that it refuses while busy, e.g. a cache flush) repeated every `every_s` until its
    result is a success or `timeout_s` has passed; the last result, for outcome / check_result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = call()
        if outcome(result)[0] or time.monotonic() >= deadline:
            return result
        time.sleep(every_s)


def outcome(result: Any) -> tuple[bool, str]:
    """(success, message) of an SGLang call's result (see check_result)."""
    if result is None:
        return True, ""
    if isinstance(result, dict):
        success, message = result.get("success", True), result.get("message", "")
    elif isinstance(result, (tuple, list)):
        success, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    else:
        success, message = getattr(result, "success", True), getattr(result, "message", "")
    return bool(success), message
