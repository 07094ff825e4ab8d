"""Process lifecycle of a run: workers that die with their launcher, and one writer per output folder.

torchrun (torch elastic) starts each worker in a session of its own, so when the torchrun process itself is
killed (`kill -9`, an OOM killer, a scheduler killing the job's head process) no signal reaches the workers:
they would go on training and writing checkpoints. `follow_launcher()` starts a watchdog thread in the worker
that notices its parent is gone (the parent pid changes when a process is re-parented) and then kills the
processes this worker started (SGLang's scheduler and detokenizer, a launched server, reward workers) and exits.
Processes the worker did not start are never touched: only its own descendants, found through /proc by psutil.

`die_with_parent()` is the same promise for a child we launch ourselves (the SGLang HTTP server): a
`preexec_fn` that asks Linux to SIGKILL the child when its parent dies, however the parent dies. SGLang's own
scheduler processes already do this for their parent.

`StopSignals` turns SIGTERM (what SLURM and Kubernetes send before they kill) into a request the training loop
reads at its next safe point, where it saves a checkpoint and exits; inside `StopSignals.interrupting()` (a
start-up that has no safe point, such as the rollout engine's) it raises StopRequested instead. torchrun sends
it to each worker's whole process group, so the in-process SGLang engine's children get it too:
mcore_rl/rollout/inprocess.py starts them with it blocked (a blocked signal stays blocked across exec, and the
worker's own handler still runs) and takes SGLang's own SIGTERM handler (drain and shut down) off its event loop,
so the engine lives until the run has saved; it ends with the run (parent-death signal, or the engine's
shutdown, which uses SIGKILL).

`OutputLock` is an OS file lock (fcntl.flock) on `<folder>/.lock`, held for a run's lifetime and released by
the kernel when the holder dies, however it dies; the file records who holds it (host, pid, start time) for the
message a second run gets. flock is not reliable on every network file system (NFS before v4 may not honour
it); docs/troubleshooting.md says so.

Linux only for the parent-death parts (prctl); elsewhere they do nothing. No torch, no Megatron here.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("mcore_rl")

ORPHANED_EXIT_CODE = 75
"""Exit status of a worker that stopped because its launcher died (EX_TEMPFAIL: the job can be run again)."""

STOPPED_EXIT_CODE = 80
"""Exit status of a run that stopped on a stop signal (trainer.stop_signals) after saving its checkpoint."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child, before exec (subprocess.Popen(preexec_fn=die_with_parent)): Linux sends `sig` to this process
    when the thread that forked it exits. Does nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, sig)


def kill_descendants(timeout_s: float = 3.0) -> int:
    """SIGTERM every descendant of this process, then SIGKILL those still alive after timeout_s. Returns how many
    there were."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    return len(children)


def end_worker(message: str, exit_code: int, grace_s: float) -> None:
    """From a watcher thread: write `message` (one line) to stderr, end the processes this worker started, and exit
    with `exit_code` at once (os._exit: no unwinding through threads that may be stuck). stderr directly: logging
    may hold a lock another thread left taken."""
    sys.stderr.write(f"mcore_rl: {message}\n")
    sys.stderr.flush()
    kill_descendants(grace_s)
    os._exit(exit_code)


def follow_launcher(poll_s: float = 0.5, grace_s: float = 3.0) -> threading.Thread | None:
    """Start a daemon thread that ends this process (and its descendants) within about poll_s + grace_s of its
    parent (the torchrun agent) dying. Returns the thread; None when the parent is already init (a process started
    by hand, not by a launcher, has nothing to follow)."""
    parent = os.getppid()
    if parent == 1:
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                break
        end_worker(f"the launcher (pid {parent}) is gone; stopping worker {os.getpid()} and the processes it "
                   "started", ORPHANED_EXIT_CODE, grace_s)

    thread = threading.Thread(target=watch, name="mcore_rl-follow-launcher", daemon=True)
    thread.start()
    return thread


class StopRequested(BaseException):
    """A stop signal arrived inside StopSignals.interrupting(). A BaseException, like KeyboardInterrupt, so that
    `except Exception` error handling lets it through. args[0]: the signal's name."""

    @property
    def signal_name(self) -> str:
        return self.args[0]


