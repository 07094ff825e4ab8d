"""A watchdog for steps that never finish: a collective waiting for a rank that will not answer (stopped with
SIGSTOP, hung in a kernel or a driver, on a node that dropped off the network) would otherwise wait for as long
as torch.distributed's timeout, if that fires at all. Each worker names the phase it is in; a thread ends the
worker when one phase has lasted longer than parallel.watchdog_s, with a line naming the rank, the phase and the
step, and stops the processes the worker started (SGLang's, reward workers) first. torchrun then ends the other
workers.

    watchdog.start(cfg.parallel.watchdog_s, rank, lambda: run.last_checkpoint)   # once, in the loop
    watchdog.set_phase("rollout", step)     # rollout | forward | update | weight sync | checkpoint | ...
    watchdog.set_phase("forward")           # the same step

The watch runs in a thread because the main thread is the one that waits (inside a C call that Python signals
cannot interrupt). A phase is timed from its start, so the bound must cover the longest legitimate phase
(rollouts of long responses, checkpoints of big models), including the time a rank waits for rank 0's rollout.
No torch here.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from mcore_rl.procs import end_worker

HUNG_EXIT_CODE = 1
"""Exit status of a worker the watchdog stopped."""

_phase: tuple[str, int | None, float] | None = None  # (name, step, monotonic start); None: not watched
_step: int | None = None


def set_phase(name: str | None, step: int | None = None) -> None:
    """This worker enters phase `name` now, of `step` (None: the step of the last call that named one). name
    None: nothing is watched until the next phase. The phases are the main thread's (the one that joins the
    collectives): a call from another thread (rank 0's asynchronous rollout producer) changes nothing."""
    global _phase, _step
    if threading.current_thread() is not threading.main_thread():
        return
    if step is not None:
        _step = step
    _phase = None if name is None else (name, _step, time.monotonic())


def current_phase() -> str | None:
    return None if _phase is None else _phase[0]


def start(timeout_s: float, rank: int, last_checkpoint: Callable[[], object] = lambda: None,
          poll_s: float = 1.0, grace_s: float = 3.0) -> threading.Thread | None:
    """Watch this worker's phases from now on (a daemon thread); None when timeout_s <= 0 (off)."""
    if timeout_s <= 0:
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            phase = _phase
            if phase is not None and time.monotonic() - phase[2] > timeout_s:
                break
        name, step, since = phase
        where = f"the {name} phase of step {step}" if step is not None else f"the {name} phase"
        end_worker(
            f"rank {rank}: {where} has not finished after {time.monotonic() - since:.0f} s "
            f"(parallel.watchdog_s={timeout_s:g}): a collective is waiting for a rank that does not answer (stopped, "
            f"hung or dead; look for its error above), or this rank is stuck. Last checkpoint: "
            f"{last_checkpoint() or 'none this run'}; continue with trainer.resume=auto, or raise "
            f"parallel.watchdog_s if {name} legitimately takes longer. Stopping worker {os.getpid()} and the "
            "processes it started", HUNG_EXIT_CODE, grace_s)

    thread = threading.Thread(target=watch, name="mcore_rl-watchdog", daemon=True)
    thread.start()
    return thread
