"""The engine's side of every weight sync: the session state machine (begin, buckets, end or abort), the weight
version count, and each path's engine calls (tensor buckets in the HF or the engine layout, shared parameters,
broadcast, disk). A RolloutEngine owns one, as `engine.weights`; the trainer-side senders in this package drive it.

    with engine.weights.weight_update():         # colocated: one sync = many buckets, one flush, version + 1
        for bucket in exporter:                   # list[tuple[str, Tensor]] of full HF-layout tensors
            engine.weights.update_bucket(bucket)  # layout="engine": SGLang's own parameters, copied as they are

If a sync fails part-way the engine holds a mix of two versions: `stale` says why, and the engine refuses to
generate until a complete sync succeeds. Nothing here imports Megatron; SGLang only through the backend.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from mcore_rl.rollout.backend import Backend, check_result, until_accepted
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.weight_sync.plan import EngineFacts, engine_blocker

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, Any]]  # (parameter name, torch.Tensor)


class PendingCall:
    """An engine-side call running in the background (it waits for the trainer side of a collective).
    `wait()` returns SGLang's message, or raises RolloutEngineError on refusal, engine death or timeout."""

    def __init__(self, backend: Backend, future, doing: str, timeout_s: float):
        self._backend, self._future, self.doing, self._timeout_s = backend, future, doing, timeout_s

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> str:
        return check_result(self._backend.wait(self._future, self.doing, self._timeout_s), self.doing)


@dataclass
class _Sync:
    began_session: bool  # SGLang 0.5.23's begin_weight_update was called; end_weight_update must follow
    num_tensors: int = 0
    flushed: bool = False  # the cache was flushed by the last update call itself (update_from_shared)


FLUSH_RETRY_S = 10.0
"""How long a refused cache flush is asked again (WeightReceiver.flush_cache)."""


