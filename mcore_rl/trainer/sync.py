"""Weight sync from the Megatron actor to the rollout engine, between training and generation.

Global rank 0 owns the engine (colocated: it shares the first GPU's process; disaggregated: it drives a
broadcast group with the engine's own GPUs). Every trainer rank iterates the bridge's bucketed export in
lockstep (the TP all-gathers and PP transfers are collectives); only rank 0 receives full HF tensors and
hands them on:

* tensor: update_weights_from_tensor per bucket, inside one begin/end (one cache flush, version + 1);
* distributed: update_weights_from_distributed, the buckets broadcast over a trainer-engine process group;
* disk: the export is written as an HF folder and the engine reloads it (the slow fallback).

Tensor syncs hand the engine either HF tensors (layout "hf", mapped by SGLang's model.load_weights), the
engine's own parameters (layout "engine", bridge.engine_layout: fused q/k/v and gate/up as views of the export's
buffers, copied into the engine's parameters as they are), or nothing at all (layout "shared": the engine was
handed the actor's parameters themselves once, as CUDA IPC handles, and copies them into its layout when told;
needs rank 0 to hold them whole, TP=1 and PP=1; docs/rollout.md). rollout.weight_sync_layout picks: auto = the
first possible of shared, engine, hf, with one log line saying why. The choice is made once, at the first sync,
on rank 0 (it owns the engine) and sent to every rank, since the ranks that gather and send must pack buckets
alike; it includes checking the names and shapes to send against the running engine's parameters.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from mcore_rl.bridge import HFWeightExporter
from mcore_rl.parallel.runtime import from_rank0

logger = logging.getLogger(__name__)


def layout_blockers(mode: str, hf: dict, rollout) -> list[str]:
    """Why the engine layout cannot be used (empty: it can). rollout: the RolloutEngine (rank 0)."""
    from mcore_rl.bridge.engine_layout import unsupported_reason

    reasons = []
    if mode != "tensor":
        reasons.append(f"trainer.weight_sync={mode} (the engine layout is for colocated tensor syncs)")
    for reason in (unsupported_reason(hf), rollout.engine_layout_blocker()):
        if reason is not None:
            reasons.append(reason)
    return reasons


def shared_blockers(tp: int, pp: int) -> list[str]:
    """Why the shared layout cannot be used on top of the engine layout's blockers (empty: it can)."""
    if tp * pp == 1:
        return []
    return [f"the actor is split (parallel.tp={tp}, parallel.pp={pp}): rank 0 does not hold whole parameters for "
            "the engine to copy from"]


def layout_reasons(mode: str, hf: dict, rollout) -> tuple[list[str], list[str]]:
    """choose_layout's inputs on rank 0 here: (layout_blockers, shared_blockers of this process's TP / PP)."""
    from megatron.core import parallel_state as ps

    return (layout_blockers(mode, hf, rollout),
            shared_blockers(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()))


def choose_layout(requested: str, blockers: list[str], split: list[str] = ()) -> str:
    """hf | engine | shared for rollout.weight_sync_layout=`requested`. blockers: layout_blockers (engine and
    shared); split: shared_blockers (shared only). ValueError when a layout is forced but blocked; auto takes
    the first possible of shared, engine, hf and logs one line naming what ruled the others out."""
    if requested == "hf":
        return "hf"
    if requested in ("engine", "shared"):
        reasons = blockers + list(split) if requested == "shared" else blockers
        if reasons:
            fallback = "auto (falls back to engine or hf)" if requested == "shared" else "auto (falls back to hf)"
            raise ValueError(f"rollout.weight_sync_layout={requested} is not possible: {'; '.join(reasons)}. Set "
                             f"rollout.weight_sync_layout={fallback} or hf.")
        return requested
    if not blockers and not split:
        return "shared"
    if not blockers:
        logger.info("weight sync: engine layout (buckets, not shared parameters), since %s", "; ".join(split))
        return "engine"
    logger.info("weight sync: HF layout (SGLang maps the names), since %s", "; ".join(blockers))
    return "hf"


