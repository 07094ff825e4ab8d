"""Running reward calls on worker threads with a per-call deadline, so that no call can crash or hang the run.

Python cannot stop a thread. A call still running `timeout_s` after it started is therefore abandoned: its result
is dropped, its worker is retired (it exits whenever the call returns, if ever) and a fresh worker takes its
place, so a hung reward function costs one idle thread rather than the run. Workers are daemon threads, so an
abandoned call cannot keep the interpreter from exiting either (concurrent.futures joins its threads at exit).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class CallResult:
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class _Task:
    def __init__(self, index: int, fn: Callable[[Any], Any], arg: Any, batch: _Batch):
        self.index = index
        self.fn = fn
        self.arg = arg
        self.batch = batch
        self.worker: _Worker | None = None
        self.started_at = 0.0

    def run(self, worker: _Worker) -> None:
        self.worker = worker
        self.started_at = time.monotonic()
        self.batch.running[self.index] = self  # dict assignment is atomic; the pool reads it to find deadlines
        try:
            result = CallResult(value=self.fn(self.arg))
        except BaseException as e:  # a worker must survive whatever the reward function raises
            result = CallResult(error=e, traceback=traceback.format_exc())
        self.batch.running.pop(self.index, None)
        self.batch.results.put((self.index, result))


class _Batch:
    """The calls of one `map`: results arrive on `results`; `running` holds the calls started and not finished
    (workers add and remove their own; the pool removes the ones it abandons)."""

    def __init__(self) -> None:
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.running: dict[int, _Task] = {}


class _Worker(threading.Thread):
    def __init__(self, tasks: queue.SimpleQueue, name: str):
        super().__init__(name=name, daemon=True)
        self.tasks = tasks
        self.retired = False

    def run(self) -> None:
        while not self.retired:
            task = self.tasks.get()
            if task is None:
                return
            task.run(self)


class TimeoutPool:
    """A fixed number of daemon worker threads running calls with a per-call timeout."""

    def __init__(self, num_workers: int, name: str = "reward"):
        if num_workers <= 0:
            raise ValueError(f"num_workers ({num_workers}) must be positive")
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._spawned = 0
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        worker = _Worker(self._tasks, f"{self.name}-{self._spawned}")
        self._spawned += 1
        worker.start()
        self._workers.append(worker)

    @property
    def num_abandoned(self) -> int:
        """Workers retired because a call ran past its deadline (some may still be running it)."""
        return self._spawned - len(self._workers)

    def map(self, fn: Callable[[Any], Any], args: Sequence[Any], timeout_s: float | None) -> list[CallResult]:
        """fn(arg) for each arg, in order; every call either returns, raises or times out, never hangs the caller."""
        batch = _Batch()
        for i, arg in enumerate(args):
            self._tasks.put(_Task(i, fn, arg, batch))
        out: list[CallResult | None] = [None] * len(args)
        num_pending = len(args)
        while num_pending:
            wait = None
            if timeout_s is not None:
                num_pending -= self._expire(batch, out, timeout_s)
                if not num_pending:
                    break
                wait = self._time_to_next_deadline(batch, timeout_s)
            try:
                index, result = batch.results.get(timeout=wait)
            except queue.Empty:
                continue
            if out[index] is None:  # else it already timed out
                out[index] = result
                num_pending -= 1
        return out  # type: ignore[return-value]  # every slot is filled once nothing is pending

    def _expire(self, batch: _Batch, out: list[CallResult | None], timeout_s: float) -> int:
        """Abandon the calls running past their deadline; return how many."""
        now = time.monotonic()
        expired = [task for task in list(batch.running.values()) if task.started_at + timeout_s <= now]
        for task in expired:
            batch.running.pop(task.index, None)
            out[task.index] = CallResult(timed_out=True)
            worker = task.worker
            assert worker is not None
            worker.retired = True
            # A worker retired for a call that finished right at its deadline may already run another one that
            # now expires too; it was replaced once already.
            if worker in self._workers:
                self._workers.remove(worker)
                self._spawn()
        return len(expired)

    @staticmethod
    def _time_to_next_deadline(batch: _Batch, timeout_s: float) -> float:
        # A call that has not started cannot expire sooner than timeout_s from now.
        started = [task.started_at for task in list(batch.running.values())]
        return max(0.0, min(started, default=time.monotonic()) + timeout_s - time.monotonic())

    def close(self) -> None:
        """Stop the idle workers (after they finish what is queued); abandoned ones exit when their call returns."""
        for _ in self._workers:
            self._tasks.put(None)
        self._workers = []
