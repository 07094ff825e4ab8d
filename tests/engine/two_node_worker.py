"""torchrun worker for a two-"node" launch: one process per node, DP=2 across the two nodes.

    python -m torch.distributed.run --nnodes 2 --node_rank R --nproc_per_node 1 \\
        --master_addr 127.0.0.1 --master_port P tests/engine/two_node_worker.py OUT MODELS      # R = 0 and 1

Each node trains one optimizer step on its half of the sequences. Checked (results in OUT/two_node/rank<r>.json):
the step's loss equals the full-batch loss that rank 0 computes alone with plain autograd-free torch
(full-vocabulary log_softmax over all sequences, same initial weights), and both replicas hold identical
weights after the step (gradient reduce-scatter and parameter all-gather crossed the node boundary).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    import torch.distributed as dist
    from megatron.core import parallel_state

    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, env_world, initialize

    out, models_dir = Path(sys.argv[1]) / "two_node", Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    path = C.make_models(models_dir)["qwen2"]
    hf = load_hf_config(path)
    parallel = ParallelConfig()
    layout = initialize(parallel, hf)
    rank = dist.get_rank()
    report = {"layout": {"world": layout.world_size, "dp": layout.dp, "rank": layout.rank,
                         "local_rank": env_world()[2]}}

    engine = TrainEngine(hf, C.model_cfg(path), parallel, OptimConfig(lr=1e-3, adam_eps=C.ADAM_EPS))
    seqs = C.sequences()

    # Full-batch loss computed alone on this rank, before the step (identical initial weights on both ranks:
    # DDP broadcasts them from DP rank 0).
    with torch.no_grad():
        everything = make_micro_batches(seqs, micro_batch_size=len(seqs), packed=False)[0]
        logits = engine.model_chunks[0](everything.input_ids, everything.position_ids, None).float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        lp = torch.nn.functional.pad(logp.gather(-1, everything.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
        ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
        mask, adv = everything["loss_mask"], everything["advantages"]
        report["local_full_batch_loss"] = (((-(adv * lp) - 0.01 * ent) * mask).sum() / mask.sum()).item()

    mine = C.dp_share(seqs, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    mbs = make_micro_batches(mine, max_tokens=32)
    before = torch.cat([p.detach().flatten().clone() for p in engine.model_chunks[0].parameters()])
    step = engine.train_step(mbs, C.policy_loss, normalizer=global_count(mbs), with_entropy=True)
    report["loss"], report["grad_norm"] = step.loss, step.grad_norm

    flat = torch.cat([p.detach().flatten() for p in engine.model_chunks[0].parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    report["replicas_unlike_rank0"] = {r: (g - gathered[0]).abs().max().item() for r, g in enumerate(gathered)
                                       if not torch.equal(g, gathered[0])}  # rank -> max |diff| of the weights
    report["moved"] = (flat - before).abs().max().item()

    C.write_json(out / f"rank{rank}.json", report)
    destroy()
