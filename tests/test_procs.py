"""mcore_rl/procs.py with real processes and signals: the output lock (held, named, released when its holder dies
however it dies), die_with_parent (a child launched with it does not outlive a parent killed with SIGKILL) and the
stop signals (noted, or raised inside `interrupting()`)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from mcore_rl.procs import OutputLock, OutputLockedError, StopRequested, StopSignals

HOLD = textwrap.dedent("""
    import sys, time
    from mcore_rl.procs import OutputLock
    lock = OutputLock(sys.argv[1], what="test holder").acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def _hold(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_with_the_holder_named(tmp_path):
    holder = _hold(tmp_path / "out")
    try:
        with pytest.raises(OutputLockedError) as e:
            OutputLock(tmp_path / "out", what="training run").acquire()
        msg = str(e.value)
        assert str(tmp_path / "out") in msg and f"pid {holder.pid}" in msg and "test holder" in msg
        assert "point this one at another folder" in msg
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    holder = _hold(tmp_path / "out")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    with OutputLock(tmp_path / "out"):  # the kernel dropped the dead holder's lock
        pass
    with OutputLock(tmp_path / "out"):  # and release() gave ours back
        pass


def test_lock_beside_an_atomically_replaced_output(tmp_path):
    lock = OutputLock.beside(tmp_path / "converted", what="conversion")
    assert lock.path == str(tmp_path / ".converted.lock")  # hidden, beside it
    with lock:
        with pytest.raises(OutputLockedError, match="in use by another conversion") as e:
            OutputLock.beside(tmp_path / "converted", elsewhere="another --out").acquire()
        assert "or point this one at another folder (another --out)" in str(e.value)


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from mcore_rl.procs import die_with_parent
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent,
                             start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux-only")
def test_child_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the child outlived its SIGKILLed parent"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def stop():
    previous = signal.getsignal(signal.SIGUSR1)
    yield StopSignals(["SIGUSR1"]).install()
    signal.signal(signal.SIGUSR1, previous)


def _deliver(sig=signal.SIGUSR1) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this (main) thread at the next bytecode


def test_stop_signal_is_noted_outside_interrupting(stop):
    _deliver()
    assert stop.received == "SIGUSR1"
    _deliver()  # a second one is logged, not raised
    with pytest.raises(StopRequested) as e:  # one that came before the block ends it at once
        with stop.interrupting():
            pytest.fail("the block ran after a stop signal")
    assert e.value.signal_name == "SIGUSR1"


def test_forked_child_leaves_the_stop_to_its_parent(stop):
    """A child forked after install inherits the handler; it notes nothing (its parent ends it)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports what its copy of the handler noted
        try:
            _deliver()
            os.write(write_end, (stop.received or "nothing").encode())
        finally:
            os._exit(0)
    os.close(write_end)
    noted = os.read(read_end, 100).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert noted == "nothing" and stop.received is None
    _deliver()  # the installing process still notes it
    assert stop.received == "SIGUSR1"


def test_stop_signal_ends_an_interrupting_block_once(stop):
    with pytest.raises(StopRequested, match="SIGUSR1"):
        with stop.interrupting():
            _deliver()
            time.sleep(5)
            pytest.fail("the signal did not interrupt the block")
    assert stop.received == "SIGUSR1" and not stop._interrupting
    _deliver()  # after the block: noted only
