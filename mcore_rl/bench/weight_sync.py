"""Colocated weight sync: the trainer's own WeightSync (mcore_rl.weight_sync: export through HFWeightExporter with
its TP all-gather and buckets, or the shared layout's copy from the actor's own parameters; begin_update, the load,
end_update with its cache flush) against a plain copy of the same bytes (torch copy_ of the exported tensors into
preallocated tensors of the same shapes, on the receiving rank). Repeats alternate; the ratio is sync time / copy
time (1.0 = as fast as a copy). Also export alone (no engine) in seconds per GB, through
bridge.measure_export_seconds_per_gb (not for the shared layout, which exports nothing).

Every trainer rank runs this (the export is collective); global rank 0 owns the engine and receives the
buckets. Under `torchrun --nproc_per_node 2` with TP=2 the export includes the all-gather of TP shards.

layout (`--sync-layout`): auto (what the trainer would pick: shared, else engine, else hf, whichever is possible
first), hf, engine, shared, or all (each possible one measured; the unprefixed keys are auto's,
`weight_sync.hf.*` / `weight_sync.engine.*` / `weight_sync.shared.*` each layout's). `weight_sync.layout` says which
layout the unprefixed keys measured. The shared layout's baseline copies the engine layout's export (its bytes
include the vocabulary padding rows the shared layout does not write).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.bench.common import median, timed


def baseline_exporter(sync, actor_chunks, hf: dict, bucket_bytes: int):
    """Sets `sync` up with a first, untimed sync (plan, name check, hand-over) and returns the exporter whose
    tensors the plain-copy baseline copies: the sync's own, or for the shared layout (which exports nothing) the
    engine layout's. Collective."""
    from mcore_rl.bridge import HFWeightExporter

    sync.sync()
    return sync.exporter or HFWeightExporter(actor_chunks, hf, bucket_bytes=bucket_bytes, destination=0,
                                             layout="engine")


class PlainCopy:
    """The baseline: the same HF tensors copied into preallocated tensors (rank 0 only)."""

    def __init__(self, exporter):
        self.src = [t.clone() for b in exporter if b is not None for _, t in b]  # collective
        self.dst = [torch.empty_like(t) for t in self.src]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)

    def __call__(self) -> None:
        for d, s in zip(self.dst, self.src):
            d.copy_(s)


SYNC_LAYOUTS = ("auto", "hf", "engine", "shared", "all")
_KEYS = ("seconds", "copy_seconds", "gb_per_s", "ratio_vs_copy", "export_seconds_per_gb", "num_buckets")


def run(engine, actor_chunks, hf: dict, bucket_bytes: int, repeats: int = 3, warmup: int = 1,
        layout: str = "auto") -> dict:
    """engine: the RolloutEngine on global rank 0, None on the other ranks."""
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.parallel.runtime import from_rank0
    from mcore_rl.weight_sync.plan import possible_layouts
    from mcore_rl.weight_sync.sync import choose_layout, plan_inputs

    if layout not in SYNC_LAYOUTS:
        raise ValueError(f"layout must be one of {SYNC_LAYOUTS}, got {layout!r}")
    decided = None
    if dist.get_rank() == 0:  # rank 0 owns the engine: it decides, as in the trainer
        try:
            chosen = choose_layout(WeightSyncConfig(), hf, engine, "auto" if layout == "all" else layout).layout
        except ValueError as e:
            chosen = e
        decided = (chosen, possible_layouts("tensor", *plan_inputs(hf, engine)))
    chosen, possible = from_rank0(decided)
    if layout != "all":
        return {"weight_sync.layout": chosen, **_measure(engine, actor_chunks, hf, bucket_bytes, repeats, warmup,
                                                          chosen)}
    out: dict = {"weight_sync.layout": chosen}
    for each in possible:
        figures = _measure(engine, actor_chunks, hf, bucket_bytes, repeats, warmup, each)
        out.update({k.replace("weight_sync.", f"weight_sync.{each}.", 1): v for k, v in figures.items()
                    if k.removeprefix("weight_sync.") in _KEYS})
        if each == chosen:
            out.update(figures)
    return out


def _measure(engine, actor_chunks, hf: dict, bucket_bytes: int, repeats: int, warmup: int, layout: str) -> dict:
    """The trainer's own WeightSync in this layout, interleaved with the plain copy of the exported tensors."""
    from mcore_rl.bridge import measure_export_seconds_per_gb
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.weight_sync import WeightSync

    sync = WeightSync(WeightSyncConfig(layout=layout), actor_chunks, hf, engine, bucket_bytes=bucket_bytes)
    exporter = baseline_exporter(sync, actor_chunks, hf, bucket_bytes)
    receiver = dist.get_rank() == 0
    copy = PlainCopy(exporter)
    for _ in range(warmup):
        sync.sync()
        if receiver:
            copy()
    t_sync, t_copy = [], []
    for _ in range(repeats):  # interleaved
        dist.barrier()
        t_sync.append(timed(sync.sync)[0])
        if receiver:
            t_copy.append(timed(copy)[0])
    export = measure_export_seconds_per_gb(exporter, repeats=repeats) if sync.exporter is not None else None
    if not receiver:
        return {}
    if layout != "shared":
        assert sync.last_bytes == copy.nbytes == exporter.total_bytes, (sync.last_bytes, copy.nbytes,
                                                                          exporter.total_bytes)
    s, c = median(t_sync), median(t_copy)
    gb = sync.last_bytes / 1e9
    return {
        "weight_sync.tp": exporter.tp, "weight_sync.gbytes": gb,
        "weight_sync.num_buckets": export["num_buckets"] if export else 0,
        "weight_sync.seconds": s, "weight_sync.copy_seconds": c,
        "weight_sync.gb_per_s": gb / s, "weight_sync.copy_gb_per_s": copy.nbytes / 1e9 / c,
        "weight_sync.ratio_vs_copy": s / c,
        "weight_sync.export_seconds_per_gb": export["seconds_per_gb"] if export else None,
    }
