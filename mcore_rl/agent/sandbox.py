"""Running untrusted Python written by the model: one fresh, limited, short-lived process per call.

`run_python(code, limits)` (and the `PythonExecutor` tool in tools.py that wraps it) starts this very file as a
script, `python -I -S -X utf8 sandbox.py <settings>`, in a new empty temporary directory that is its working
directory and is deleted afterwards. That launcher process sets the limits below on itself and then runs the
code. No `preexec_fn` is used: it is unsafe in a process with threads (the rollout calls tools from a thread
pool) and would make the trainer fork in full instead of vfork; the launcher is a fresh single-threaded process.

What keeps the code in, layer by layer (docs/agent_tools.md has the same as a table):

Kernel-enforced, always (the kernel refuses, whatever the code does, ctypes included):
  - rlimits on every process of the sandbox: RLIMIT_CPU (CPU seconds; SIGXCPU then SIGKILL), RLIMIT_AS (address
    space, so an allocation beyond it fails with MemoryError), RLIMIT_FSIZE (largest file written),
    RLIMIT_NOFILE (open descriptors), RLIMIT_CORE = 0 (no core dumps).
  - a wall-clock deadline kept by the caller, which then SIGKILLs the sandbox's process group (it is started in
    a session of its own); the output is read as it comes and the group is killed once it passes a cap.
  - PR_SET_PDEATHSIG: the launcher is SIGKILLed when the trainer thread that started it exits, however the
    trainer dies (the check of the parent pid right after closes the race with a parent that died first).
  - a clean environment: only PATH, HOME (= the temporary directory), TMPDIR, LANG; nothing inherited, so no
    credentials in os.environ; -I ignores PYTHON* variables, the user site and the current directory.

Kernel-enforced where the kernel lets an unprivileged process create namespaces (unshare(2) of CLONE_NEWUSER
with NEWNET, NEWPID and NEWNS; `namespaces_available()` says whether it did here; the result's `isolation`
names what each call got):
  - network: a new network namespace with no interface up but a loopback that is down, so every connect, to
    127.0.0.1 included, fails with "Network is unreachable"; no abstract unix sockets of the host either.
  - processes: the code runs as pid 1 of a new pid namespace; when it ends (or is killed) the kernel kills
    every process left in it, so a double fork or setsid() cannot leave anything behind; it cannot see or
    signal the trainer's processes; a fresh /proc is mounted so /proc/<pid>/environ of the trainer is gone.
    RLIMIT_NPROC counts the sandbox's own processes and threads only (its user namespace's), so a fork bomb
    stops at `max_processes` -- except when the trainer runs as root: Linux never applies RLIMIT_NPROC to
    uid 0, and an unprivileged user namespace can only map our own uid, so a root trainer's sandbox is bounded
    in number of processes by the guard only (in time, by the deadline and the pid namespace).
  - files: a new mount namespace in which every mount is read-only except the temporary directory (and /dev
    nodes such as /dev/null). Reading stays possible wherever the trainer's user can read.
  - no capabilities over the host: the process is root only inside its own user namespace.

Only a Python-level guard (sys.addaudithook, installed just before the code runs; `python_guard=True`, the
default, in both cases). It gives clear "denied" errors, and it is the only barrier where namespaces are
unavailable, but code that reaches C directly can get around it (ctypes calls and loads are refused by the
hook; a flaw in the interpreter, a C extension, or `_posixsubprocess` are not):
  - socket.* (creating, connecting, binding, name lookups);
  - opening a file for writing, creating, removing, renaming, linking or changing the mode of a path outside
    the temporary directory; reading /proc/<pid>/ of another process;
  - subprocess, os.system, os.exec*, os.spawn*, os.posix_spawn*, os.fork, pty, os.kill / killpg;
  - ctypes (dlopen, dlsym, calling a foreign function).
Without namespaces and when the trainer runs as root, RLIMIT_NPROC is not enforced by Linux at all; without
namespaces and as any other user it counts all of that user's processes, so it is set to the number the user
already has (no new process at all).

Not protected against at all: reading any file the trainer's user can read (source, configs, checkpoints,
~/.ssh when running as root: keep secrets out of readable files or run the trainer as a user without them);
CPU and memory bandwidth taken from the trainer within the limits (use nice/cgroups around the trainer);
kernel exploits; side channels; writes through /dev nodes the user may write; a tmpfs /tmp filled within
RLIMIT_FSIZE per file when namespaces are unavailable.

Run the launcher by hand only through run_python; as a script it expects the settings JSON as its argument.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

# Exit statuses the launcher uses to say how the code ended (the caller maps them to ToolResult.error kinds).
EXIT_EXCEPTION = 101
EXIT_MEMORY = 102
EXIT_DENIED = 103
EXIT_SETUP = 104


@dataclass
class SandboxLimits:
    """Per-call limits of the Python sandbox (defaults are those of the shipped `python` tool)."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole sandbox is killed (error "timeout")."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU); a busy loop ends at min(cpu_s, timeout_s)."""
    memory_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS); a larger allocation raises MemoryError (error "limit")."""
    file_size_mb: int = 16
    """Largest file the code may write, in MiB (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_processes: int = 8
    """Processes and threads of the code (RLIMIT_NPROC inside its user namespace); a fork bomb stops here."""
    max_output_bytes: int = 8192
    """Bytes of stdout kept (its head), and of stderr (its tail), in what the model reads."""
    kill_output_bytes: int = 1 << 20
    """Once stdout + stderr pass this many bytes the sandbox is killed (error "limit")."""
    network: bool = False
    """True keeps the host's network namespace (and lets the guard allow sockets). False: no network."""
    python_guard: bool = True
    """Install the audit-hook guard (clear "denied" errors; the only barrier where namespaces are unavailable)."""
    use_namespaces: bool = True
    """Try user/net/pid/mount namespaces (kernel boundaries); false: rlimits + guard only."""

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "max_open_files", "max_processes",
                    "max_output_bytes", "kill_output_bytes"):
            if not getattr(self, key) > 0:
                raise ValueError(f"sandbox limit {key} ({getattr(self, key)}) must be positive")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox limit memory_mb ({self.memory_mb}) must be >= 64: the interpreter alone "
                             "maps about 30 MiB")
        if self.kill_output_bytes < 2 * self.max_output_bytes:
            raise ValueError(f"kill_output_bytes ({self.kill_output_bytes}) must be at least twice "
                             f"max_output_bytes ({self.max_output_bytes})")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    error: str | None
    """None, or a ToolResult error kind: timeout, exception, limit, denied, crashed."""
    message: str = ""
    """Why it failed, in words for the model (empty on success)."""
    seconds: float = 0.0
    truncated: bool = False
    isolation: list[str] = field(default_factory=list)
    """The kernel namespaces this call got, e.g. ["user", "net", "pid", "mount", "proc"]; [] = rlimits + guard."""


