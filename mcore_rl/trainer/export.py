"""Write the live actor as an HF folder (end-of-run export and the disk weight-sync path)."""

from __future__ import annotations

import os

from mcore_rl.bridge import HFWeightExporter
from mcore_rl.bridge.convert import atomic_output_dir, write_hf_files


def write_hf(exporter: HFWeightExporter, src_dir: str, out: str) -> int:
    """Collective: the exporter's buckets as safetensors under `out`, atomically replacing what was there.
    Config and tokenizer files come from `src_dir`. Returns the bytes written (on rank 0)."""
    with atomic_output_dir(out, overwrite=True) as tmp:
        return write_hf_files(exporter, tmp, src_dir)


def export_final(actor_chunks, hf: dict, src_dir: str, out: str) -> str:
    write_hf(HFWeightExporter(actor_chunks, hf, destination=0), src_dir, out)
    return os.path.abspath(out)
