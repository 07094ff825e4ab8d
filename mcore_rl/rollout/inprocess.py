"""SGLang inside this process (`sglang.Engine`): the tokenizer manager runs here, the scheduler and detokenizer
in child processes SGLang spawns. Used colocated, where weights arrive as tensors from the same process.

Three things differ from calling sglang.Engine directly, all to turn failures into RolloutEngineError:
- SGLang's SIGQUIT handling (a failing child signals the parent, whose handler kills the whole process tree,
  the trainer included) is replaced by a handler that only records the failure;
- a child that dies or a deadline that passes ends a wait within POLL_S (backend.Backend.wait);
- shutdown kills only this engine's children (sglang.Engine.shutdown kills every child of the process) and
  closes the zmq contexts SGLang created (pyzmq would otherwise close them at garbage collection with infinite
  linger, which blocks forever once a peer process is gone).
Create it from the main thread (signal handlers can only be installed there), inside `if __name__ ==
"__main__":` of the entry script (SGLang spawns children, which re-import the main module).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import threading
import time
from typing import Any, Callable

from mcore_rl.rollout import sgl_kernel_stand_in
from mcore_rl.rollout.backend import POLL_S, Backend, RequestFeed, check_result
from mcore_rl.rollout.errors import RolloutEngineError

logger = logging.getLogger(__name__)

_SIGQUIT_SEEN = threading.Event()
_TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""Signals the trainer may take as stop requests (trainer.stop_signals), and Ctrl-C (SIGINT, to the whole process
group from a terminal or torchrun), which the trainer turns into an orderly shutdown of the engine: SGLang's
processes ignore them (without this, each prints a KeyboardInterrupt traceback and dies under the trainer)."""


def _on_sigquit(signum=None, frame=None) -> None:
    """SIGQUIT from an SGLang child means it failed; remember it, keep this process alive."""
    _SIGQUIT_SEEN.set()


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _zmq_contexts() -> list:
    import gc

    import zmq

    # type(), not isinstance(): isinstance reads __class__ through weakref proxies, which raises ReferenceError for
    # a proxy whose object is gone (torch.compile leaves such proxies among the tracked objects).
    return [o for o in gc.get_objects() if issubclass(type(o), zmq.Context)]


def _close_zmq_contexts(contexts) -> None:
    """Close SGLang's zmq contexts with linger 0. Left to the garbage collector, pyzmq closes them with infinite
    linger, and that blocks forever (at whatever allocation triggers the collection) if a socket still holds a
    message for a process that is gone."""
    for ctx in contexts:
        if not ctx.closed:
            ctx.destroy(linger=0)


def _restore_signals(handlers: dict) -> None:
    """The trainer's handlers back (SGLang's event loop takes SIGTERM), and its signals unblocked: one that arrived
    during the engine's start-up is handled now."""
    for s, handler in handlers.items():
        signal.signal(s, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _TRAINER_SIGNALS)


