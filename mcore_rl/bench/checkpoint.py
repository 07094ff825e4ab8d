"""Checkpoint save time: the engine's save (model + optimizer + LR schedule through Megatron dist checkpointing,
written to a temporary folder and renamed: engine/checkpoint.py), in both optimizer formats, against torch.save of
the same tensors (every model parameter and every optimizer state tensor) into one file. Interleaved in one
process after one warm-up save of each; medians.

`checkpoint.ratio_vs_torch_save` = torch.save's seconds / ours in the default per-rank format
(trainer.checkpoint_reshardable=false; 1.0 = as fast as one torch.save), `checkpoint.reshardable.ratio_vs_torch_save`
the same for the gathered format, which loads at any layout (trainer.checkpoint_reshardable=true).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from mcore_rl.bench.common import median, timed


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _state_tensors(engine) -> dict[str, torch.Tensor]:
    """What torch.save writes: the model's parameters and the optimizer's state tensors, on this process."""
    from mcore_rl.engine.optimizer import inner_optimizers

    out = {f"model{i}.{k}": p.detach() for i, c in enumerate(engine.model_chunks) for k, p in c.named_parameters()}
    for i, opt in enumerate(inner_optimizers(engine.optimizer)):
        for j, (main, state) in enumerate(opt.optimizer.state.items()):
            out[f"opt{i}.{j}.param"] = main.detach()
            out.update({f"opt{i}.{j}.{k}": v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0})
    return out


def run(model: str, dtype: str = "bf16", repeats: int = 3, out_dir: str | None = None) -> dict:
    """Benchmark in this process (parallel state initialised, TP=PP=DP=1). `model` names dims of bench.train."""
    from mcore_rl.bench.train import MODELS
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine

    hf = MODELS[model]
    engine = TrainEngine(hf, ModelConfig(dtype=dtype, max_seq_len=128), ParallelConfig(), OptimConfig(lr=1e-6))
    engine._init_optimizer_state()  # Adam's moments as after a step
    scratch = tempfile.mkdtemp(prefix="bench_ckpt_", dir=out_dir)
    try:
        ours = lambda: engine.save_checkpoint(os.path.join(scratch, "fast"), reshardable=False)  # noqa: E731
        resh = lambda: engine.save_checkpoint(os.path.join(scratch, "reshardable"), reshardable=True)  # noqa: E731
        plain = os.path.join(scratch, "plain.pt")
        raw = lambda: torch.save(_state_tensors(engine), plain)  # noqa: E731
        ours(), resh(), raw()  # warm-up
        t_ours, t_resh, t_raw = [], [], []
        for _ in range(repeats):
            t_ours.append(timed(ours)[0])
            t_resh.append(timed(resh)[0])
            t_raw.append(timed(raw)[0])
        out = {"checkpoint.model": model, "checkpoint.dtype": dtype,
               "checkpoint.params": sum(p.numel() for c in engine.model_chunks for p in c.parameters()),
               "checkpoint.bytes": _folder_bytes(os.path.join(scratch, "fast")),
               "checkpoint.reshardable.bytes": _folder_bytes(os.path.join(scratch, "reshardable")),
               "checkpoint.torch_save_bytes": os.path.getsize(plain),
               "checkpoint.save_s": median(t_ours), "checkpoint.reshardable.save_s": median(t_resh),
               "checkpoint.torch_save_s": median(t_raw)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["checkpoint.ratio_vs_torch_save"] = out["checkpoint.torch_save_s"] / out["checkpoint.save_s"]
    out["checkpoint.reshardable.ratio_vs_torch_save"] = (out["checkpoint.torch_save_s"] /
                                                         out["checkpoint.reshardable.save_s"])
    out["checkpoint.gb_per_s"] = out["checkpoint.bytes"] / out["checkpoint.save_s"] / 1e9
    return out
