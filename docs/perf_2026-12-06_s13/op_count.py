"""Aten operators one update dispatches (the host's work per kernel on a GPU), counted on CPU with a
TorchDispatchMode (docs/performance.md, "Thirteenth session"). From the repo root:

    python docs/perf_2026-12-06_s13/op_count.py moe    # ours against the raw Megatron update, qwen3-moe-2b counts
    python docs/perf_2026-12-06_s13/op_count.py loss   # operators per added micro batch, the e2e loss
"""
import collections
import dataclasses
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.parallel import initialize

VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
         "as_strided", "alias", "detach", "reshape", "split", "split_with_sizes", "unbind", "chunk"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.c = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def counted(fn) -> collections.Counter:
    fn()  # once before, so that lazy set-up is not counted
    with Count() as c:
        fn()
    return c.c


def summary(c) -> str:
    non_view = sum(v for op, v in c.items() if op.split(".")[-1] not in VIEWS)
    return f"operators {sum(c.values())}, without views {non_view}, _local_scalar_dense {c['aten._local_scalar_dense']}"


def main(what: str) -> None:
    import mcore_rl.bench.train as T
    from mcore_rl.bench.e2e import _pg_kl_loss
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches

    initialize(ParallelConfig())
    seq = 64
    model_cfg = ModelConfig(dtype="fp32", max_seq_len=seq)
    optim = OptimConfig(lr=1e-6, clip_grad=1.0)
    if what == "moe":  # qwen3-moe-2b's layer and expert counts, tiny widths
        hf = dict(T.TINY_MOE, num_hidden_layers=8, num_experts=32, num_experts_per_tok=8)
        seqs = T._seqs([seq] * 4, hf["vocab_size"], 0)
        mbs = make_micro_batches(seqs, 4 * seq)
        n = sum(mb["loss_mask"].sum().item() for mb in mbs)
        ours = TrainEngine(hf, model_cfg, ParallelConfig(), optim)
        raw = T.RawMegatron(hf, dataclasses.replace(model_cfg, lm_head="all"), ParallelConfig())
        ids = torch.stack([s["input_ids"] for s in seqs])
        print("ours:", summary(counted(lambda: ours.train_step(mbs, T._pg_loss(n)))))
        print("raw: ", summary(counted(lambda: raw.step(ids))))
    elif what == "loss":  # dense, one layer: one against two micro batches of 4 x 64 tokens
        hf = dict(T.TINY, num_hidden_layers=1)
        ours = TrainEngine(hf, model_cfg, ParallelConfig(), optim)
        for with_ref in (True, False):
            totals = []
            for num_mb in (1, 2):
                seqs = T._seqs([seq] * 4 * num_mb, hf["vocab_size"], 0)
                for s in seqs:
                    s["ref_logprobs"], s["old_logprobs"] = -torch.rand(seq), -torch.rand(seq)
                mbs = make_micro_batches(seqs, 4 * seq)
                n = sum(mb["loss_mask"].sum().item() for mb in mbs)
                totals.append(sum(counted(lambda: ours.train_step(mbs, _pg_kl_loss(n, with_ref, True))).values()))
            print(f"KL term {with_ref}: {totals[1] - totals[0]} operators per added micro batch")
    else:
        raise SystemExit(f"usage: {sys.argv[0]} moe|loss")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "moe")
