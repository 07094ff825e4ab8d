"""Weight sync from the Megatron actor to the rollout engine, between training and generation.

Global rank 0 owns the engine (colocated: it shares the first GPU's process; disaggregated: it drives a
broadcast group with the engine's own GPUs). Every trainer rank iterates the bridge's bucketed export in
lockstep (the TP all-gathers and PP transfers are collectives); only rank 0 receives full HF tensors and
hands them on:

* tensor: update_weights_from_tensor per bucket, inside one begin/end (one cache flush, version + 1);
* distributed: update_weights_from_distributed, the buckets broadcast over a trainer-engine process group;
* disk: the export is written as an HF folder and the engine reloads it (the slow fallback).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from mcore_rl.bridge import HFWeightExporter


class WeightSync:
    def __init__(self, actor_chunks, hf: dict, mode: str, bucket_bytes: int, rollout, scratch_dir: str,
                 model_path: str):
        self.mode = mode
        self.model_path = model_path  # config and tokenizer files for the disk path
        self.rollout = rollout  # RolloutEngine on global rank 0, None elsewhere
        self.exporter = HFWeightExporter(actor_chunks, hf, bucket_bytes=bucket_bytes, destination=0)
        self.scratch_dir = scratch_dir
        self._sender = None
        self.last_bytes = 0

    def sync(self) -> int:
        """Push the actor's current weights; returns the engine's new weight version (0 off rank 0)."""
        rank = dist.get_rank()
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
                    self.rollout.update_bucket(named)
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