def kill_pids(pids) -> None:
    """SIGKILL these processes and their descendants, and reap them."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class InProcessBackend(Backend):
    name = "engine"

    def __init__(self, args: dict[str, Any], startup_timeout_s: float):
        super().__init__()
        self._engine = None
        self._child_pids: list[int] = []
        self._zmq_contexts: list = []
        in_main = threading.current_thread() is threading.main_thread()
        if not in_main:
            logger.warning("RolloutEngine(mode=engine) created outside the main thread: a failing SGLang child "
                           "process will terminate this process instead of raising RolloutEngineError")
        sgl_kernel_stand_in.install()  # before the first `import sglang`: SGLang reads it at import time
        import sglang

        saved_handlers = {}
        before, started, expired = _children(), threading.Event(), threading.Event()
        if in_main:
            _SIGQUIT_SEEN.clear()
            args = {**args, "custom_sigquit_handler": _on_sigquit}
            # SGLang's processes start with these blocked (the mask is kept across exec): a SIGTERM to the worker's
            # whole process group (torchrun) stops the trainer at its next safe point (trainer.stop_signals), not
            # the engine in the middle of the step the trainer is about to save. The engine's shutdown uses SIGKILL.
            # Blocked in this thread only, not ignored: the trainer's handler still gets a signal that arrives
            # during the start-up (through another thread, or when unblocked), and may end the start-up.
            saved_handlers = {s: signal.getsignal(s) for s in _TRAINER_SIGNALS}
            # multiprocessing's resource tracker, started on first use, unblocks SIGINT and SIGTERM in the thread that
            # starts it (after starting it with them blocked): start it now, so SGLang's start-up does not (it is
            # one of the processes a failed start-up kills, as before).
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, _TRAINER_SIGNALS)
        contexts_before = {id(c) for c in _zmq_contexts()}

        def expire():  # kill what the launch has spawned, so SGLang's wait for its scheduler returns
            if not started.wait(startup_timeout_s):
                expired.set()
                kill_pids(_children() - before)

        threading.Thread(target=expire, daemon=True, name="sglang-startup-timeout").start()
        t0 = time.monotonic()
        try:
            self._engine = sglang.Engine(**args)
        except BaseException as e:
            kill_pids(_children() - before)
            _close_zmq_contexts([c for c in _zmq_contexts() if id(c) not in contexts_before])
            if not isinstance(e, Exception):  # a stop signal (procs.StopRequested), Ctrl-C: not an engine failure
                raise
            if expired.is_set():
                raise RolloutEngineError(
                    f"SGLang engine did not start within {startup_timeout_s:g} s (rollout.startup_timeout_s) "
                    f"for model_path={args['model_path']!r}; its child processes were killed. Raise the "
                    "timeout if loading is just slow, else run with rollout.log_level=info to see where it stops."
                ) from e
            raise RolloutEngineError(
                f"SGLang engine failed to start for model_path={args['model_path']!r} after "
                f"{time.monotonic() - t0:.0f} s: {type(e).__name__}: {e}. Check that rollout.model_path (or "
                "model.path) is an HF checkpoint folder with config.json and safetensors, and the rollout.* "
                "engine settings.") from e
        finally:
            started.set()
            if in_main and self._engine is None:
                _restore_signals(saved_handlers)
        self._child_pids = list(self._engine.get_all_child_pids())
        self._zmq_contexts = [c for c in _zmq_contexts() if id(c) not in contexts_before]
        if in_main:  # the tokenizer manager registers SGLang's kill-everything SIGQUIT handler on its loop, and a
            # SIGTERM handler that drains and shuts the engine down: ours (or the default) stay in charge. It does so
            # when it first uses the loop (the first generate), so make it do that now; and uvloop removes a handler
            # only while its loop runs (outside, remove_signal_handler does nothing and says False).
            loop, tokenizer_manager = self._engine.loop, self._engine.tokenizer_manager

            async def take_signals_back():
                if hasattr(tokenizer_manager, "auto_create_handle_loop"):
                    tokenizer_manager.auto_create_handle_loop()
                for s in (signal.SIGQUIT, signal.SIGTERM):
                    loop.remove_signal_handler(s)

            loop.run_until_complete(take_signals_back())
            signal.signal(signal.SIGQUIT, _on_sigquit)
            _restore_signals(saved_handlers)
        atexit.unregister(self._engine.shutdown)
        atexit.register(self.shutdown)

    # -- liveness ---------------------------------------------------------------------------------------------
    def dead_reason(self) -> str | None:
        if self._broken is not None:
            return self._broken
        if self._engine is None:
            return "shut down"
        import psutil

        for pid in self._child_pids:
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                status = psutil.STATUS_DEAD
            if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                self._broken = f"its child process {pid} (scheduler or detokenizer) exited"
                return self._broken
        if _SIGQUIT_SEEN.is_set():
            self._broken = "a child process reported a failure (SIGQUIT); see the log above"
            return self._broken
        return None

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, requests: list[dict] | RequestFeed, timeout_s: float, max_concurrent: int,
                 on_done: Callable[[int, list[dict]], None]) -> None:
        self.check_alive("generate")
        engine = self._engine
        feed = RequestFeed.of(requests)

        async def one(i: int, req: dict, sem: asyncio.Semaphore, started: dict[int, float]):
            async with sem:
                if feed.aborted:  # never sent
                    return
                started[i] = time.monotonic()
                out = await engine.async_generate(**req)
                on_done(i, out if isinstance(out, list) else [out])

        async def run_all():
            sem, started = asyncio.Semaphore(max_concurrent), {}
            loop = asyncio.get_running_loop()
            woken = asyncio.Event()
            feed.set_waker(lambda: loop.call_soon_threadsafe(woken.set))
            tasks: dict[asyncio.Future, int] = {}
            sent: dict[int, dict] = {}
            pending: set[asyncio.Future] = set()
            aborted: set[int] = set()
            try:
                while True:
                    woken.clear()  # before take(): a put() after it wakes the wait below
                    new, closed = feed.take()
                    if feed.aborted:  # SGLang answers an aborted request with what it has generated so far
                        for i in [i for i in started if i not in aborted]:
                            aborted.add(i)
                            for rid in sent[i]["rid"]:
                                engine.tokenizer_manager.abort_request(rid=rid)
                    for i, r in new:
                        sent[i] = r
                        task = asyncio.ensure_future(one(i, r, sem, started))
                        tasks[task] = i
                        pending.add(task)
                    if closed and not pending:
                        break
                    waiter = asyncio.ensure_future(woken.wait())
                    done, _ = await asyncio.wait(pending | {waiter}, timeout=POLL_S,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    for t in done - {waiter}:
                        pending.discard(t)
                        t.result()  # re-raise SGLang's error (e.g. a prompt longer than the context)
                    reason = self.dead_reason()
                    if reason is not None:
                        raise RolloutEngineError(f"SGLang engine died during generate: {reason}")
                    now = time.monotonic()
                    late = [tasks[t] for t in pending if tasks[t] in started and now - started[tasks[t]] > timeout_s]
                    if late:
                        raise RolloutEngineError(
                            f"SGLang engine: a generate request of {len(sent[late[0]]['input_ids'])} samples "
                            f"did not finish within {timeout_s:g} s (rollout.request_timeout_s); its requests were "
                            "aborted. Raise the timeout, lower max_new_tokens or rollout.request_batch_size.")
            finally:
                feed.set_waker(None)
                if pending:
                    for t in pending:
                        t.cancel()
                    if self.dead_reason() is None:
                        for i in {tasks[t] for t in pending}:
                            for rid in sent[i]["rid"]:
                                engine.tokenizer_manager.abort_request(rid=rid)
                    await asyncio.gather(*pending, return_exceptions=True)

        engine.loop.run_until_complete(run_all())

    # -- SGLang operations (run on the executor thread by RolloutEngine) ------------------------------------------
    def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session where it has one (0.5.23; 0.5.17 has none and needs none)."""
        if not hasattr(self._engine, "begin_weight_update"):
            return False
        check_result(self._engine.begin_weight_update(), "begin a weight update")
        return True

    def end_weight_update(self):
        return self._engine.end_weight_update()

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool, load_format: str | None = None):
        return self._engine.update_weights_from_tensor(named_tensors=named_tensors, flush_cache=flush_cache,
                                                       load_format=load_format)

    def init_weights_update_group(self, **kwargs):
        return self._engine.init_weights_update_group(**kwargs)

    def update_weights_from_distributed(self, **kwargs):
        return self._engine.update_weights_from_distributed(**kwargs)

    def destroy_weights_update_group(self, group_name: str):
        return self._engine.destroy_weights_update_group(group_name=group_name)

    def update_weights_from_disk(self, model_path: str):
        return self._engine.update_weights_from_disk(model_path=model_path)

    def flush_cache(self):
        return self._engine.flush_cache()

    def release_memory(self, tags: list[str]):
        return self._engine.release_memory_occupation(tags=tags)

    def resume_memory(self, tags: list[str]):
        return self._engine.resume_memory_occupation(tags=tags)

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        super().shutdown()
        if engine is None:
            return
        watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        kill_pids(self._child_pids)
        _close_zmq_contexts(self._zmq_contexts)
        self._zmq_contexts = []
        atexit.unregister(self.shutdown)
