"""Colocated weight sync: the actor's weights exported through HFWeightExporter (TP all-gather, HF layout,
buckets) into the engine (begin_update / update_bucket per bucket / end_update with its cache flush) against a
plain copy of the same bytes (torch copy_ of the exported HF tensors into preallocated tensors of the same
shapes, on the receiving rank). Repeats alternate; the ratio is sync time / copy time (1.0 = as fast as a copy).
Also export alone (no engine) in seconds per GB, through bridge.measure_export_seconds_per_gb.

Every trainer rank runs this (the export is collective); global rank 0 owns the engine and receives the
buckets. Under `torchrun --nproc_per_node 2` with TP=2 the export includes the all-gather of TP shards.
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
        engine.update_bucket(named)
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


def run(engine, actor_chunks, hf: dict, bucket_bytes: int, repeats: int = 3, warmup: int = 1) -> dict:
    """engine: the RolloutEngine on global rank 0, None on the other ranks."""
    from mcore_rl.bridge import HFWeightExporter, measure_export_seconds_per_gb

    exporter = HFWeightExporter(actor_chunks, hf, bucket_bytes=bucket_bytes, destination=0)
    receiver = dist.get_rank() == 0
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