class StopSignals:
    """Note the first of `names` (e.g. ["SIGTERM", "SIGUSR1"]) that arrives, instead of dying of it.

    A Python handler, installed from the main thread: it runs there between bytecodes, whichever thread the
    signal reached, so a long C call (a collective, a kernel) delays it but does not lose it. `received` is the
    first signal's name (None before); later ones are logged and otherwise ignored, so a second SIGTERM cannot
    interrupt the save."""

    def __init__(self, names: list[str]):
        self.signals = [signal.Signals[n] for n in names]
        self.received: str | None = None
        self._interrupting = False

    def install(self) -> "StopSignals":
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, self._on_signal)
        return self

    @contextlib.contextmanager
    def interrupting(self):
        """Inside the block, the first stop signal raises StopRequested in the main thread (at once if one came
        before the block): for a wait with no safe point to stop at, such as the rollout engine's start-up."""
        if self.received is not None:
            raise StopRequested(self.received)
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def exit(self, code: int = STOPPED_EXIT_CODE) -> None:
        """Exit with `code`, ignoring the stop signals from now on: torchrun signals the workers still alive when
        one has exited, and Python's finalization (a second or two with SGLang loaded) gives a handled signal its
        default action back, so a worker would die of SIGTERM instead of exiting with its own status."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(code)

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != getattr(self, "_pid", os.getpid()):
            # A child forked after install (SGLang's scheduler and detokenizer when they fork) inherits this handler:
            # the process that installed it coordinates the stop and ends its children, so a child neither notes
            # nor logs it (a group-wide SIGTERM used to print "received SIGTERM" once per process).
            return
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            if self._interrupting:
                self._interrupting = False
                raise StopRequested(name)
            log.info("received %s: the run stops at the end of this step, saves a checkpoint and exits "
                     "(exit status %d)", name, STOPPED_EXIT_CODE)
        else:
            log.info("received %s again: still saving; the previous checkpoint stays `latest` until this one is "
                     "complete", name)


class OutputLockedError(RuntimeError):
    """Another live process holds the output folder's lock."""


class OutputLock:
    """An exclusive lock on `folder` for as long as this object is held (a context manager, or acquire/release).

        with OutputLock("outputs/run", what="training run"):
            ...   # a second OutputLock on the same folder raises OutputLockedError naming this holder
    """

    FILE = ".lock"

    def __init__(self, folder: str | os.PathLike, what: str = "run", lock_file: str | os.PathLike | None = None,
                 elsewhere: str = "trainer.output_dir=..."):
        """lock_file: where the lock lives; default `<folder>/.lock`. A folder that is replaced as a whole (an
        atomically written conversion output) needs its lock beside it: OutputLock.beside(path). elsewhere: how
        a refused process is pointed at another folder (its message says so)."""
        self.folder = os.fspath(folder)
        self.what = what
        self.elsewhere = elsewhere
        self.path = os.fspath(lock_file) if lock_file is not None else os.path.join(self.folder, self.FILE)
        self._fd: int | None = None

    @classmethod
    def beside(cls, path: str | os.PathLike, what: str = "run", elsewhere: str = "another output path") -> "OutputLock":
        """The lock of an output that is written elsewhere and renamed into place: `.<name>.lock` in its parent
        (hidden, so that `ls` of the parent shows the outputs only)."""
        path = os.path.abspath(os.fspath(path))
        return cls(path, what, lock_file=lock_path_beside(path), elsewhere=elsewhere)

    def acquire(self) -> "OutputLock":
        import fcntl

        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{self.folder} is in use by another {holder.get('what', 'process')} (host {holder.get('host', '?')}, "
                f"pid {holder.get('pid', '?')}, started {holder.get('started', '?')}). Wait for it to finish or stop "
                f"it, or point this one at another folder ({self.elsewhere})") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"what": self.what, "host": socket.gethostname(), "pid": os.getpid(),
                                 "started": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock; the file stays (harmless)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path_beside(path: str | os.PathLike) -> str:
    """`<parent>/.<name>.lock`: where the lock of an output renamed into place as a whole lives."""
    head, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(head, f".{name}.lock")


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}
