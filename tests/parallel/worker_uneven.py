"""torchrun worker of test_megatron_on_cpu_moe.py: Megatron's uneven first-dimension all-gather and reduce-scatter
(the MoE alltoall dispatcher over the expert tensor-parallel group) on gloo, through mcore_rl's CPU stand-ins.

    python -m torch.distributed.run --nproc_per_node 2 tests/parallel/worker_uneven.py OUT.json
"""


def main():
    import json
    import sys

    import torch
    import torch.distributed as dist

    from mcore_rl.parallel import megatron_on_cpu

    megatron_on_cpu.apply()
    from megatron.core.tensor_parallel import mappings

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    sizes = [3, 5]  # rows held by rank 0 and rank 1
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    expected = torch.cat([torch.arange(n * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r
                          for r, n in enumerate(sizes)])
    full = torch.full((sum(sizes), 2), float(rank + 1))  # each rank's partial sums over all rows
    reduced = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=sizes)
    result = {"gather_ok": torch.equal(gathered, expected),
              "reduce_scatter_ok": torch.equal(reduced, torch.full((sizes[rank], 2), 3.0))}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