def run_python(code: str, limits: SandboxLimits | None = None, tmp_root: str | None = None) -> SandboxResult:
    """Run `code` in a fresh sandbox and return what it printed and how it ended. Thread-safe; never raises for
    anything the code does; returns within about limits.timeout_s (plus process start-up and clean-up)."""
    # Imported here, not at the top: the launcher runs this file too, and the code it runs must not find
    # _posixsubprocess already loaded (it forks without raising an audit event).
    import shutil
    import subprocess
    import tempfile

    limits = limits or SandboxLimits()
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="mcore_rl_py_", dir=tmp_root)
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        settings = {**asdict(limits), "workdir": workdir, "parent_pid": os.getpid()}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-X", "utf8", os.path.abspath(__file__), json.dumps(settings)],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True,
        )
        result = _collect(proc, limits, start)
    finally:
        # The code may have made read-only folders; make them writable again so rmtree can empty them.
        shutil.rmtree(workdir, onerror=_force_remove)
    result.seconds = time.monotonic() - start
    return result


def _force_remove(func, path, exc_info) -> None:
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass  # a leftover in the system's temp folder is better than an exception in the trainer


def _collect(proc, limits: SandboxLimits, start: float) -> SandboxResult:
    """Read stdout/stderr of `proc` (a subprocess.Popen) until both close, the deadline passes or the output cap
    is hit; then make sure nothing of the sandbox's process group is left, and interpret the exit status."""
    import selectors

    deadline = start + limits.timeout_s
    out, err = bytearray(), bytearray()
    total = 0
    stopped: str | None = None  # why we killed it, if we did
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(timeout=remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                total += len(chunk)
                buf = key.data
                buf += chunk
                if buf is out:
                    del out[limits.max_output_bytes:]  # keep the head of stdout
                else:
                    del err[:-limits.max_output_bytes]  # and the tail of stderr, where tracebacks end
            if total > limits.kill_output_bytes:
                stopped = "limit"
                break
        # Pipes closed (or we gave up on them): wait for the exit, still within the deadline, without reaping,
        # so the process group id stays reserved until we have killed the group.
        while stopped is None and not _exited(proc.pid):
            if time.monotonic() >= deadline:
                stopped = "timeout"
                break
            time.sleep(0.005)
    finally:
        sel.close()
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    truncated = total > len(out) + len(err)
    isolation = _isolation_line(stderr)
    stderr = "\n".join(line for line in stderr.split("\n") if not line.startswith(_ISOLATION_PREFIX))
    error, message = _interpret(proc.returncode, stopped, stderr, limits)
    if error is None and truncated:
        error, message = "limit", f"output cut to {limits.max_output_bytes} bytes of stdout"
    return SandboxResult(stdout, stderr, proc.returncode, error, message, truncated=truncated, isolation=isolation)


def _exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _interpret(returncode: int, stopped: str | None, stderr: str, limits: SandboxLimits) -> tuple[str | None, str]:
    if stopped == "timeout":
        return "timeout", f"the code ran past the {limits.timeout_s:g} s time limit and was stopped"
    if stopped == "limit":
        return "limit", (f"the code printed more than {limits.kill_output_bytes} bytes and was stopped; "
                         "print less")
    if returncode == 0:
        return None, ""
    if returncode == EXIT_EXCEPTION:
        return "exception", _last_line(stderr) or "the code raised an exception"
    if returncode == EXIT_MEMORY:
        return "limit", f"MemoryError: the code needs more than the {limits.memory_mb} MiB memory limit"
    if returncode == EXIT_DENIED:
        return "denied", _last_line(stderr) or "the code did something the sandbox does not allow"
    if returncode == EXIT_SETUP:
        return "crashed", "the sandbox could not be set up: " + (_last_line(stderr) or "unknown reason")
    if returncode < 0 or 128 < returncode < 128 + 65:
        sig = -returncode if returncode < 0 else returncode - 128
        if sig == signal.SIGXCPU or sig == signal.SIGKILL and "CPU" in stderr:
            return "timeout", f"the code used more than its {limits.cpu_s} s CPU time limit and was stopped"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return "crashed", f"the process was killed by {name}"
    return "exception", f"the code exited with status {returncode}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().split("\n") if line.strip()]
    return lines[-1].strip() if lines else ""


_ISOLATION_PREFIX = "\x00mcore_rl_sandbox_isolation="


def _isolation_line(stderr: str) -> list[str]:
    for line in stderr.split("\n"):
        if line.startswith(_ISOLATION_PREFIX):
            value = line[len(_ISOLATION_PREFIX):]
            return value.split(",") if value else []
    return []


_NAMESPACES_AVAILABLE: list[str] | None = None


def namespaces_available() -> list[str]:
    """The namespaces a sandbox gets on this machine (runs one trivial sandbox the first time; cached)."""
    global _NAMESPACES_AVAILABLE
    if _NAMESPACES_AVAILABLE is None:
        _NAMESPACES_AVAILABLE = run_python("pass").isolation
    return _NAMESPACES_AVAILABLE


# --- the launcher: everything below runs inside the sandbox process (only the standard library; -I -S) -------

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_MS_REC, _MS_BIND, _MS_PRIVATE = 0x4000, 0x1000, 0x40000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture that has it (Linux >= 5.12)
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY = 0x1


class SandboxDenied(PermissionError):
    """The guard refused an operation (raised inside the sandbox)."""


def _launch(settings: dict) -> None:
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    workdir = settings["workdir"]

    # Die with the trainer thread that started us; if it is already gone, the prctl came too late.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != settings["parent_pid"]:
        os._exit(EXIT_SETUP)

    mb = 1 << 20
    for res, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, settings["memory_mb"] * mb),
                       (resource.RLIMIT_FSIZE, settings["file_size_mb"] * mb),
                       (resource.RLIMIT_NOFILE, settings["max_open_files"])):
        resource.setrlimit(res, (value, value))
    # The hard limit one second later: SIGXCPU first (Python's default action: die), SIGKILL if it is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (settings["cpu_s"], settings["cpu_s"] + 1))

    isolation = _unshare(libc, settings) if settings["use_namespaces"] else []
    if "user" in isolation:
        # Our own user namespace counts only our processes: the launcher (and its pid-1 child) plus the code's.
        extra = 2 if "pid" in isolation else 0  # the relaying launcher and pid 1
        resource.setrlimit(resource.RLIMIT_NPROC, (settings["max_processes"] + extra,) * 2)
    elif os.getuid() != 0:
        # Outside a user namespace the count is every process of this user: allow no new one at all.
        import glob
        num = sum(1 for p in glob.glob("/proc/[0-9]*") if _owner(p) == os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (num, num))

    if "pid" in isolation:
        # unshare(CLONE_NEWPID) applies to our children: the code runs in a child that is pid 1 of the new
        # namespace; this process only relays its end, so the caller sees the code's exit status or signal.
        child = os.fork()
        if child:
            _relay_exit(child)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # pid 1 dies with the launcher, and takes the rest along
        if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) == 0:
            isolation.append("proc")
        # pid 1 ignores signals it has no handler for (raise(SIGSEGV), kill(getpid(), SIGTERM)) and inherits
        # orphans; the code runs as pid 2 so that it behaves as usual, and pid 1 relays its end.
        code_pid = os.fork()
        if code_pid:
            _relay_exit(code_pid)
    os.chdir(workdir)  # the bind mount now over workdir (the inherited cwd is the read-only mount below it)
    sys.stderr.write(_ISOLATION_PREFIX + ",".join(isolation) + "\n")
    sys.stderr.flush()
    del libc
    for name in ("ctypes", "_ctypes", "ctypes._endian"):  # a fresh import is then refused by the guard
        sys.modules.pop(name, None)
    _run_user_code(settings, workdir)


