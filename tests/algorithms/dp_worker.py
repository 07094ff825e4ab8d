"""One data-parallel rank for test_dp_gloo.py: `python dp_worker.py RANK WORLD STORE_FILE OUT_JSON`.

Every rank builds the same seeded batch and a parameter `theta` shared by all tokens, computes the full-batch
loss and gradient as the reference, then its own shard in micro batches under the Megatron convention
(contribution * num_microbatches * dp_size, divided by num_microbatches by the schedule, gradients averaged over
DP by an all-reduce), and writes the largest differences to OUT_JSON.
"""

import json
import sys

import torch
import torch.distributed as dist

from mcore_rl.algorithms import LOSS_AGG_MODES, compute_global_normalizers, compute_policy_loss

MAX_LEN = 12


def batch():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 0, 1, 7, 3, 9, 2]
    mask = torch.zeros(8, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[1, 3] = 0
    old = -torch.rand(8, 9, generator=g, dtype=torch.float64) * 3
    base = old + 0.3 * torch.randn(8, 9, generator=g, dtype=torch.float64)
    feat = torch.randn(8, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(8, 9, generator=g, dtype=torch.float64)
    return mask, old, base, feat, adv


def loss_fn(theta, rows, mask, old, base, feat, adv, **agg):
    logprobs = base[rows] + theta * feat[rows]  # theta: [9], shared by every row like a model weight
    return compute_policy_loss("ppo", logprobs=logprobs, old_logprobs=old[rows], advantages=adv[rows],
                               response_mask=mask[rows], clip_ratio_high=0.28, clip_ratio_c=3.0, **agg)[0]


def main():
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mask, old, base, feat, adv = batch()
    shard = [[[0, 1], [2, 3]], [[4, 5, 6], [7]]][rank]
    result = {}
    for mode in LOSS_AGG_MODES:
        theta_full = torch.full((9,), 0.1, dtype=torch.float64, requires_grad=True)
        full = loss_fn(theta_full, list(range(8)), mask, old, base, feat, adv, loss_agg_mode=mode,
                       max_response_length=MAX_LEN)
        full.backward()

        theta = torch.full((9,), 0.1, dtype=torch.float64, requires_grad=True)
        norm = compute_global_normalizers([mask[rows] for rows in shard], process_group=dist.group.WORLD)
        agg = dict(loss_agg_mode=mode, max_response_length=MAX_LEN, global_num_tokens=norm.num_tokens,
                   global_num_seqs=norm.num_seqs)
        num_micro = len(shard)
        local = sum(loss_fn(theta, rows, mask, old, base, feat, adv, **agg) * num_micro * world / num_micro
                    for rows in shard)
        local.backward()
        grad = theta.grad.clone()
        dist.all_reduce(grad)
        grad /= world  # DDP: gradient mean over the DP group
        logged = local.detach().clone()
        dist.all_reduce(logged)
        logged /= world
        result[mode] = {
            "loss_diff": abs(logged.item() - full.item()),
            "grad_diff": (grad - theta_full.grad).abs().max().item(),
            "grad_norm": theta_full.grad.norm().item(),
            "num_tokens": norm.num_tokens.item(),
            "num_seqs": norm.num_seqs.item(),
        }
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
