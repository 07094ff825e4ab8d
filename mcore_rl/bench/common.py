"""Pieces the rollout, weight_sync and e2e benchmarks share: an HF model folder by name, one SGLang engine
(RolloutEngine hides torchrun's variables from it), the training engine loaded from the folder, timing helpers."""

from __future__ import annotations

import os
import statistics
import time

import torch

def model_folder(name: str, scratch: str) -> str:
    """`tiny` (random qwen2, vocab 512, written to scratch), `tiny-moe` (random qwen3_moe: 4 experts, top-2),
    `smollm2` (SmolLM2-135M, cached) or an HF folder."""
    if name in ("tiny", "tiny-moe"):
        from mcore_rl.testing import make_tiny_hf_model

        arch = "qwen2" if name == "tiny" else "qwen3_moe"
        path = os.path.join(scratch, f"tiny_{arch}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            make_tiny_hf_model(path, arch=arch, seed=0)
        return path
    if name == "smollm2":
        from mcore_rl.models.smollm2 import ensure_hf_folder

        return str(ensure_hf_folder())
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"--model {name!r} is neither 'tiny', 'tiny-moe', 'smollm2' nor an HF folder with "
                         "config.json")
    return name


def model_dtype() -> str:
    """bf16 on GPUs (what RL runs use), fp32 on CPU (SGLang's CPU path and exact parity)."""
    return "bf16" if torch.cuda.is_available() else "fp32"


def start_engine(path: str, max_total_tokens: int, **overrides):
    """The RolloutEngine every sub-benchmark of one run shares (mode=engine: the raw sglang.Engine it holds is
    reachable for the raw side, so both sides use the same engine processes)."""
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.rollout.engine import RolloutEngine

    cfg = dict(mode="engine", dtype=model_dtype(), show_progress=False, log_level="error")
    if not torch.cuda.is_available():
        cfg.update(max_total_tokens=max_total_tokens, request_batch_size=32, max_concurrent_requests=4)
    else:  # colocated with the trainer's models on one GPU; triton attention (FA3 kernels are optional)
        cfg.update(attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.35,
                   request_batch_size=256, extra_args={"cuda_graph_max_bs_decode": 64,
                                                       "disable_prefill_cuda_graph": True})
    cfg.update(overrides)
    return RolloutEngine(RolloutConfig(**cfg), model_path=path)


def raw_sglang(engine):
    """The sglang.Engine inside a mode=engine RolloutEngine (bench only: it reaches into the backend)."""
    raw = getattr(engine.backend, "_engine", None)
    if raw is None:
        raise ValueError("the raw side needs rollout mode=engine (an in-process sglang.Engine)")
    return raw


def load_actor(path: str, hf: dict, parallel, with_optimizer: bool = True, lr: float = 1e-6,
               lm_head: str = "loss_tokens", attention: str = "sdpa", forward_cuda_graphs: str = "off"):
    """TrainEngine with the folder's weights (optimizer for the actor, none for a reference); attention: the layer
    spec, "sdpa" (Megatron's local spec) or "te" (Transformer Engine's; an MoE's experts then run as grouped
    GEMMs); forward_cuda_graphs: ModelConfig's."""
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.engine import TrainEngine

    model_cfg = ModelConfig(dtype=model_dtype(), attention=attention, max_seq_len=4096, lm_head=lm_head,
                            forward_cuda_graphs=forward_cuda_graphs)
    eng = TrainEngine(hf, model_cfg, parallel, OptimConfig(lr=lr, clip_grad=1.0) if with_optimizer else None)
    load_hf_weights(eng.model_chunks, path, hf)
    eng.reload_master_weights()
    return eng


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(seconds, fn's result), with the device drained on both sides."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t, out


def median(xs) -> float:
    return float(statistics.median(xs))


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab - 1, (num, length), generator=g).tolist()
