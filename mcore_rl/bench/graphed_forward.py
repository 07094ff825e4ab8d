"""Forward-only log-prob passes with and without CUDA graphs (ModelConfig.forward_cuda_graphs), on one GPU.

    python -m mcore_rl.bench.graphed_forward --model qwen2.5-0.5b [--json OUT] [--budget 16384]

The batch is e2e's shape: 64 sequences of 128 prompt + 256 response tokens (random weights at the named model's
dims, bf16, SDPA). For the reference (no optimizer) and the actor (after an optimizer step, so the graphs must read
the moved weights) it prints and writes:

  values   max / mean |graphed - eager| of the log-probs on the loss mask (bf16: the padded shapes change the
           kernels' tiling, so the two agree to bf16 rounding, not bit for bit)
  times    median of 7 calls each, eager and graphed (after the second graphed call, which captures), the
           capture call itself, and the GPU's busy time of one eager call (the floor a graph can approach)
"""

from __future__ import annotations

import argparse
import json

import torch


def _batch(vocab: int, num: int = 64, prompt: int = 128, response: int = 256):
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(num):
        n = prompt + response - (i % 7) * 16  # unequal lengths: the varlen kernel, as in a real rollout
        mask = torch.zeros(n)
        mask[prompt:] = 1
        seqs.append({"input_ids": torch.randint(0, vocab, (n,), generator=g), "loss_mask": mask,
                     "advantages": mask * torch.randn(1, generator=g).sign()})
    return seqs


def _gap(a, b, mbs) -> dict[str, float]:
    diffs = torch.cat([(x["logprobs"] - y["logprobs"]).abs()[mb["loss_mask"].to(x["logprobs"].device) != 0]
                       for x, y, mb in zip(a, b, mbs)]).float()
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()), "tokens": diffs.numel()}


def main() -> None:
    from mcore_rl.bench.common import timed
    from mcore_rl.bench.profile_train import _device_busy_s
    from mcore_rl.bench.train import MODELS, _pg_loss
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches
    from mcore_rl.parallel import initialize

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    p.add_argument("--budget", type=int, default=16384, help="forward micro-batch token budget")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    hf = MODELS[args.model]
    initialize(ParallelConfig(), hf)
    seqs = _batch(hf["vocab_size"])
    make = lambda: make_micro_batches(seqs, args.budget)  # noqa: E731  (fresh ones: the engine moves them)
    n = sum(float(s["loss_mask"].sum()) for s in seqs)
    print("micro batches", [tuple(mb.input_ids.shape) for mb in make()], flush=True)
    results: dict = {"model": args.model, "budget": args.budget, "sequences": len(seqs)}
    for role, optim in (("reference", None), ("actor", OptimConfig(lr=1e-5, clip_grad=1.0))):
        engines = {}
        for mode in ("off", "on"):
            cfg = ModelConfig(path="unused", dtype="bf16", attention="sdpa", max_seq_len=4096, forward_cuda_graphs=mode)
            engines[mode] = TrainEngine(hf, cfg, ParallelConfig(), optim)
        engines["on"].model_chunks[0].load_state_dict(engines["off"].model_chunks[0].state_dict())
        engines["on"].reload_master_weights()
        eager, graphed = engines["off"], engines["on"]
        if optim is not None:  # both take the same step, so the graphs replay over weights that moved in place
            for eng in (eager, graphed):
                eng.train_step(make(), _pg_loss(n))
            eager.model_chunks[0].load_state_dict(graphed.model_chunks[0].state_dict())
        res: dict = {}
        eager.compute_logprobs(make())
        res["first_call_s"], _ = timed(lambda: graphed.compute_logprobs(make()))  # eager: shapes seen once
        res["capture_call_s"], _ = timed(lambda: graphed.compute_logprobs(make()))
        res["captures"] = graphed.graphed.num_captures
        mbs = make()
        a = eager.compute_logprobs(mbs)
        mbs2 = make()
        b = graphed.compute_logprobs(mbs2)
        res.update(_gap(a, b, mbs))
        for name, eng in (("eager", eager), ("graphed", graphed)):
            ts = sorted(timed(lambda: eng.compute_logprobs(make()))[0] for _ in range(7))
            res[f"{name}_s"] = ts[3]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            eager.compute_logprobs(make())
            torch.cuda.synchronize()
        res["eager_device_busy_s"] = _device_busy_s(prof)
        res["speedup"] = res["eager_s"] / res["graphed_s"]
        res["captures_after"] = graphed.graphed.num_captures
        res["cuda_reserved_mib"] = torch.cuda.memory_reserved() / 2**20  # the whole process's, graphs included
        results[role] = res
        print(role, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
        for eng in engines.values():
            if eng.graphed is not None:
                eng.graphed.release()
        engines.clear()
        eager = graphed = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
