"""Colocated tensor sync (weight_sync.transport=tensor, layouts hf and engine): the exporter's buckets handed to an
engine on this host, one update call per bucket, all inside one sync (one cache flush, version + 1). The tensors
are shared with the engine's processes (CUDA IPC, or shared memory on CPU), not copied through a socket.

`push_buckets` is also the broadcast transport's loop (distributed.py): only how a bucket reaches the engine
differs.
"""

from __future__ import annotations

from typing import Callable


def push_buckets(exporter, receiver, send: Callable[[list, str], None] | None) -> tuple[int, int]:
    """One sync of every bucket: collective over the trainer (the export's TP all-gathers and PP transfers).

    Rank 0 (receiver: its RolloutEngine's WeightReceiver; None elsewhere) opens the sync, hands each bucket it
    receives to send(named_tensors, layout) and closes the sync; if the export or a send fails, the sync is
    abandoned (no version bump, generation refused until a complete sync) and the error raised. Returns (the
    engine's version after the sync, bytes sent): (0, 0) off rank 0."""
    import torch.distributed as dist

    rank = dist.get_rank()
    nbytes = 0
    if rank == 0:
        receiver.begin_update()
    try:
        for bucket in exporter:
            if bucket is None:
                continue
            named = list(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in named)
            send(named, bucket.layout)
    except BaseException as e:
        if rank == 0 and receiver.sync_open:
            receiver.abort_update(f"the weight export failed: {type(e).__name__}: {e}")
        raise
    return (receiver.end_update() if rank == 0 else 0), nbytes


class TensorSender:
    """Trainer side of colocated bucket syncs. exporter: every rank's HFWeightExporter (destination 0, layout hf or
    engine); receiver: rank 0's engine.weights, None elsewhere."""

    def __init__(self, exporter, receiver):
        self.exporter, self.receiver = exporter, receiver

    def push(self) -> tuple[int, int]:
        """(version, bytes) of one complete sync; collective."""
        send = None if self.receiver is None else (
            lambda named, layout: self.receiver.update_bucket(named, layout=layout))
        return push_buckets(self.exporter, self.receiver, send)

    def close(self) -> None:
        pass
