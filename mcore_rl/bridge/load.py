"""HF safetensors -> a live, sharded Megatron model: each rank reads only its TP shard of its pipeline stage (and of
a mixture-of-experts layer only its expert-parallel rank's experts, split over the expert tensor-parallel group).

    model = build_model(hf, model_cfg, parallel_cfg)
    load_hf_weights(model.chunks, hf_dir, critic=model.info.is_critic)
    # after mcore_rl.parallel.initialize, before building the optimizer

Every rank first checks the whole checkpoint against the config (names and shapes from the safetensors headers,
no tensor data), so all ranks fail together with the same message instead of some of them waiting in a collective.
"""

from __future__ import annotations

import os
import warnings

import torch

from mcore_rl.bridge.bind import bind
from mcore_rl.bridge.hf_io import SafetensorsReader
from mcore_rl.bridge.maps import Dims, allowed_extra, arch_map, expected_hf_tensors
from mcore_rl.bridge.transforms import to_shard


def check_hf_checkpoint(reader: SafetensorsReader, hf: dict, strict: bool = True) -> None:
    """Names and shapes of the checkpoint against what config.json implies.

    Missing tensors and wrong shapes are ValueErrors. Tensors the map does not use are a ValueError with
    strict=True, a warning otherwise.
    """
    arch = arch_map(hf).name
    expected = expected_hf_tensors(hf)
    present = set(reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more, e.g. {missing[1:4]})" if len(missing) > 1 else ""
        raise ValueError(
            f"HF checkpoint {reader.hf_dir!r} has no tensor {missing[0]!r}{more}, which its config.json "
            f"({arch}, {hf['num_hidden_layers']} layers) needs; the weights do not match the config"
        )
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise ValueError(
                f"tensor {name!r} in {os.path.join(reader.hf_dir, reader.file_of(name))} has shape {list(got)}, "
                f"expected {list(shape)} from {os.path.join(reader.hf_dir, 'config.json')} (hidden_size, "
                "num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size); the weights do "
                "not match the config: use the config.json they were saved with"
            )
    extra = sorted(n for n in present - expected.keys() if not allowed_extra(hf, n))
    if extra:
        msg = (f"HF checkpoint {reader.hf_dir!r} has {len(extra)} tensor(s) the {arch} map does not use: "
               f"{extra[:8]}")
        if strict:
            raise ValueError(msg + "; load with strict=False (convert_hf.py --allow-extra) to ignore them")
        warnings.warn(msg + "; ignored", stacklevel=3)


def _tp() -> tuple[int, int, int, int]:
    """(tp, tp rank, expert tp, expert tp rank): expert matrices are split over the expert tensor-parallel group."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())


def load_hf_weights(
    chunks: list,
    hf_dir: str | os.PathLike,
    hf: dict | None = None,
    strict: bool = True,
    progress: bool = False,
    *,
    critic: bool | None = None,
) -> None:
    """Copy the HF checkpoint's weights into this rank's model chunks (cast to each parameter's dtype).

    hf: the config.json dict (read from hf_dir when None). strict: unexpected extra tensors are an error (else a
    warning). progress: show a tqdm bar on this rank. Critic chunks get everything but their value head; critic:
    whether they are a critic's (ModelInfo.is_critic; None reads it from the chunks, bind.holds_value_head).
    Needs Megatron's parallel state; makes no collective calls.
    """
    if hf is None:
        from mcore_rl.models.arch import load_hf_config

        hf = load_hf_config(hf_dir)
    tp, tp_rank, etp, etp_rank = _tp()
    dims = Dims.from_hf(hf)
    bound = bind(chunks, hf, critic=critic)
    with SafetensorsReader(hf_dir) as reader:
        check_hf_checkpoint(reader, hf, strict)
        items = bound
        if progress:
            from tqdm import tqdm

            items = tqdm(bound, desc="loading HF weights", unit="tensor")
        for b in items:
            size, rank = (etp, etp_rank) if b.entry.expert is not None else (tp, tp_rank)
            shard = to_shard(b.entry.kind, [reader.slice(n) for n in b.entry.hf], size, rank, dims)
            if tuple(shard.shape) != tuple(b.param.shape):
                raise ValueError(
                    f"HF tensor(s) {list(b.entry.hf)} give a TP shard of shape {list(shard.shape)} but Megatron's "
                    f"{b.name} has shape {list(b.param.shape)} (tp={size}); the model was built from another config"
                )
            with torch.no_grad():
                b.param.copy_(shard)
