"""Weights between HF checkpoints and Megatron-Core models (docs/bridge.md).

maps.py (per-architecture name/shape tables, pure) -> transforms.py (TP split/merge, pure) -> bind.py (this rank's
parameters) -> load.py (HF safetensors into a live model), export.py (streaming HF buckets out of a live model),
checkpoint.py (Megatron dist checkpoints), convert.py (the offline converter behind tools/convert_hf.py).
"""

from mcore_rl.bridge.checkpoint import load_mcore_checkpoint, save_mcore_checkpoint
from mcore_rl.bridge.convert import atomic_output_dir, hf_to_mcore, mcore_to_hf, write_hf_files
from mcore_rl.bridge.export import DEFAULT_BUCKET_BYTES, Bucket, HFWeightExporter, measure_export_seconds_per_gb
from mcore_rl.bridge.load import check_hf_checkpoint, load_hf_weights
from mcore_rl.bridge.maps import ARCH_MAPS, Kind, arch_map, expand, expected_hf_tensors

__all__ = [
    "ARCH_MAPS", "Bucket", "DEFAULT_BUCKET_BYTES", "HFWeightExporter", "Kind", "arch_map", "atomic_output_dir",
    "check_hf_checkpoint", "expand", "expected_hf_tensors", "hf_to_mcore", "load_hf_weights", "load_mcore_checkpoint",
    "mcore_to_hf", "measure_export_seconds_per_gb", "save_mcore_checkpoint", "write_hf_files",
]