class WeightReceiver:
    """One engine's weight-receiving state. backend: the engine's SGLang backend; facts: what the engine is
    (plan.EngineFacts); timeout_s: per call. weights_released / requests_may_run: the engine's answers to "is the
    weights' memory released?" and "may SGLang still run requests of a failed generate() call?"."""

    def __init__(self, backend: Backend, facts: EngineFacts, timeout_s: float,
                 weights_released: Callable[[], bool] = lambda: False,
                 requests_may_run: Callable[[], bool] = lambda: False):
        self.backend, self.facts, self.timeout_s = backend, facts, timeout_s
        self._weights_released, self._requests_may_run = weights_released, requests_may_run
        self.version = 0
        """Completed weight syncs since start; every RolloutBatch carries the version that generated it."""
        self.stale: str | None = None
        """Why the engine's weights are a mix of two versions (a sync failed part-way), if they are."""
        self._sync: _Sync | None = None
        self._engine_params: dict[str, tuple[int, ...]] | None = None  # engine_parameters(), once asked
        self._shared_token: str | None = None  # share_parameters()' token, once called

    @property
    def sync_open(self) -> bool:
        """True between begin_update() and end_update()/abort_update()."""
        return self._sync is not None

    @property
    def alive(self) -> bool:
        return self.backend.dead_reason() is None

    def _call(self, doing: str, fn, *args, timeout_s: float | None = None, **kwargs):
        return self.backend.call(doing, timeout_s or self.timeout_s, fn, *args, **kwargs)

    # -- the session ------------------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Open a weight sync. Buckets follow (update_bucket, or DistributedWeightSender.send_bucket), then
        end_update() flushes the cache once and bumps the version. Prefer `with weights.weight_update():`."""
        if self._sync is not None:
            raise RuntimeError("begin_update() called while a weight sync is already open")
        if self._weights_released():
            raise RuntimeError("begin_update() called while the weights' memory is released: "
                               "resume_memory(['weights']) first")
        began = self._call("begin a weight update", self.backend.begin_weight_update)
        self._sync = _Sync(began_session=bool(began))

    def end_update(self, flush_cache: bool = True) -> int:
        """Close the sync: SGLang's end_weight_update (0.5.23), one cache flush, version + 1; return it."""
        sync = self._require_sync("end_update")
        with self._failing_sync():
            if sync.began_session:
                check_result(self._call("end a weight update", self.backend.end_weight_update), "end a weight update")
                sync.began_session = False
            if flush_cache and not sync.flushed:  # a failed flush would leave KV entries of the old weights
                self.flush_cache()
        self._sync = None
        self.stale = None
        self.version += 1
        return self.version

    def abort_update(self, reason: str = "aborted by the caller") -> None:
        """Abandon the open sync (e.g. the trainer failed while exporting buckets): no version bump, and
        generate() refuses until a complete sync succeeds. No-op when no sync is open."""
        if self._sync is not None:
            self._abandon_sync(reason)

    @contextlib.contextmanager
    def weight_update(self, flush_cache: bool = True):
        """`with weights.weight_update(): ...update_bucket(b)...`: begin, buckets, end; on an exception the sync
        is abandoned (no version bump) and generation refuses until a complete sync succeeds."""
        self.begin_update()
        try:
            yield self
        except BaseException as e:
            if self._sync is not None:
                self._abandon_sync(f"{type(e).__name__}: {e}")
            raise
        self.end_update(flush_cache)

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache, whose KV entries were computed with older weights.

        SGLang refuses while its scheduler holds a request, and the requests of a generate() call that has just
        returned are retired by the scheduler's next loop: on a loaded machine a flush right after generation
        was refused (tests/weight_sync/test_sync_layout.py, once in a CI run). A refusal is asked again every
        50 ms for up to FLUSH_RETRY_S (or timeout_s if shorter); what still refuses then is an error."""
        result = until_accepted(lambda: self._call("flush the cache", self.backend.flush_cache),
                                min(FLUSH_RETRY_S, self.timeout_s))
        check_result(result, "flush the cache (it refuses while requests are running)")

    # -- colocated tensors ------------------------------------------------------------------------------------
    def update_bucket(self, named_tensors: NamedTensors, layout: str = "hf") -> None:
        """Load one bucket of full tensors into the engine (colocated: the tensors are shared, not copied through a
        socket). The caller may free the bucket after this returns.

        layout "hf": HF names and shapes, mapped by SGLang's model.load_weights. "engine": the engine's own
        parameter names and shapes (bridge.engine_layout), copied as they are: views of a bucket's flat buffers go
        as one buffer per dtype (loaders.load_flat), other tensors one by one (load_format="direct", or load_flat
        per tensor when a name is a slice `{name}[i]` of a stacked MoE expert parameter). Every name
        and shape is checked against engine_parameters() first, since SGLang's scheduler dies on an unknown one."""
        sync = self._require_sync("update_bucket")
        named_tensors = list(named_tensors)
        if not named_tensors:
            return
        count = len(named_tensors)
        if layout == "engine":
            from mcore_rl.weight_sync.loaders import FLAT, check_names, pack_each, pack_flat, split_slice

            check_names({n: tuple(t.shape) for n, t in named_tensors}, self.engine_parameters(), "a weight bucket",
                        complete=False)
            packed = pack_flat(named_tensors)  # a bridge bucket: one shared buffer per dtype instead of per tensor
            if packed is None and any(split_slice(n)[1] is not None for n, _ in named_tensors):
                packed = pack_each(named_tensors)  # MoE expert slices: SGLang's "direct" knows no such names
            named_tensors, load_format = (named_tensors, "direct") if packed is None else (packed, FLAT)
        elif layout == "hf":
            load_format = None
        else:
            raise ValueError(f"layout must be hf or engine, got {layout!r}")
        with self._failing_sync():
            check_result(self._call("update weights from tensors", self.backend.update_weights_from_tensor,
                                    named_tensors, flush_cache=False, load_format=load_format),
                         "update weights from tensors")
        sync.num_tensors += count
        sync.flushed = False  # an earlier call's flush does not cover these weights

    def update_weights_from_tensors(self, named_tensors: NamedTensors, flush_cache: bool = True) -> int:
        """A complete sync from one bucket: begin_update, update_bucket, end_update. Returns the version."""
        with self.weight_update(flush_cache):
            self.update_bucket(named_tensors)
        return self.version

    # -- shared parameters ------------------------------------------------------------------------------------
    def share_parameters(self, params: Sequence, ops: list) -> None:
        """Hand the engine handles to the trainer's own parameters (CUDA IPC, or shared memory on CPU: the storages
        move into shared memory, in place), with the ops of bridge.engine_layout.shared_plan; update_from_shared()
        then copies from them. Nothing is copied here. The parameters must stay where they are (in-place updates
        only); share again after one is reallocated. Names and shapes are checked against engine_parameters()."""
        from mcore_rl.weight_sync.loaders import SHARE, check_names

        check_names({name: tuple(shape) for name, shape, _, _ in ops}, self.engine_parameters(),
                    "the shared parameters")
        token = uuid.uuid4().hex
        named = [(json.dumps({"token": token, "ops": ops}), params[0].detach())]
        named += [("", p.detach()) for p in params[1:]]
        with self._session_outside_sync():
            check_result(self._call("share the trainer's parameters", self.backend.update_weights_from_tensor, named,
                                    flush_cache=False, load_format=SHARE), "share the trainer's parameters")
        self._shared_token = token

    @property
    def shared_token(self) -> str | None:
        """share_parameters()' latest token (None before the first): it changes whenever they are handed over."""
        return self._shared_token

    def unshare_parameters(self, timeout_s: float = 60.0) -> None:
        """Have the engine drop the handles share_parameters() gave it (no-op before the first share). Call it
        before the engine shuts down: the engine's processes are killed, and a CUDA IPC handle they still hold is
        never counted as released in the trainer's process (torch keeps such memory until the process exits)."""
        import torch

        from mcore_rl.weight_sync.loaders import UNSHARE

        if self._shared_token is None:
            return
        if self._sync is not None:
            raise RuntimeError("unshare_parameters() called inside an open weight sync")
        doing, named = "drop the shared parameters", [(self._shared_token, torch.empty(0))]
        with self._session_outside_sync(timeout_s):
            check_result(self._call(doing, self.backend.update_weights_from_tensor, named, flush_cache=False,
                                    load_format=UNSHARE, timeout_s=timeout_s), doing)
        self._shared_token = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # the handles the engine released are freed on this side now, not at exit

    def update_from_shared(self) -> None:
        """Inside an open sync: the engine copies the shared parameters (share_parameters) into its own. The
        caller must have finished writing them (on GPUs: synchronized its stream).

        The cache flush rides on the same call (end_update then skips its own), saving a round trip to the
        scheduler, unless a generate() call failed: SGLang then may still run requests, and a flush that fails
        inside a weight update is an assertion that kills its scheduler, where end_update's own flush is an
        error we report."""
        import torch

        from mcore_rl.weight_sync.loaders import APPLY_SHARED

        sync = self._require_sync("update_from_shared")
        if self._shared_token is None:
            raise RuntimeError("update_from_shared() before share_parameters()")
        flush = not self._requests_may_run()
        with self._failing_sync():
            # an empty tensor pickles without a shared-memory segment: the call carries only the token
            check_result(self._call("update weights from the shared parameters",
                                    self.backend.update_weights_from_tensor, [(self._shared_token, torch.empty(0))],
                                    flush_cache=flush, load_format=APPLY_SHARED),
                         "update weights from the shared parameters")
        sync.num_tensors += 1
        sync.flushed = flush

    # -- the engine's own parameters --------------------------------------------------------------------------
    def layout_blocker(self) -> str | None:
        """Why this engine cannot take weights in its own layout (None: it can)."""
        return engine_blocker(self.facts)

    def engine_parameters(self) -> dict[str, tuple[int, ...]]:
        """The engine's own parameters, name -> shape (asked once, then cached): what a sync in the engine layout
        must send. Needs an engine we launched with our weight loaders."""
        if self._engine_params is None:
            from mcore_rl.weight_sync.loaders import DESCRIBE

            table = self._ask_engine(DESCRIBE, "list the engine's parameters", _read_json)
            self._engine_params = {name: tuple(shape) for name, (shape, _) in table.items()}
        return self._engine_params

    def save_parameters(self) -> dict[str, Any]:
        """A CPU copy of every engine parameter, name -> tensor (reads the engine's weights back; for tests)."""
        import torch

        from mcore_rl.weight_sync.loaders import SAVE

        return self._ask_engine(SAVE, "save the engine's parameters", lambda path: torch.load(path))

    def _ask_engine(self, loader: str, doing: str, read):
        """Run one of our loaders in the engine's scheduler; it writes to a file of this host that we read back.
        Inside an open sync, or in an SGLang update session of its own (no flush, no version bump)."""
        import shutil
        import tempfile

        import torch

        reason = self.layout_blocker()
        if reason is not None:
            raise ValueError(f"cannot {doing}: {reason}")
        folder = tempfile.mkdtemp(prefix="mcore_rl_engine_")
        path = os.path.join(folder, "out")
        try:
            with self._session_outside_sync():
                check_result(self._call(doing, self.backend.update_weights_from_tensor, [(path, torch.zeros(1))],
                                        flush_cache=False, load_format=loader), doing)
            if not os.path.isfile(path):
                raise RolloutEngineError(f"SGLang accepted the call to {doing} but wrote no {path}: is the engine on "
                                         "another host?")
            return read(path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def _session_outside_sync(self, timeout_s: float | None = None):
        """An SGLang weight-update session of its own (no flush, no version bump) around a loader call made outside
        an open sync; inside one, the sync's session serves. timeout_s: per call (default: the receiver's)."""
        own_session = self._sync is None and self._call("begin a weight update", self.backend.begin_weight_update,
                                                          timeout_s=timeout_s)
        try:
            yield
        finally:
            if own_session:
                check_result(self._call("end a weight update", self.backend.end_weight_update, timeout_s=timeout_s),
                             "end a weight update")

    # -- broadcast (engine side; DistributedWeightSender drives both sides) ------------------------------------
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> PendingCall:
        """Start the engine's ranks joining a process group with the trainer. Returns at once; the trainer rank
        must create its side (rank 0) and then call .wait()."""
        kwargs = dict(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                      world_size=world_size, group_name=group_name, backend=backend)
        return self._pending("join the weight-update group", self.backend.init_weights_update_group, **kwargs)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool = False) -> PendingCall:
        """Start the engine receiving these tensors by broadcast from group rank 0, inside an open sync.
        Returns at once; the trainer broadcasts each tensor in order, then calls .wait()."""
        self._require_sync("update_weights_from_distributed")
        kwargs = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache)
        return self._pending("receive weights by broadcast", self.backend.update_weights_from_distributed, **kwargs)

    def destroy_weights_update_group(self, group_name: str) -> None:
        check_result(self._call("destroy the weight-update group", self.backend.destroy_weights_update_group,
                                group_name), "destroy the weight-update group")

    def _pending(self, doing: str, fn, **kwargs) -> PendingCall:
        self.backend.check_alive(doing)
        return PendingCall(self.backend, self.backend.submit(fn, **kwargs), doing, self.timeout_s)

    # -- disk -------------------------------------------------------------------------------------------------
    def update_weights_from_disk(self, hf_dir: str | os.PathLike) -> int:
        """Reload weights from an HF checkpoint folder the engine can read (a complete sync). Returns the
        version. On failure SGLang keeps the previous weights."""
        if self._sync is not None:
            raise RuntimeError("update_weights_from_disk() called while a weight sync is open")
        hf_dir = os.fspath(hf_dir)
        check_result(self._call("update weights from disk", self.backend.update_weights_from_disk, hf_dir),
                     f"load weights from {hf_dir}")
        self.flush_cache()
        self.stale = None
        self.version += 1
        return self.version

    # -- internals --------------------------------------------------------------------------------------------
    def _require_sync(self, what: str) -> _Sync:
        if self._sync is None:
            raise RuntimeError(f"{what}() needs an open weight sync: use `with engine.weights.weight_update():` "
                               "(or begin_update() / end_update())")
        return self._sync

    @contextlib.contextmanager
    def _failing_sync(self):
        try:
            yield
        except BaseException as e:
            if self._sync is not None:
                self._abandon_sync(f"{type(e).__name__}: {e}")
            raise

    def _abandon_sync(self, reason: str) -> None:
        sync, self._sync = self._sync, None
        self.stale = reason
        if sync is not None and sync.began_session and self.alive:
            try:  # leave SGLang's update session so the engine accepts the next sync
                self._call("end a weight update", self.backend.end_weight_update)
            except Exception as e:  # the original error matters more
                logger.warning("closing SGLang's weight-update session after a failed sync: %s", e)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)
