"""Colocated weight sync: the actor's weights exported through HFWeightExporter (TP all-gather, HF layout,
buckets) into the engine (begin_update / update_bucket per bucket / end_update with its cache flush) against a
plain copy of the same bytes (torch copy_ of the exported HF tensors into preallocated tensors of the same
shapes, on the receiving rank). Repeats alternate; the ratio is sync time / copy time (1.0 = as fast as a copy).
Also export alone (no engine) in seconds per GB, through bridge.measure_export_seconds_per_gb.

Every trainer rank runs this (the export is collective); global rank 0 owns the engine and receives the
buckets. Under `torchrun --nproc_per_node 2` with TP=2 the export includes the all-gather of TP shards.

layout (`--sync-layout`): auto (what the trainer would pick: the engine layout where supported, else hf), hf,
engine, or both (each measured; the unprefixed keys are auto's, `weight_sync.hf.*` / `weight_sync.engine.*` each
layout's). `weight_sync.layout` says which layout the unprefixed keys measured.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.bench.common import median, timed


def sync_once(engine, exporter) -> int:
    """One complete sync (collective); returns the bytes handed to the engine on rank 0, 0 elsewhere."""
    nbytes = 0
    if engine is not None:
        engine.begin_update()
    for bucket in exporter:
        if bucket is None:
            continue
        named = list(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in named)
        engine.update_bucket(named, layout=bucket.layout)
    if engine is not None:
        engine.end_update()
    return nbytes


class PlainCopy:
    """The baseline: the same HF tensors copied into preallocated tensors (rank 0 only)."""

    def __init__(self, exporter):
        self.src = [t.clone() for b in exporter if b is not None for _, t in b]  # collective
        self.dst = [torch.empty_like(t) for t in self.src]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)

    def __call__(self) -> None:
        for d, s in zip(self.dst, self.src):
            d.copy_(s)


SYNC_LAYOUTS = ("auto", "hf", "engine", "both")
_KEYS = ("seconds", "copy_seconds", "gb_per_s", "ratio_vs_copy", "export_seconds_per_gb", "num_buckets")


def run(engine, actor_chunks, hf: dict, bucket_bytes: int, repeats: int = 3, warmup: int = 1,
        layout: str = "auto") -> dict:
    """engine: the RolloutEngine on global rank 0, None on the other ranks."""
    from mcore_rl.parallel.runtime import from_rank0
    from mcore_rl.trainer.sync import choose_layout, layout_blockers

    if layout not in SYNC_LAYOUTS:
        raise ValueError(f"layout must be one of {SYNC_LAYOUTS}, got {layout!r}")
    chosen = None
    if dist.get_rank() == 0:  # rank 0 owns the engine: it decides, as in the trainer
        try:
            chosen = choose_layout("auto" if layout == "both" else layout, layout_blockers("tensor", hf, engine))
        except ValueError as e:
            chosen = e
    chosen = from_rank0(chosen)
    if layout != "both":
        return {"weight_sync.layout": chosen, **_measure(engine, actor_chunks, hf, bucket_bytes, repeats, warmup,
                                                          chosen)}
    out: dict = {"weight_sync.layout": chosen}
    for each in ("hf", "engine"):
        figures = _measure(engine, actor_chunks, hf, bucket_bytes, repeats, warmup, each)
        out.update({k.replace("weight_sync.", f"weight_sync.{each}.", 1): v for k, v in figures.items()
                    if k.removeprefix("weight_sync.") in _KEYS})
        if each == chosen:
            out.update(figures)
    return out


def _measure(engine, actor_chunks, hf: dict, bucket_bytes: int, repeats: int, warmup: int, layout: str) -> dict:
    from mcore_rl.bridge import HFWeightExporter, measure_export_seconds_per_gb

    exporter = HFWeightExporter(actor_chunks, hf, bucket_bytes=bucket_bytes, destination=0, layout=layout)
    receiver = dist.get_rank() == 0
    if layout == "engine" and receiver:  # the whole name set once, as WeightSync's first sync does
        from mcore_rl.rollout.engine_params import check_names

        check_names({n: s for n, s, _ in exporter.tensor_specs()}, engine.engine_parameters(),
                    "the engine-layout export")
    copy = PlainCopy(exporter)
    for _ in range(warmup):
        sync_once(engine, exporter)
        if receiver:
            copy()
    t_sync, t_copy, nbytes = [], [], 0
    for _ in range(repeats):  # interleaved
        dist.barrier()
        t, nbytes = timed(lambda: sync_once(engine, exporter))
        t_sync.append(t)
        if receiver:
            t_copy.append(timed(copy)[0])
    export = measure_export_seconds_per_gb(exporter, repeats=repeats)
    if not receiver:
        return {}
    assert nbytes == copy.nbytes == exporter.total_bytes, (nbytes, copy.nbytes, exporter.total_bytes)
    s, c = median(t_sync), median(t_copy)
    gb = nbytes / 1e9
    return {
        "weight_sync.tp": export["tp"], "weight_sync.gbytes": gb, "weight_sync.num_buckets": export["num_buckets"],
        "weight_sync.seconds": s, "weight_sync.copy_seconds": c,
        "weight_sync.gb_per_s": gb / s, "weight_sync.copy_gb_per_s": gb / c,
        "weight_sync.ratio_vs_copy": s / c,
        "weight_sync.export_seconds_per_gb": export["seconds_per_gb"],
    }
