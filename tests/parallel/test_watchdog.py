"""mcore_rl/parallel/watchdog.py with a real process: a phase that outlasts the bound ends the process (status 1)
with a line naming the rank, the phase and the step, and takes the process's children with it; a process whose
phases end in time, or that is not in a phase, is left alone. The trainer-level case (a peer stopped with SIGSTOP)
is tests/reliability/test_runtime_faults.py."""

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.config.trainer import TrainerConfig

STUCK = textwrap.dedent("""
    import subprocess, sys, time
    from mcore_rl.parallel import watchdog
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    watchdog.start(float(sys.argv[1]), rank=3, last_checkpoint=lambda: "ckpt/step_0000002", poll_s=0.1, grace_s=1.0)
    for phase in ("rollout", "forward"):   # each phase shorter than the bound
        watchdog.set_phase(phase, 7)
        time.sleep(0.5)
    watchdog.set_phase(None)               # not watched: may take as long as it likes
    time.sleep(float(sys.argv[1]) + 1)
    watchdog.set_phase("update")           # the same step
    time.sleep(120)                        # stuck, as in a collective that never completes
""")


def test_a_phase_past_the_bound_ends_the_process_and_its_children():
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", STUCK, "1.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        child = int(proc.stdout.readline())
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    # start-up, 1 s of phases in time, 2.5 s unwatched, then 1.5 s of update: the watchdog fired in "update"
    assert took < 30, took
    assert ("mcore_rl: rank 3: the update phase of step 7 has not finished after 2 s (parallel.watchdog_s=1.5)"
            in err), err
    assert "Last checkpoint: ckpt/step_0000002; continue with trainer.resume=auto" in err, err
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the stuck process's child outlived it"
        time.sleep(0.1)


def test_off_and_bad_bounds():
    from mcore_rl.parallel import watchdog

    assert watchdog.start(0, rank=0) is None  # 0 = off: no thread
    with pytest.raises(ValueError, match=r"parallel.watchdog_s must be >= 0 seconds \(0 = off\), got -1"):
        ParallelConfig(watchdog_s=-1)
    with pytest.raises(ValueError, match="trainer.on_nonfinite must be stop or skip, got 'ignore'"):
        TrainerConfig(on_nonfinite="ignore")
