"""SGLang as an HTTP server: `python -m sglang.launch_server` started here in its own process group, or an
existing server attached by URL. Used for disaggregated rollouts (the server may own other GPUs or hosts).

The launched server's output goes to a log file whose last lines are quoted in every startup or death error.
Tensors for /update_weights_from_tensor travel as torch shared-memory handles, so the server must be on the
same host; across hosts use the distributed or disk sync paths.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from mcore_rl.procs import die_with_parent
from mcore_rl.net import free_port
from mcore_rl.rollout import sgl_kernel_stand_in
from mcore_rl.rollout.backend import POLL_S, Backend, RequestFeed, check_result, run_in_thread
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.rollout.settings import to_cli

_CONNECT_TIMEOUT_S = 10.0


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


class ServerBackend(Backend):
    name = "server"

    def __init__(self, args: dict[str, Any] | None, host: str, port: int | None, startup_timeout_s: float,
                 url: str | None = None, tp_size: int = 1):
        """Launch a server with ServerArgs `args` on host:port (port None: a free one), or attach to `url`."""
        super().__init__()
        self.tp_size = tp_size
        self._proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self._begin_end: bool | None = None
        if url is not None:
            self.url = url.rstrip("/")
            self._wait_ready(startup_timeout_s, f"attach to the SGLang server at {self.url}")
            return
        if port is None:
            port = free_port(host)
        elif port_in_use(host, port):
            raise RolloutEngineError(
                f"cannot launch the SGLang server: port {port} on {host} is already in use. Set rollout.port to a "
                "free port, or to null to pick one; to use a server that is already running there, set "
                f"rollout.server_url=http://{host}:{port}.")
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", *to_cli({**args, "host": host, "port": port})]
        fd, self.log_path = tempfile.mkstemp(prefix=f"sglang_server_{port}_", suffix=".log")
        with os.fdopen(fd, "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            # Own session: shutdown can kill the server and everything it spawned, and nothing else.
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=sgl_kernel_stand_in.child_env(), start_new_session=True,
                                          preexec_fn=die_with_parent)  # never outlives this worker
        try:
            self._wait_ready(startup_timeout_s, f"start the SGLang server for model_path={args['model_path']!r}")
        except BaseException:
            self._kill()
            raise

    # -- process ----------------------------------------------------------------------------------------------
    def log_tail(self, num_lines: int = 25) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(lines[-num_lines:])

    def dead_reason(self) -> str | None:
        if self._broken is None and self._proc is not None and self._proc.poll() is not None:
            self._broken = f"the server process (pid {self._proc.pid}) exited with code {self._proc.returncode}"
        return self._broken

    def _wait_ready(self, timeout_s: float, doing: str) -> None:
        import requests

        deadline, last = time.monotonic() + timeout_s, "no answer yet"
        while time.monotonic() < deadline:
            if self.dead_reason() is not None:
                raise RolloutEngineError(f"failed to {doing}: {self._broken}. Check rollout.model_path (or "
                                         f"model.path) and the rollout.* engine settings.{self.log_tail()}")
            try:
                r = requests.get(f"{self.url}/health",
                                 timeout=max(0.1, min(_CONNECT_TIMEOUT_S, deadline - time.monotonic())))
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code} from /health"
            except requests.RequestException as e:
                last = f"{type(e).__name__}"
            time.sleep(0.5)
        raise RolloutEngineError(
            f"failed to {doing} within {timeout_s:g} s (rollout.startup_timeout_s); last health check: {last}. "
            f"Raise the timeout if loading is just slow.{self.log_tail()}")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                os.killpg(proc.pid, signal.SIGKILL)  # its children, in case the leader went first
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- HTTP -------------------------------------------------------------------------------------------------
    def post(self, path: str, payload: dict | None = None, timeout_s: float | None = None) -> Any:
        """POST and return the JSON body (or text); raise RolloutEngineError on a connection loss or HTTP error."""
        import requests

        try:
            r = requests.post(f"{self.url}{path}", json=payload or {}, timeout=(_CONNECT_TIMEOUT_S, timeout_s))
        except requests.RequestException as e:
            if self._proc is not None:  # a dropped connection usually means the process is exiting: say so
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=2.0)
            self.dead_reason()
            raise RolloutEngineError(f"lost the SGLang server at {self.url} during POST {path}: "
                                     f"{type(e).__name__}: {e}{self._death_note()}") from e
        if r.status_code == 404:
            raise RolloutEngineError(f"SGLang server at {self.url} has no endpoint {path} (HTTP 404): is it a "
                                     "different SGLang version than this client supports (0.5.17 .. 0.5.23)?")
        try:
            body = r.json()
        except ValueError:
            body = {"success": r.ok, "message": r.text}
        if not r.ok and not (isinstance(body, dict) and "success" in body):
            raise RolloutEngineError(f"SGLang server at {self.url}: POST {path} answered HTTP {r.status_code}: "
                                     f"{str(body)[:2000]}")
        return body

    def _death_note(self) -> str:
        return f" ({self._broken}){self.log_tail()}" if self._broken else ""

    def generate(self, requests: list[dict] | RequestFeed, timeout_s: float, max_concurrent: int,
                 on_done: Callable[[int, list[dict]], None]) -> None:
        self.check_alive("generate")
        feed = RequestFeed.of(requests)
        started: dict[int, float] = {}
        sent: dict[int, dict] = {}
        slots = threading.Semaphore(max_concurrent)

        def one(i: int) -> tuple[int, list[dict] | None]:
            with slots:
                if feed.aborted:  # never sent
                    return i, None
                started[i] = time.monotonic()
                out = self.post("/generate", sent[i], timeout_s=timeout_s + 5 * POLL_S)
            if isinstance(out, dict) and "error" in out:
                raise RolloutEngineError(f"SGLang server rejected a generate request: {out['error']}")
            return i, out if isinstance(out, list) else [out]

        wake = [cf.Future()]  # resolved by put() / close(); replaced once it has fired

        def waker() -> None:
            with contextlib.suppress(cf.InvalidStateError):
                wake[0].set_result(None)

        feed.set_waker(waker)
        futures: dict[cf.Future, int] = {}
        pending: set[cf.Future] = set()
        aborted: set[int] = set()
        try:
            while True:
                if wake[0].done():
                    wake[0] = cf.Future()  # before take(): a put() after it resolves the new one
                new, closed = feed.take()
                if feed.aborted:  # SGLang answers an aborted request with what it has generated so far
                    for i in [i for i in started if i not in aborted]:
                        aborted.add(i)
                        for rid in sent[i]["rid"]:
                            self.post("/abort_request", {"rid": rid}, timeout_s=_CONNECT_TIMEOUT_S)
                for i, r in new:
                    sent[i] = r
                    f = run_in_thread(one, i)
                    futures[f] = i
                    pending.add(f)
                if closed and not pending:
                    break
                done, _ = cf.wait(pending | {wake[0]}, timeout=POLL_S, return_when=cf.FIRST_COMPLETED)
                for f in done - {wake[0]}:
                    pending.discard(f)
                    i, outs = f.result()
                    if outs is not None:
                        on_done(i, outs)
                if self.dead_reason() is not None:
                    raise RolloutEngineError(f"SGLang server died during generate: {self._broken}{self.log_tail()}")
                now = time.monotonic()
                if any(futures[f] in started and now - started[futures[f]] > timeout_s for f in pending):
                    raise RolloutEngineError(
                        f"SGLang server: a generate request did not finish within {timeout_s:g} s "
                        "(rollout.request_timeout_s); its requests were aborted. Raise the timeout, lower "
                        "max_new_tokens or rollout.request_batch_size.")
        finally:
            feed.set_waker(None)
            for f in pending:
                f.cancel()
            if pending and self.dead_reason() is None:
                for i in {futures[f] for f in pending}:
                    for rid in sent[i]["rid"]:
                        try:
                            self.post("/abort_request", {"rid": rid}, timeout_s=_CONNECT_TIMEOUT_S)
                        except RolloutEngineError:
                            break

    # -- SGLang operations ------------------------------------------------------------------------------------
    def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session where the server has one (0.5.23; 0.5.17 has none and needs
        none); return whether it did, so that end_weight_update is called exactly when needed."""
        import requests

        if self._begin_end is False:
            return False
        try:
            r = requests.post(f"{self.url}/begin_weight_update", json={"selector": "all"},
                              timeout=(_CONNECT_TIMEOUT_S, None))
        except requests.RequestException as e:
            raise RolloutEngineError(f"lost the SGLang server at {self.url} during /begin_weight_update: "
                                     f"{e}{self._death_note()}") from e
        self._begin_end = r.status_code != 404
        if self._begin_end:
            check_result(r.json() if r.content else None, "begin a weight update")
        return self._begin_end

    def end_weight_update(self):
        return self.post("/end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool, load_format: str | None = None):
        payload = serialize_for_http(named_tensors)  # every TP rank gets the full tensors and takes its shard
        return self.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload] * self.tp_size,
                                                         "flush_cache": flush_cache, "load_format": load_format})

    def init_weights_update_group(self, **kwargs):
        return self.post("/init_weights_update_group", kwargs)

    def update_weights_from_distributed(self, **kwargs):
        return self.post("/update_weights_from_distributed", kwargs)

    def destroy_weights_update_group(self, group_name: str):
        return self.post("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(self, model_path: str):
        return self.post("/update_weights_from_disk", {"model_path": model_path})

    def flush_cache(self):
        return self.post("/flush_cache")

    def release_memory(self, tags: list[str]):
        return self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]):
        return self.post("/resume_memory_occupation", {"tags": tags})

    def shutdown(self) -> None:
        """Kill a launched server (its whole process group); keep its log only if something went wrong."""
        super().shutdown()
        healthy = self._proc is not None and self.dead_reason() is None
        self._kill()
        if healthy and self.log_path is not None:
            with contextlib.suppress(OSError):
                os.remove(self.log_path)
        self._broken = self._broken or "shut down"


def serialize_for_http(named_tensors) -> str:
    """SGLang's serialised form of [(name, tensor), ...] as a string, for POST /update_weights_from_tensor.

    CPU tensors must be shared through named files ("file_system" strategy): with torch's default
    file-descriptor sharing the server dies with an AuthenticationError (it cannot reach our fd server). The
    strategy is switched only around this call."""
    import torch.multiprocessing as tmp

    sgl_kernel_stand_in.install()
    from sglang.srt.utils import MultiprocessingSerializer

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        return MultiprocessingSerializer.serialize(list(named_tensors), output_str=True)
    finally:
        tmp.set_sharing_strategy(previous)
