"""RolloutEngine: one SGLang engine (in-process or HTTP server) and generation from token ids into `Sample`s.

    engine = RolloutEngine(cfg.rollout, model_path=cfg.model.path, weight_loaders=cfg.weight_sync.engine_loaders)
    batch = engine.generate(prompt_ids, n=cfg.algorithm.n_samples_per_prompt)   # RolloutBatch of Samples
    engine.shutdown()

Weights arrive through `engine.weights` (mcore_rl.weight_sync.receiver.WeightReceiver: the sync sessions, the
version count and every path's engine calls), driven by mcore_rl.weight_sync's senders. Nothing here imports
Megatron. Failures raise RolloutEngineError (see docs/rollout.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.rollout.backend import (Backend, Interrupt, RequestFeed, check_result, outcome, run_in_thread,
                                      until_accepted)
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.rollout.seeds import group_seeds
from mcore_rl.types import RolloutBatch, Sample
from mcore_rl.weight_sync.loaders import LOADERS
from mcore_rl.weight_sync.plan import EngineFacts
from mcore_rl.weight_sync.receiver import WeightReceiver

logger = logging.getLogger(__name__)

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


class RolloutEngine:
    """Owns one SGLang engine: starts it (or attaches to a server), generates, shuts down; `weights` receives."""

    def __init__(self, cfg: RolloutConfig, model_path: str | None = None, weight_loaders: bool = True):
        """weight_loaders: start SGLang with our custom weight loaders (mcore_rl.weight_sync.loaders), which the
        engine and shared sync layouts need; weight_sync.layout=hf does without (cfg.weight_sync.engine_loaders)."""
        from mcore_rl.rollout.settings import server_args

        self.cfg = cfg
        self._route_shape = _route_shape(model_path or cfg.model_path) if cfg.return_routed_experts else None
        self._released: set[str] = set()
        self._requests_may_run = False  # a generate() call failed: SGLang may still run its requests
        self.attention_backend: str | None = None
        """The attention backend the engine was started with (None: an attached server's own choice)."""
        self.backend: Backend
        if cfg.mode == "server" and cfg.server_url:
            from mcore_rl.rollout.server import ServerBackend

            self.backend = ServerBackend(None, cfg.host, None, cfg.startup_timeout_s, url=cfg.server_url,
                                         tp_size=cfg.tp_size)
        else:
            path = model_path or cfg.model_path
            _check_model_path(path)
            args = server_args(cfg, path, custom_weight_loaders=LOADERS if weight_loaders else ())
            self.attention_backend = args.get("attention_backend")
            if cfg.return_routed_experts:
                args["enable_return_routed_experts"] = True
            from mcore_rl.rollout.launch_env import without_torchrun_env

            with without_torchrun_env():  # the engine's processes must not join the trainer's torchrun world
                if cfg.mode == "engine":
                    from mcore_rl.rollout.inprocess import InProcessBackend

                    self.backend = InProcessBackend(args, cfg.startup_timeout_s)
                else:
                    from mcore_rl.rollout.server import ServerBackend

                    self.backend = ServerBackend(args, cfg.host, cfg.port, cfg.startup_timeout_s,
                                                 tp_size=cfg.tp_size)
        self.weights = WeightReceiver(self.backend, EngineFacts.from_config(cfg, weight_loaders), cfg.request_timeout_s,
                                      weights_released=lambda: "weights" in self._released,
                                      requests_may_run=lambda: self._requests_may_run)
        """The engine's side of weight syncs: sessions, the version count, each path's calls."""

    # -- facts ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.backend.dead_reason() is None

    @property
    def url(self) -> str | None:
        """Base URL of the HTTP server (server mode), else None."""
        return getattr(self.backend, "url", None)

    policy_version: int = 0
    """Which policy the engine's weights are, as the trainer numbers them (its step after whose update they were
    pushed; 0 = the checkpoint the engine started from). The trainer sets it after each sync; a resumed run's
    first sync sets it to the step it resumed from, so it names the same weights in a resumed and an
    uninterrupted run, where weight_version (the engine's own sync count) does not."""

    @property
    def weight_version(self) -> int:
        """Completed weight syncs since start; every RolloutBatch carries the version that generated it."""
        return self.weights.version

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
                 show_progress: bool | None = None, seed_stream: str = "",
                 sampling_seeds: Sequence[int] | None = None, interrupt: Interrupt | None = None) -> RolloutBatch:
        """`n` samples of each prompt (token ids), in prompt order; samples of prompt i get group_id
        first_group_id + i, meta = a copy of metas[i], prompt_text = prompt_texts[i]. Sent in requests of
        rollout.request_batch_size samples; each request must finish within timeout_s (default
        rollout.request_timeout_s). interrupt: fired from another thread, it stops the call early: samples then
        come back with what they had generated (finish_reason "abort", possibly no tokens), for the caller to
        continue (mcore_rl.rollout.partial).

        Sample j of prompt i is drawn with SGLang sampling_seed seeds.sample_seed(rollout.random_seed,
        first_group_id + i, j, stream=seed_stream) (honoured where the engine runs deterministic inference,
        rollout.deterministic); sampling_seeds (one per sample, prompt-major) replaces them (agent turns)."""
        from tqdm.auto import tqdm

        sampling = sampling or self.default_sampling()
        _check_generate_args(prompts, n, sampling, metas, prompt_texts, self.cfg.skip_tokenizer_init)
        self._check_can_generate()
        owners = [i for i in range(len(prompts)) for _ in range(n)]
        size = self.cfg.request_batch_size
        chunks = [owners[s:s + size] for s in range(0, len(owners), size)]
        if sampling_seeds is None:
            sampling_seeds = group_seeds(self.cfg.random_seed, first_group_id, len(prompts), n, seed_stream)
        elif len(sampling_seeds) != len(owners):
            raise ValueError(f"sampling_seeds has {len(sampling_seeds)} seeds for {len(owners)} samples")
        params = sampling.to_sglang()
        seeds = [[int(x) for x in sampling_seeds[s:s + size]] for s in range(0, len(owners), size)]
        requests = [{"input_ids": [[int(t) for t in prompts[i]] for i in chunk],
                     "sampling_params": [dict(params, sampling_seed=seed) for seed in chunk_seeds],
                     "return_logprob": True, "rid": [uuid.uuid4().hex for _ in chunk]}
                    for chunk, chunk_seeds in zip(chunks, seeds)]
        if self._route_shape is not None:  # every token's routes, from the first (routed_experts_start_len 0)
            for request in requests:
                request["return_routed_experts"] = True
        outputs: list[list[dict] | None] = [None] * len(requests)
        show = self.cfg.show_progress if show_progress is None else show_progress
        with tqdm(total=len(owners), desc="rollout", unit="sample", leave=False,
                  disable=not show or len(requests) < 2) as bar:
            def on_done(i: int, outs: list[dict]) -> None:
                outputs[i] = outs
                bar.update(len(outs))

            feed = RequestFeed(requests, closed=True)
            if interrupt is not None:
                interrupt.attach(feed)
            self._requests_may_run = True  # until this call returns normally
            self.backend.generate(feed, timeout_s or self.cfg.request_timeout_s,
                                  self.cfg.max_concurrent_requests, on_done)
            self._requests_may_run = False
        samples = []
        for chunk, outs in zip(chunks, outputs):
            if outs is None and feed.aborted:  # never sent: nothing generated yet
                outs = [{"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": None}}
                        for _ in chunk]
            if outs is None or len(outs) != len(chunk):
                raise RolloutEngineError(f"SGLang returned {0 if outs is None else len(outs)} outputs for a request "
                                         f"of {len(chunk)} samples")
            for i, out in zip(chunk, outs):
                sample = _to_sample(out, [int(t) for t in prompts[i]], first_group_id + i,
                                    metas[i] if metas else None, prompt_texts[i] if prompt_texts else "")
                if self._route_shape is not None:
                    sample.routed_experts = _routes(out["meta_info"], sample, *self._route_shape)
                samples.append(sample)
        return RolloutBatch(samples=samples, weight_version=self.weight_version, policy_version=self.policy_version)

    def stream(self, sampling: SamplingParams, on_sample: Callable[[Hashable, Sample], None], *,
               timeout_s: float | None = None) -> GenerationStream:
        """Generation that takes prompts while it runs: stream.submit(key, prompt_ids) sends one sample's request
        at once (SGLang batches it with everything in flight), on_sample(key, Sample) is called as each finishes
        (from the engine's thread: keep it short), stream.close() waits for the rest and raises the engine's
        error if there was one. For multi-turn rollouts, where each trajectory's next turn waits only for its own
        tool (mcore_rl.agent.rollout)."""
        _check_sampling(sampling, self.cfg.skip_tokenizer_init)
        self._check_can_generate()
        return GenerationStream(self, sampling, on_sample, timeout_s or self.cfg.request_timeout_s)

    def _check_can_generate(self) -> None:
        if self.weights.sync_open:
            raise RuntimeError("generate() called while a weight sync is open: call weights.end_update() first")
        if self.weights.stale is not None:
            raise RolloutEngineError(
                f"the last weight sync failed part-way ({self.weights.stale}), so the engine holds a mix of old and "
                "new weights. Run a complete sync (weights.weight_update(), weights.update_weights_from_tensors, "
                "DistributedWeightSender.sync or weights.update_weights_from_disk) before generating.")
        if self._released:
            raise RuntimeError(f"generate() called while memory is released ({sorted(self._released)}): call "
                               "resume_memory() first (and sync weights if 'weights' was released)")

    # -- cache, memory ----------------------------------------------------------------------------------------
    def flush_cache(self) -> None:
        """Drop SGLang's prefix (radix) cache, whose KV entries were computed with older weights."""
        self.weights.flush_cache()

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Return once SGLang runs no request, flushing its prefix cache on the way (that is how it is asked).
        Requests stopped by an Interrupt come back to the caller before the scheduler has dropped them, and a
        weight update while it still holds one fails its cache flush, which ends the scheduler: a sync after an
        interrupt waits here first (trainer/async_rollout.py)."""
        timeout_s = timeout_s or self.cfg.request_timeout_s
        ok, message = outcome(until_accepted(
            lambda: self.backend.call("flush the cache", timeout_s, self.backend.flush_cache), timeout_s))
        if not ok:
            raise RolloutEngineError(f"SGLang still runs requests {timeout_s:g} s after they were aborted "
                                     f"({message}); rollout.request_timeout_s bounds this wait")

    @property
    def released(self) -> frozenset[str]:
        """The memory tags released and not resumed yet."""
        return frozenset(self._released)

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


class GenerationStream:
    """RolloutEngine.stream's handle: one Backend.generate call over a RequestFeed, on a thread of its own."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams, on_sample, timeout_s: float):
        self._engine, self._on_sample, self._timeout_s = engine, on_sample, timeout_s
        self._params = sampling.to_sglang()
        self._feed = RequestFeed()
        self._lock = threading.Lock()
        self._sent: dict[int, tuple[Hashable, list[int]]] = {}
        engine._requests_may_run = True  # until close() returns normally
        self._future = run_in_thread(engine.backend.generate, self._feed, timeout_s,
                                     engine.cfg.max_concurrent_requests, self._done)

    def submit(self, key: Hashable, prompt_ids: Sequence[int], *, sampling_seed: int | None = None) -> None:
        """sampling_seed: SGLang's seed for this sample (mcore_rl.rollout.seeds); None = SGLang's global RNG."""
        prompt = [int(t) for t in prompt_ids]
        params = self._params if sampling_seed is None else dict(self._params, sampling_seed=int(sampling_seed))
        request = {"input_ids": [prompt], "sampling_params": params, "return_logprob": True,
                   "rid": [uuid.uuid4().hex]}
        with self._lock:  # _done looks the index up under the same lock: it cannot run before this is recorded
            self._sent[self._feed.put(request)] = (key, prompt)

    def _done(self, index: int, outs: list[dict]) -> None:
        with self._lock:
            key, prompt = self._sent.pop(index)
        if len(outs) != 1:
            raise RolloutEngineError(f"SGLang returned {len(outs)} outputs for a request of 1 sample")
        self._on_sample(key, _to_sample(outs[0], prompt, 0, None, ""))

    def failed(self) -> BaseException | None:
        """The engine's error if generation has stopped with one (the stream is then dead), else None."""
        return self._future.exception() if self._future.done() else None

    def close(self) -> None:
        """No more prompts; wait for those in flight (their on_sample calls included)."""
        self._feed.close()
        self._engine.backend.wait(self._future, "finish a generation stream", self._timeout_s + 60.0,
                                  on_timeout=lambda: None)
        self._engine._requests_may_run = False


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