def _owner(proc_dir: str) -> int:
    try:
        return os.stat(proc_dir).st_uid
    except OSError:
        return -1


def _unshare(libc, settings: dict) -> list[str]:
    """New user + network (unless network=True) + pid + mount namespaces, as far as the kernel allows; returns
    the names of those obtained."""
    uid, gid = os.getuid(), os.getgid()
    net = 0 if settings["network"] else _CLONE_NEWNET
    got: list[str] = []
    for flags, names in ((_CLONE_NEWUSER | net | _CLONE_NEWPID | _CLONE_NEWNS, ["user", "net", "pid", "mount"]),
                         (_CLONE_NEWUSER | net, ["user", "net"])):
        if libc.unshare(flags) == 0:
            got = [n for n in names if n != "net" or net]
            break
    if not got:
        return []
    try:
        # Map our own uid/gid to themselves, so files and messages look as outside.
        libc.prctl(_PR_SET_DUMPABLE, 1)
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    except OSError:
        pass  # unmapped, we are "nobody" inside; the namespaces still hold
    if "mount" in got and not _read_only_except(libc, settings["workdir"]):
        got.remove("mount")
    return got


def _read_only_except(libc, workdir: str) -> bool:
    """In our mount namespace: every mount read-only, except a bind mount of workdir. False if it failed."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    # Private first, so nothing we do here can reach the host's mount table.
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    path = workdir.encode()
    if libc.mount(path, path, None, _MS_BIND | _MS_REC, None) != 0:
        return False
    ro, rw = MountAttr(attr_set=_MOUNT_ATTR_RDONLY), MountAttr(attr_clr=_MOUNT_ATTR_RDONLY)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    if syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, ctypes.byref(ro), ctypes.sizeof(ro)) != 0:
        return False
    return syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path, 0, ctypes.byref(rw), ctypes.sizeof(rw)) == 0


def _relay_exit(child: int) -> None:
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # pid 1 cannot die of its own signal; _interpret reads 128 + sig as the signal
    os._exit(os.WEXITSTATUS(status))


def _run_user_code(settings: dict, workdir: str) -> None:
    import traceback

    with open(os.path.join(workdir, "main.py"), encoding="utf-8") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        traceback.print_exc(limit=0)
        sys.stderr.flush()
        os._exit(EXIT_EXCEPTION)
    if settings["python_guard"]:
        sys.addaudithook(_make_guard(workdir, settings["network"]))
    status = 0
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = 0 if e.code in (None, 0) else EXIT_EXCEPTION
        if status:
            sys.stderr.write(f"SystemExit: {e.code}\n")
    except MemoryError:
        status = EXIT_MEMORY
        sys.stderr.write("MemoryError\n")
    except SandboxDenied as e:
        status = EXIT_DENIED
        _print_user_traceback(e, traceback)
    except BaseException as e:  # the model's code may raise anything; it all becomes a traceback for the model
        status = EXIT_EXCEPTION
        _print_user_traceback(e, traceback)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status)


def _print_user_traceback(e: BaseException, traceback) -> None:
    """The traceback without the launcher's and the guard's frames: the model should see only its own code."""
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) != here]
    sys.stderr.write("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames[-8:])))
    sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))


_REFUSED_IMPORTS = frozenset({"_posixsubprocess", "ctypes", "_ctypes", "_socket", "socket"})
_REFUSED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen",
                   "ctypes.dlsym", "ctypes.call_function", "os.add_dll_directory")
_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.symlink": 2, "os.link": 2,
                "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "shutil.move": 2, "shutil.copyfile": 2, "shutil.copytree": 2, "os.chflags": 1, "os.setxattr": 1,
                "os.removexattr": 1, "os.mkfifo": 1, "os.mknod": 1}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _make_guard(workdir: str, network: bool):
    inside_root = os.path.realpath(workdir)
    own_proc = (f"/proc/{os.getpid()}", "/proc/self", "/proc/thread-self")

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an already open descriptor: opening it was checked
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == inside_root or real.startswith(inside_root + os.sep)

    def deny(what: str) -> None:
        raise SandboxDenied(f"sandbox: {what} is not allowed here (no network, no processes, and writes only "
                            "inside the current directory)")

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writing and not inside(path):
                deny(f"writing {path!r}")
            if isinstance(path, (str, bytes)):
                real = os.path.realpath(os.fsdecode(path))
                if real.startswith("/proc/") and real.split("/")[2].isdigit() and not real.startswith(own_proc):
                    deny(f"reading another process's {real!r}")
        elif event.startswith("socket.") and not network:
            deny(f"network access ({event})")
        elif event == "import" and args[0] in _REFUSED_IMPORTS and not (network and "socket" in args[0]):
            deny(f"network access (import {args[0]})" if "socket" in args[0] else f"import {args[0]}")
        elif event.startswith(_REFUSED_EVENTS):
            deny(f"{event}")
        elif event in _PATH_EVENTS:
            for path in args[:_PATH_EVENTS[event]]:
                if not inside(path):
                    deny(f"{event} on {path!r}")

    return guard


if __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]))
    except Exception as e:  # a set-up failure, before the code ran: say what, with a status the caller knows
        sys.stderr.write(f"sandbox set-up failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(EXIT_SETUP)