class WeightSync:
    def __init__(self, actor_chunks, hf: dict, mode: str, bucket_bytes: int, rollout, scratch_dir: str,
                 model_path: str, layout: str | None = None):
        """layout: auto | hf | engine | shared; None reads rollout.weight_sync_layout (rank 0's config decides)."""
        self.mode = mode
        self.model_path = model_path  # config and tokenizer files for the disk path
        self.rollout = rollout  # RolloutEngine on global rank 0, None elsewhere
        self.actor_chunks, self.hf, self.bucket_bytes = actor_chunks, hf, bucket_bytes
        self.requested_layout = layout
        self.layout: str | None = None  # hf | engine | shared, once chosen (first sync)
        self.exporter: HFWeightExporter | None = None
        self.scratch_dir = scratch_dir
        self._sender = None
        self._shared: SharedParams | None = None  # rank 0, shared layout
        self.last_bytes = 0

    def _setup(self) -> None:
        """Choose the layout (rank 0) and build the export plan: collective, once."""
        rank0 = dist.get_rank() == 0
        requested = (self.requested_layout or self.rollout.cfg.weight_sync_layout) if rank0 else None
        choice = None
        if rank0:
            try:
                choice = choose_layout(requested, *layout_reasons(self.mode, self.hf, self.rollout))
            except Exception as e:  # every rank must hear of it, or the others wait in the next collective
                choice = e
        layout = from_rank0(choice)
        if layout == "shared":
            def share() -> None:  # hands the parameters over, checking names and shapes against the engine
                self._shared = SharedParams(self.actor_chunks, self.hf, self.rollout)

            if self._fits_engine("shared", requested, share):
                if rank0:
                    logger.info("weight sync: shared layout (the engine copies the actor's parameters into its own)")
                self.layout = layout
                return
            layout = "hf"
        self.exporter = self._exporter(layout)
        if layout == "engine":
            def check() -> None:
                from mcore_rl.rollout.engine_params import check_names

                check_names({n: s for n, s, _ in self.exporter.tensor_specs()}, self.rollout.engine_parameters(),
                            "the engine-layout export")

            if not self._fits_engine("engine", requested, check):
                layout = "hf"
                self.exporter = self._exporter(layout)
            elif rank0:
                logger.info("weight sync: engine layout (SGLang's own parameters, copied as they are)")
        self.layout = layout

    @staticmethod
    def _fits_engine(layout: str, requested: str | None, check) -> bool:
        """Collective. Rank 0 runs `check`, which raises ValueError when `layout` does not fit the running engine:
        False then (fall back to hf, logged), unless `layout` was asked for by name, when the error is raised on
        every rank, as is any other exception of `check`."""
        verdict = None
        if dist.get_rank() == 0:
            try:
                check()
            except ValueError as e:
                verdict = e if requested == layout else "hf"
                if verdict == "hf":
                    logger.warning("weight sync: HF layout, since %s", e)
            except Exception as e:
                verdict = e
        return from_rank0(verdict) != "hf"

    def _exporter(self, layout: str) -> HFWeightExporter:
        exporter = HFWeightExporter(self.actor_chunks, self.hf, bucket_bytes=self.bucket_bytes, destination=0,
                                    layout=layout)
        exporter.plan()  # collective: every rank builds it here, together
        return exporter

    def sync(self) -> int:
        """Push the actor's current weights; returns the engine's new weight version (0 off rank 0)."""
        if self.layout is None:
            self._setup()
        rank = dist.get_rank()
        if self.layout == "shared":  # rank 0 alone: no export, no collective
            if rank != 0:
                return 0
            with self.rollout.weight_update():  # abandoned (no version bump) if the push fails
                self.last_bytes = self._shared.push()
            return self.rollout.weight_version
        if self.mode == "disk":
            return self._sync_disk()
        if self.mode == "distributed" and rank == 0 and self._sender is None:
            from mcore_rl.rollout.weight_sync import DistributedWeightSender

            self._sender = DistributedWeightSender(self.rollout)
            self._sender.connect()
        nbytes = 0
        if rank == 0:
            self.rollout.begin_update()
        try:
            for bucket in self.exporter:
                if bucket is None:
                    continue
                named = list(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in named)
                if self.mode == "tensor":
                    self.rollout.update_bucket(named, layout=bucket.layout)
                else:
                    self._sender.send_bucket(named)
        except BaseException as e:
            if rank == 0 and self.rollout.sync_open:
                self.rollout.abort_update(f"the weight export failed: {type(e).__name__}: {e}")
            raise
        self.last_bytes = nbytes
        return self.rollout.end_update() if rank == 0 else 0

    def _sync_disk(self) -> int:
        from mcore_rl.trainer.export import write_hf

        out = os.path.join(self.scratch_dir, "weights")
        self.last_bytes = write_hf(self.exporter, self.model_path, out)
        return self.rollout.update_weights_from_disk(out) if dist.get_rank() == 0 else 0

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


class SharedParams:
    """Rank 0's side of the shared layout (bridge.engine_layout.shared_plan): the actor's parameters are handed to
    the engine once, as handles; each push has the engine copy them into its own parameters, with no export and
    no bucket. They are handed over again when a parameter's storage moved (its .data reassigned, e.g. by a
    checkpoint load), which the trainer's in-place optimizer steps never do."""

    def __init__(self, actor_chunks, hf: dict, rollout):
        import torch

        from mcore_rl.bridge.engine_layout import shared_plan

        self.params, self.ops = shared_plan(actor_chunks, hf)
        self.rollout = rollout
        self._where: list[int] | None = None
        self.nbytes = 0
        for _, shape, k, rows in self.ops:
            row = self.params[k].element_size() * (torch.Size(shape[1:]).numel())
            self.nbytes += row * (rows if isinstance(rows, int) else len(rows))
        self._share()  # now: names and shapes are checked against the engine before the first sync

    def _share(self) -> None:
        self.rollout.share_parameters(self.params, self.ops)
        self._where = self._storages()  # after sharing: on CPU the storages move into shared memory

    def _storages(self) -> list[int]:
        return [p.data_ptr() for p in self.params]

    def push(self) -> int:
        """Inside an open sync: the engine takes the current weights. Returns the bytes it copied."""
        import torch

        device = self.params[0].device
        if device.type == "cuda":  # the engine reads them from another process: the optimizer must be done
            torch.cuda.current_stream(device).synchronize()
        if self._where != self._storages():
            self._share()
        self.rollout.update_from_shared()
        return self.nbytes

