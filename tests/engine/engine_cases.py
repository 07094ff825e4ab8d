"""Shared pieces of the engine's multi-process tests: tiny models, fixed data, loss functions, comparisons.

Imported by the torchrun worker scripts in this folder (their folder is on sys.path) and by the tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# llama: untied embeddings; qwen2: tied (exercises the embedding-grad all-reduce between pipeline stages).
ARCHS = {"llama": False, "qwen2": True}
LENGTHS = [11, 7, 16, 5, 13, 9, 20, 4]
PROMPT_LEN = 3
LR = 1e-3
ADAM_EPS = 1e-6
STEPS = 2


def make_models(root: Path) -> dict[str, str]:
    from mcore_rl.testing import make_tiny_hf_model

    paths = {}
    for arch, tied in ARCHS.items():
        path = Path(root) / f"tiny_{arch}"
        if not (path / "config.json").exists():
            make_tiny_hf_model(path, arch, tied=tied, seed=0)
        paths[arch] = str(path)
    return paths


def sequences(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in LENGTHS:
        mask = (torch.arange(n) >= PROMPT_LEN).float()
        seqs.append({
            "input_ids": torch.randint(0, 500, (n,), generator=g),
            "loss_mask": mask,
            "advantages": torch.randn(n, generator=g),
            "returns": torch.randn(n, generator=g),
        })
    return seqs


def dp_share(seqs, dp_rank: int, dp_size: int):
    return [s for i, s in enumerate(seqs) if i % dp_size == dp_rank]


def num_loss_tokens(seqs) -> float:
    return float(sum(s["loss_mask"].sum() for s in seqs))


def policy_loss(outputs, mb):
    """Sum over the micro batch's tokens of a policy-gradient loss with an entropy bonus (normalised by the
    engine with the global token count)."""
    mask = mb["loss_mask"]
    per_token = -(mb["advantages"] * outputs["logprobs"]) - 0.01 * outputs["entropy"]
    loss = (per_token * mask).sum()
    return loss, {"tokens": mask.sum(), "logprob_sum": (outputs["logprobs"] * mask).sum()}


def value_loss(outputs, mb):
    mask = mb["loss_mask"]
    return (((outputs["values"] - mb["returns"]) ** 2) * mask).sum(), {}


def model_cfg(path: str, dtype: str = "fp32", recompute: str = "none", critic: bool = False,
              lm_head: str = "loss_tokens"):
    from mcore_rl.config.model import ModelConfig

    return ModelConfig(path=path, dtype=dtype, recompute=recompute, max_seq_len=64,
                       critic_value_head_std=0.05 if critic else 0.0, lm_head=lm_head)


def grads_by_name(engine) -> dict[str, torch.Tensor]:
    """This rank's full (DP-reduced) main grads by parameter name.

    With the distributed optimizer DDP reduce-scatters: each DP rank holds the reduced sum only for its shard
    of each bucket. Gathering the shards back (what the optimizer does for params) gives the full reduced grad.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1 and engine.optim_cfg.use_distributed_optimizer:
        group = parallel_state.get_data_parallel_group()
        for chunk in engine.chunks:
            for buffer in chunk.buffers:
                for bucket in buffer.buckets:
                    data = bucket.grad_data
                    shard = data.numel() // dp
                    local = data[shard * dist.get_rank(group):shard * (dist.get_rank(group) + 1)].clone()
                    dist.all_gather_into_tensor(data, local, group=group)
    out = {}
    for i, chunk in enumerate(engine.model_chunks):
        for name, p in chunk.named_parameters():
            out[f"{i}.{name}"] = p.main_grad.detach().clone()
    return out


def params_by_name(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def save_tensors_as_model(tensors: dict[str, torch.Tensor], hf, cfg, parallel, path, critic: bool = False):
    """Write per-name tensors (e.g. grads) as a Megatron dist checkpoint of a model, so another layout can load
    them resharded and compare shard by shard."""
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import build_model

    chunks = build_model(hf, cfg, parallel, value_head=critic).chunks
    with torch.no_grad():
        for i, c in enumerate(chunks):
            for n, p in c.named_parameters():
                p.copy_(tensors[f"{i}.{n}"])
    ckpt.save(path, chunks)


def load_model_tensors(hf, cfg, parallel, path, critic: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint written at any layout, resharded to this rank's layout, by parameter name."""
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import build_model

    chunks = build_model(hf, cfg, parallel, value_head=critic).chunks
    ckpt.load(path, chunks)
    return params_by_name(chunks)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Largest differences between two name -> tensor dicts (same keys): `abs` over all tensors, `rel` = the
    worst per-tensor max|a - b| / max|b| (with the tensor's name), `scale` = max |b| over all tensors."""
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    out = {"abs": 0.0, "rel": 0.0, "scale": 0.0, "name": ""}
    for k in a:
        if not a[k].numel():
            continue
        d = (a[k].float() - b[k].float()).abs().max().item()
        ref = b[k].abs().max().item()
        out["abs"] = max(out["abs"], d)
        out["scale"] = max(out["scale"], ref)
        rel = d / ref if ref > 0 else (0.0 if d == 0 else float("inf"))
        if rel >= out["rel"]:
            out["rel"], out["name"] = rel, k
    return out


def write_json(path, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