def _route_shape(model_path: str) -> tuple[int, int, int]:
    """(num_layers, topk, num_experts) of the checkpoint's MoE layers, from its config.json."""
    import json

    if not model_path:
        raise ValueError("rollout.return_routed_experts needs the checkpoint's config.json (layers, top-k): set "
                         "rollout.model_path (or pass model_path=) also when attaching to a server")
    with open(os.path.join(os.path.expanduser(model_path), "config.json")) as f:
        hf = json.load(f)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts or not hf.get("num_experts_per_tok"):
        raise ValueError(f"rollout.return_routed_experts (model.moe_routing_replay) needs a mixture-of-experts "
                         f"model; {model_path} is dense ({hf.get('architectures')})")
    return int(hf["num_hidden_layers"]), int(hf["num_experts_per_tok"]), int(experts)


def _routes(info: dict, sample: Sample, num_layers: int, topk: int, num_experts: int):
    """SGLang's meta_info["routed_experts"] -> [P + R - 1, num_layers, topk] tensor. SGLang sends base64 of an
    int32 array covering positions [routed_experts_start_len, seqlen - 1): the tokens it ran forward (the last
    sampled token never is). Stored as uint8 / int16, whichever holds the expert ids, since every rank gets them."""
    import base64

    import numpy as np
    import torch

    encoded = info.get("routed_experts")
    if encoded is None:
        raise RolloutEngineError("SGLang returned no routed_experts although they were requested: the engine must "
                                 "run with enable_return_routed_experts (an attached server: launch it with "
                                 "--enable-return-routed-experts)")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    rows = sample.num_tokens - 1
    if flat.size != rows * num_layers * topk:
        raise RolloutEngineError(f"SGLang returned {flat.size} routed expert ids for {rows} tokens x {num_layers} "
                                 f"layers x top-{topk}")
    dtype = torch.uint8 if num_experts <= 256 else torch.int16
    return torch.from_numpy(flat.astype(np.int16)).to(dtype).reshape(rows, num_layers, topk)


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
    _check_sampling(sampling, skip_tokenizer_init)


def _check_sampling(sampling: SamplingParams, skip_tokenizer_init: bool) -> None:
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
