"""Disk sync (weight_sync.transport=disk): the actor is written as an HF folder and the engine reloads it. The slow
fallback, for an engine that can read this host's files but takes no tensors from it."""

from __future__ import annotations

import os


class DiskSender:
    """exporter: every rank's HFWeightExporter (destination 0, HF layout); receiver: rank 0's engine.weights, None
    elsewhere; model_path: the checkpoint whose config and tokenizer files go beside the weights; scratch_dir: where
    the folder is written (scratch_dir/weights, replaced atomically at each sync)."""

    def __init__(self, exporter, receiver, model_path: str, scratch_dir: str):
        self.exporter, self.receiver = exporter, receiver
        self.model_path, self.out = model_path, os.path.join(scratch_dir, "weights")

    def push(self) -> tuple[int, int]:
        """(version, bytes written) of one complete sync: (0, ...) off rank 0. Collective (the export)."""
        import torch.distributed as dist

        from mcore_rl.bridge.convert import atomic_output_dir, write_hf_files

        with atomic_output_dir(self.out, overwrite=True) as tmp:
            nbytes = write_hf_files(self.exporter, tmp, self.model_path)
        version = self.receiver.update_weights_from_disk(self.out) if dist.get_rank() == 0 else 0
        return version, nbytes

    def close(self) -> None:
        pass
