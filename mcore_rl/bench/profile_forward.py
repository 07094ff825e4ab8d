"""Where the forward-only passes (reference / old log-probs) spend their time on a GPU: wall time against the
GPU's busy time, by micro-batch budget and ModelConfig.lm_head, next to the update of the same batch.

    python -m mcore_rl.bench.profile_forward --model qwen2.5-0.5b [--no-profile]

The batch is e2e's shape: 64 sequences of 128 prompt + 256 response tokens (24,576 tokens). Prints median /
min times of five calls of each variant (twice, interleaved) and, unless --no-profile, torch.profiler tables of
one call of the forward (both lm_head settings) and of the update with the GPU's busy time: a wall time well
above it means the pass waits on the host (kernel launches), which fewer, larger micro batches cut.
docs/perf_h200_ref_forward_profile.txt is its output on the H200.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from mcore_rl.bench.common import timed
    from mcore_rl.bench.profile_train import _device_busy_s, _table
    from mcore_rl.bench.train import MODELS, _pg_loss
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches, unpack
    from mcore_rl.parallel import initialize

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    p.add_argument("--budget", type=int, default=16384, help="the update's micro-batch token budget")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()

    hf = MODELS[args.model]
    initialize(ParallelConfig(), hf)
    cfg = dict(dtype="bf16", attention="sdpa", max_seq_len=4096)
    optim = OptimConfig(lr=1e-6, clip_grad=1.0)
    ref_all = TrainEngine(hf, ModelConfig(**cfg, lm_head="all"), ParallelConfig(), None)
    ref = TrainEngine(hf, ModelConfig(**cfg), ParallelConfig(), None)
    actor = TrainEngine(hf, ModelConfig(**cfg), ParallelConfig(), optim)
    actor_all = TrainEngine(hf, ModelConfig(**cfg, lm_head="all"), ParallelConfig(), optim)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(64):
        ids = torch.randint(0, hf["vocab_size"], (384,), generator=g)
        mask = torch.zeros(384)
        mask[128:] = 1
        seqs.append({"input_ids": ids, "loss_mask": mask, "advantages": mask * torch.randn(1, generator=g).sign()})
    mbs = make_micro_batches(seqs, args.budget)
    one = make_micro_batches(seqs, 2 * args.budget)  # the trainer's default forward budget
    n = sum(mb["loss_mask"].sum().item() for mb in mbs)
    print("micro batches", [tuple(mb.input_ids.shape) for mb in mbs], "forward budget x2:",
          [tuple(mb.input_ids.shape) for mb in one], flush=True)

    def e2e_ref(engine):  # the e2e step's path before trainer.rl_step.gather_tokens copied once
        return [t.cpu() for t in unpack([o["logprobs"].float() for o in engine.compute_logprobs(mbs)], mbs)]

    fns = {"ref_fwd_one_mb": lambda: ref.compute_logprobs(one), "ref_all_fwd": lambda: ref_all.compute_logprobs(mbs),
           "ref_fwd": lambda: ref.compute_logprobs(mbs), "ref_e2e_path": lambda: e2e_ref(ref),
           "ref_all_e2e_path": lambda: e2e_ref(ref_all), "train_step": lambda: actor.train_step(mbs, _pg_loss(n)),
           "train_step_all": lambda: actor_all.train_step(mbs, _pg_loss(n))}
    for f in fns.values():
        f(), f()
    for _ in range(2):
        for name, f in fns.items():
            ts = sorted(timed(f)[0] for _ in range(5))
            print(f"{name}: median {ts[2] * 1e3:.1f} ms  min {ts[0] * 1e3:.1f}", flush=True)
    for name in (() if args.no_profile else ("ref_all_fwd", "ref_fwd", "train_step")):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fns[name]()
            torch.cuda.synchronize()
        print(f"=== {name}: device busy {_device_busy_s(prof) * 1e3:.1f} ms", flush=True)
        print(_table(prof, 16), flush=True)


if __name__ == "__main__":
    main()
