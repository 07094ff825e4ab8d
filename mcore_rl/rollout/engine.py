"""RolloutEngine: one SGLang engine (in-process or HTTP server), generation from token ids into `Sample`s, and
receiving HF-named weights from the trainer.

    engine = RolloutEngine(cfg.rollout, model_path=cfg.model.path)
    batch = engine.generate(prompt_ids, n=cfg.algorithm.n_samples_per_prompt)   # RolloutBatch of Samples
    with engine.weight_update():                 # colocated: one sync = many buckets, one flush, version + 1
        for bucket in bridge.hf_buckets():       # list[tuple[str, Tensor]] of full HF-layout tensors
            engine.update_bucket(bucket)         # layout="engine": SGLang's own parameters, copied as they are
    engine.shutdown()

Disaggregated syncs go through `DistributedWeightSender` (weight_sync.py); a checkpoint folder through
`update_weights_from_disk`. Nothing here imports Megatron. Failures raise RolloutEngineError (see docs/rollout.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.rollout.backend import Backend, check_result
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.types import RolloutBatch, Sample

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, Any]]  # (HF parameter name, torch.Tensor)
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; defaults come from RolloutConfig (`from_config`).

    Log-probs returned with samples are of the temperature-scaled distribution before top-p/top-k truncation
    (SGLang's convention); with temperature 0 (greedy) they are plain log-softmax of the logits."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_config(cls, cfg: RolloutConfig, **overrides) -> SamplingParams:
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
        fields.update(overrides)
        fields["stop_token_ids"], fields["stop"] = tuple(fields["stop_token_ids"]), tuple(fields["stop"])
        return cls(**fields)

    def to_sglang(self) -> dict[str, Any]:
        params = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "max_new_tokens": self.max_new_tokens, "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        return params


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


class RolloutEngine:
    """Owns one SGLang engine: starts it (or attaches to a server), generates, receives weights, shuts down."""

    def __init__(self, cfg: RolloutConfig, model_path: str | None = None):
        from mcore_rl.rollout.settings import server_args

        self.cfg = cfg
        self.weight_version = 0
        """Completed weight syncs since start; every RolloutBatch carries the version that generated it."""
        self._sync: _Sync | None = None
        self._stale: str | None = None  # why the weights are a mix of two versions, if they are
        self._released: set[str] = set()
        self._engine_params: dict[str, tuple[int, ...]] | None = None  # engine_parameters(), once asked
        self._shared_token: str | None = None  # share_parameters()' token, once called
        self._requests_may_run = False  # a generate() call failed: SGLang may still run its requests
        self.backend: Backend
        if cfg.mode == "server" and cfg.server_url:
            from mcore_rl.rollout.server import ServerBackend

            self.backend = ServerBackend(None, cfg.host, None, cfg.startup_timeout_s, url=cfg.server_url,
                                         tp_size=cfg.tp_size)
            return
        path = model_path or cfg.model_path
        _check_model_path(path)
        args = server_args(cfg, path)
        from mcore_rl.rollout.launch_env import without_torchrun_env

        with without_torchrun_env():  # the engine's processes must not join the trainer's torchrun world
            if cfg.mode == "engine":
                from mcore_rl.rollout.inprocess import InProcessBackend

                self.backend = InProcessBackend(args, cfg.startup_timeout_s)
            else:
                from mcore_rl.rollout.server import ServerBackend

                self.backend = ServerBackend(args, cfg.host, cfg.port, cfg.startup_timeout_s, tp_size=cfg.tp_size)

    # -- facts ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.backend.dead_reason() is None

    @property
    def url(self) -> str | None:
        """Base URL of the HTTP server (server mode), else None."""
        return getattr(self.backend, "url", None)

    @property
    def num_ranks(self) -> int:
        """Engine processes that join a distributed weight-update group (its tensor-parallel size)."""
        return self.cfg.tp_size

    def default_sampling(self, **overrides) -> SamplingParams:
        return SamplingParams.from_config(self.cfg, **overrides)

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, sampling: SamplingParams | None = None, *,
                 first_group_id: int = 0, metas: Sequence[dict] | None = None,
                 prompt_texts: Sequence[str] | None = None, timeout_s: float | None = None,
                 show_progress: bool | None = None) -> RolloutBatch:
        """`n` samples of each prompt (token ids), in prompt order; samples of prompt i get group_id
        first_group_id + i, meta = a copy of metas[i], prompt_text = prompt_texts[i]. Sent in requests of
        rollout.request_batch_size samples; each request must finish within timeout_s (default
        rollout.request_timeout_s)."""
        from tqdm.auto import tqdm

        sampling = sampling or self.default_sampling()
        _check_generate_args(prompts, n, sampling, metas, prompt_texts, self.cfg.skip_tokenizer_init)
        self._check_can_generate()
        owners = [i for i in range(len(prompts)) for _ in range(n)]
        size = self.cfg.request_batch_size
        chunks = [owners[s:s + size] for s in range(0, len(owners), size)]
        params = sampling.to_sglang()
        requests = [{"input_ids": [[int(t) for t in prompts[i]] for i in chunk], "sampling_params": params,
                     "return_logprob": True, "rid": [uuid.uuid4().hex for _ in chunk]} for chunk in chunks]
        outputs: list[list[dict] | None] = [None] * len(requests)
        show = self.cfg.show_progress if show_progress is None else show_progress
        with tqdm(total=len(owners), desc="rollout", unit="sample", leave=False,
                  disable=not show or len(requests) < 2) as bar:
            def on_done(i: int, outs: list[dict]) -> None:
                outputs[i] = outs
                bar.update(len(outs))

            self._requests_may_run = True  # until this call returns normally
            self.backend.generate(requests, timeout_s or self.cfg.request_timeout_s,
                                  self.cfg.max_concurrent_requests, on_done)
            self._requests_may_run = False
        samples = []
        for chunk, outs in zip(chunks, outputs):
            if outs is None or len(outs) != len(chunk):
                raise RolloutEngineError(f"SGLang returned {0 if outs is None else len(outs)} outputs for a request "
                                         f"of {len(chunk)} samples")
            for i, out in zip(chunk, outs):
                samples.append(_to_sample(out, [int(t) for t in prompts[i]], first_group_id + i,
                                          metas[i] if metas else None, prompt_texts[i] if prompt_texts else ""))
        return RolloutBatch(samples=samples, weight_version=self.weight_version)

    def _check_can_generate(self) -> None:
        if self._sync is not None:
            raise RuntimeError("generate() called while a weight sync is open: call end_update() first")
        if self._stale is not None:
            raise RolloutEngineError(
                f"the last weight sync failed part-way ({self._stale}), so the engine holds a mix of old and new "
                "weights. Run a complete sync (weight_update(), update_weights_from_tensors, "
                "DistributedWeightSender.sync or update_weights_from_disk) before generating.")
        if self._released:
            raise RuntimeError(f"generate() called while memory is released ({sorted(self._released)}): call "
                               "resume_memory() first (and sync weights if 'weights' was released)")

    # -- colocated weight sync --------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """Open a weight sync. Buckets follow (update_bucket, or DistributedWeightSender.send_bucket), then
        end_update() flushes the cache once and bumps weight_version. Prefer `with engine.weight_update():`."""
        if self._sync is not None:
            raise RuntimeError("begin_update() called while a weight sync is already open")
        if "weights" in self._released:
            raise RuntimeError("begin_update() called while the weights' memory is released: "
                               "resume_memory(['weights']) first")
        began = self.backend.call("begin a weight update", self.cfg.request_timeout_s, self.backend.begin_weight_update)
        self._sync = _Sync(began_session=bool(began))

    def update_bucket(self, named_tensors: NamedTensors, layout: str = "hf") -> None:
        """Load one bucket of full tensors into the engine (colocated: the tensors are shared, not copied through a
        socket). The caller may free the bucket after this returns.

        layout "hf": HF names and shapes, mapped by SGLang's model.load_weights. "engine": the engine's own
        parameter names and shapes (bridge.engine_layout), copied as they are: views of a bucket's flat buffers go
        as one buffer per dtype (engine_params.load_flat), other tensors one by one (load_format="direct"). Every
        name and shape is checked against engine_parameters() first, since SGLang's scheduler dies on an unknown
        one."""
        sync = self._require_sync("update_bucket")
        named_tensors = list(named_tensors)
        if not named_tensors:
            return
        count = len(named_tensors)
        if layout == "engine":
            from mcore_rl.rollout.engine_params import FLAT, check_names, pack_flat

            check_names({n: tuple(t.shape) for n, t in named_tensors}, self.engine_parameters(), "a weight bucket",
                        complete=False)
            packed = pack_flat(named_tensors)  # a bridge bucket: one shared buffer per dtype instead of per tensor
            named_tensors, load_format = (named_tensors, "direct") if packed is None else (packed, FLAT)
        elif layout == "hf":
            load_format = None
        else:
            raise ValueError(f"layout must be hf or engine, got {layout!r}")
        with self._failing_sync():
            check_result(self.backend.call("update weights from tensors", self.cfg.request_timeout_s,
                                           self.backend.update_weights_from_tensor, named_tensors, flush_cache=False,
                                           load_format=load_format),
                         "update weights from tensors")
        sync.num_tensors += count
        sync.flushed = False  # an earlier call's flush does not cover these weights

    def share_parameters(self, params: Sequence, ops: list) -> None:
        """Hand the engine handles to the trainer's own parameters (CUDA IPC, or shared memory on CPU: the storages
        move into shared memory, in place), with the ops of bridge.engine_layout.shared_plan; update_from_shared()
        then copies from them. Nothing is copied here. The parameters must stay where they are (in-place updates
        only); share again after one is reallocated. Names and shapes are checked against engine_parameters()."""
        from mcore_rl.rollout.engine_params import SHARE, check_names

        check_names({name: tuple(shape) for name, shape, _, _ in ops}, self.engine_parameters(),
                    "the shared parameters")
        token = uuid.uuid4().hex
        named = [(json.dumps({"token": token, "ops": ops}), params[0].detach())]
        named += [("", p.detach()) for p in params[1:]]
        with self._session_outside_sync():
            check_result(self.backend.call("share the trainer's parameters", self.cfg.request_timeout_s,
                                           self.backend.update_weights_from_tensor, named, flush_cache=False,
                                           load_format=SHARE), "share the trainer's parameters")
        self._shared_token = token

    def update_from_shared(self) -> None:
        """Inside an open sync: the engine copies the shared parameters (share_parameters) into its own. The
        caller must have finished writing them (on GPUs: synchronized its stream).

        The cache flush rides on the same call (end_update then skips its own), saving a round trip to the
        scheduler, unless a generate() call failed: SGLang then may still run requests, and a flush that fails
        inside a weight update is an assertion that kills its scheduler, where end_update's own flush is an
        error we report."""
        import torch

        from mcore_rl.rollout.engine_params import APPLY_SHARED

        sync = self._require_sync("update_from_shared")
        if self._shared_token is None:
            raise RuntimeError("update_from_shared() before share_parameters()")
        flush = not self._requests_may_run
        with self._failing_sync():
            # an empty tensor pickles without a shared-memory segment: the call carries only the token
            check_result(self.backend.call("update weights from the shared parameters", self.cfg.request_timeout_s,
                                           self.backend.update_weights_from_tensor,
                                           [(self._shared_token, torch.empty(0))], flush_cache=flush,
                                           load_format=APPLY_SHARED),
                         "update weights from the shared parameters")
        sync.num_tensors += 1
        sync.flushed = flush

    def engine_parameters(self) -> dict[str, tuple[int, ...]]:
        """The engine's own parameters, name -> shape (asked once, then cached): what a sync in the engine layout
        must send. Needs an engine we launched with rollout.weight_sync_layout other than hf."""
        if self._engine_params is None:
            from mcore_rl.rollout.engine_params import DESCRIBE

            table = self._ask_engine(DESCRIBE, "list the engine's parameters", _read_json)
            self._engine_params = {name: tuple(shape) for name, (shape, _) in table.items()}
        return self._engine_params

    def save_parameters(self) -> dict[str, Any]:
        """A CPU copy of every engine parameter, name -> tensor (reads the engine's weights back; for tests)."""
        import torch

        from mcore_rl.rollout.engine_params import SAVE

        return self._ask_engine(SAVE, "save the engine's parameters", lambda path: torch.load(path))

    def engine_layout_blocker(self) -> str | None:
        """Why this engine cannot take weights in its own layout (None: it can)."""
        if self.cfg.weight_sync_layout == "hf":
            return "rollout.weight_sync_layout=hf (the engine was started without the parameter-listing loader)"
        return self.cfg.engine_layout_blocker()

    def _ask_engine(self, loader: str, doing: str, read):
        """Run one of engine_params' loaders in the engine's scheduler; it writes to a file of this host that we
        read back. Inside an open sync, or in an SGLang update session of its own (no flush, no version bump)."""
        import shutil
        import tempfile

        import torch

        reason = self.engine_layout_blocker()
        if reason is not None:
            raise ValueError(f"cannot {doing}: {reason}")
        folder = tempfile.mkdtemp(prefix="mcore_rl_engine_")
        path = os.path.join(folder, "out")
        try:
            with self._session_outside_sync():
                check_result(self.backend.call(doing, self.cfg.request_timeout_s,
                                               self.backend.update_weights_from_tensor, [(path, torch.zeros(1))],
                                               flush_cache=False, load_format=loader), doing)
            if not os.path.isfile(path):
                raise RolloutEngineError(f"SGLang accepted the call to {doing} but wrote no {path}: is the engine on "
                                         "another host?")
            return read(path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def _session_outside_sync(self):
        """An SGLang weight-update session of its own (no flush, no version bump) around a loader call made outside
        an open sync; inside one, the sync's session serves."""
        own_session = self._sync is None and self.backend.call("begin a weight update", self.cfg.request_timeout_s,
                                                                self.backend.begin_weight_update)
        try:
            yield
        finally:
            if own_session:
                check_result(self.backend.call("end a weight update", self.cfg.request_timeout_s,
                                               self.backend.end_weight_update), "end a weight update")

    def end_update(self, flush_cache: bool = True) -> int:
        """Close the sync: SGLang's end_weight_update (0.5.23), one cache flush, weight_version + 1; return it."""
        sync = self._require_sync("end_update")
        with self._failing_sync():
            if sync.began_session:
                check_result(self.backend.call("end a weight update", self.cfg.request_timeout_s,
                                               self.backend.end_weight_update), "end a weight update")
                sync.began_session = False
            if flush_cache and not sync.flushed:  # a failed flush would leave KV entries of the old weights
                self.flush_cache()
        self._sync = None
        self._stale = None
        self.weight_version += 1
        return self.weight_version

    @property
    def sync_open(self) -> bool:
        """True between begin_update() and end_update()/abort_update()."""
        return self._sync is not None

    def abort_update(self, reason: str = "aborted by the caller") -> None:
        """Abandon the open sync (e.g. the trainer failed while exporting buckets): no version bump, and
        generate() refuses until a complete sync succeeds. No-op when no sync is open."""
        if self._sync is not None:
            self._abandon_sync(reason)

    @contextlib.contextmanager
    def weight_update(self, flush_cache: bool = True):
        """`with engine.weight_update(): ...update_bucket(b)...`: begin, buckets, end; on an exception the sync
        is abandoned (no version bump) and generation refuses until a complete sync succeeds."""
        self.begin_update()
        try:
            yield self
        except BaseException as e:
            if self._sync is not None:
                self._abandon_sync(f"{type(e).__name__}: {e}")
            raise
        self.end_update(flush_cache)

    def update_weights_from_tensors(self, named_tensors: NamedTensors, flush_cache: bool = True) -> int:
        """A complete sync from one bucket: begin_update, update_bucket, end_update. Returns weight_version."""
        with self.weight_update(flush_cache):
            self.update_bucket(named_tensors)
        return self.weight_version

    # -- disaggregated weight sync (engine side; DistributedWeightSender drives both sides) -------------------
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
        check_result(self.backend.call("destroy the weight-update group", self.cfg.request_timeout_s,
                                       self.backend.destroy_weights_update_group, group_name),
                     "destroy the weight-update group")

    def _pending(self, doing: str, fn, **kwargs) -> PendingCall:
        self.backend.check_alive(doing)
        return PendingCall(self.backend, self.backend.submit(fn, **kwargs), doing, self.cfg.request_timeout_s)

    # -- other weight paths, cache, memory --------------------------------------------------------------------
    def update_weights_from_disk(self, hf_dir: str | os.PathLike) -> int:
        """Reload weights from an HF checkpoint folder the engine can read (a complete sync). Returns
        weight_version. On failure SGLang keeps the previous weights."""
        if self._sync is not None:
            raise RuntimeError("update_weights_from_disk() called while a weight sync is open")
        hf_dir = os.fspath(hf_dir)
        check_result(self.backend.call("update weights from disk", self.cfg.request_timeout_s,
                                       self.backend.update_weights_from_disk, hf_dir), f"load weights from {hf_dir}")
        self.flush_cache()
        self._stale = None
        self.weight_version += 1
        return self.weight_version

    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache, whose KV entries were computed with older weights."""
        check_result(self.backend.call("flush the cache", self.cfg.request_timeout_s, self.backend.flush_cache),
                     "flush the cache (it refuses while requests are running)")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated: give the engine's GPU memory (weights, KV cache) to training. CPU: accepted, frees nothing."""
        tags = _check_tags(tags)
        check_result(self.backend.call("release memory", self.cfg.request_timeout_s, self.backend.release_memory,
                                       tags), "release memory")
        self._released |= set(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take the memory back before generating. Resumed weights hold no valid values until the next sync."""
        tags = _check_tags(tags)
        check_result(self.backend.call("resume memory", self.cfg.request_timeout_s, self.backend.resume_memory,
                                       tags), "resume memory")
        self._released -= set(tags)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine (or detach from an attached server, leaving it running). Idempotent."""
        self.backend.shutdown()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- internals --------------------------------------------------------------------------------------------
    def _require_sync(self, what: str) -> _Sync:
        if self._sync is None:
            raise RuntimeError(f"{what}() needs an open weight sync: use `with engine.weight_update():` "
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
        self._stale = reason
        if sync is not None and sync.began_session and self.alive:
            try:  # leave SGLang's update session so the engine accepts the next sync
                self.backend.call("end a weight update", self.cfg.request_timeout_s, self.backend.end_weight_update)
            except Exception as e:  # the original error matters more
                logger.warning("closing SGLang's weight-update session after a failed sync: %s", e)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _to_sample(out: dict, prompt: Sequence[int], group_id: int, meta: dict | None, prompt_text: str) -> Sample:
    info = out["meta_info"]
    response = list(out["output_ids"])
    logprobs = [float(lp) for lp, *_ in info["output_token_logprobs"]]
    if len(logprobs) != len(response):
        raise RolloutEngineError(f"SGLang returned {len(logprobs)} log-probs for {len(response)} tokens")
    reason = info.get("finish_reason") or {}
    kind = reason.get("type", "abort") if isinstance(reason, dict) else str(reason)
    return Sample(prompt_ids=list(prompt), response_ids=response, rollout_logprobs=logprobs,
                  finish_reason=kind if kind in ("stop", "length") else "abort", group_id=group_id,
                  prompt_text=prompt_text, response_text=out.get("text") or "", meta=dict(meta or {}))


def _check_generate_args(prompts, n, sampling, metas, prompt_texts, skip_tokenizer_init) -> None:
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    if len(prompts) == 0:
        raise ValueError("generate() got no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0 or isinstance(p, str):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")
    for name, seq in (("metas", metas), ("prompt_texts", prompt_texts)):
        if seq is not None and len(seq) != len(prompts):
            raise ValueError(f"{name} has {len(seq)} entries for {len(prompts)} prompts")
    if sampling.stop and skip_tokenizer_init:
        raise ValueError(f"stop strings {list(sampling.stop)} need SGLang's tokenizer: start the engine with "
                         "rollout.skip_tokenizer_init=false, or use stop_token_ids")


def _check_tags(tags: Sequence[str]) -> list[str]:
    tags = [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"memory tags must be among {MEMORY_TAGS}, got {bad}")
    return tags


def _check_model_path(path: str) -> None:
    if not path:
        raise ValueError("no model to load: set rollout.model_path or pass model_path= (the trainer passes model.path)")
    looks_local = path.startswith(("/", ".", "~")) or os.path.exists(path)
    if looks_local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise RolloutEngineError(f"cannot start SGLang: model_path {path!r} is not an HF checkpoint folder (no "
                                 "config.json there). Set rollout.model_path (or model.path) to a folder with "
                                 "config.json, safetensors and the tokenizer.")
