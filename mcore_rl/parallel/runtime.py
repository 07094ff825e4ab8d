"""The one place that starts torch.distributed and Megatron's parallel state.

Launch with torchrun (single node or many; torchrun's rendezvous provides RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT). NCCL is used when CUDA is available, gloo otherwise; without CUDA the
Megatron-on-CPU layer (megatron_on_cpu.py) is applied first.

    from mcore_rl.parallel import initialize
    layout = initialize(ParallelConfig(tp=2, pp=2), hf_config)   # validates, then initialises
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_rl.config.parallel import ParallelConfig


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    device: torch.device
    backend: str
    ep: int = 1
    etp: int = 1


def validate(parallel: ParallelConfig, world_size: int, hf_config: dict | None = None) -> int:
    """Check the layout against the world and the model before anything starts; return the DP size."""
    if world_size % (parallel.tp * parallel.pp):
        raise ValueError(
            f"world size ({world_size}) is not divisible by parallel.tp ({parallel.tp}) x parallel.pp "
            f"({parallel.pp}) = {parallel.tp * parallel.pp}; change the number of processes or the layout"
        )
    etp = parallel.etp or parallel.tp
    if parallel.ep > 1 or etp != parallel.tp:
        # Megatron lays the expert layers out as etp x ep x expert-dp x pp over the same ranks as the dense ones.
        if world_size % (etp * parallel.ep * parallel.pp):
            raise ValueError(
                f"world size ({world_size}) is not divisible by parallel.etp ({etp}) x parallel.ep ({parallel.ep}) "
                f"x parallel.pp ({parallel.pp}) = {etp * parallel.ep * parallel.pp}: the expert layers need whole "
                "expert-parallel groups in every pipeline stage; change parallel.ep, parallel.etp or the number of "
                "processes"
            )
    if hf_config is not None:
        from mcore_rl.models.builder import validate_layout

        validate_layout(hf_config, parallel)
    return world_size // (parallel.tp * parallel.pp)


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; a plain `python` run is a world of one."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def initialize(parallel: ParallelConfig, hf_config: dict | None = None) -> Layout:
    rank, world, local_rank = env_world()
    dp = validate(parallel, world, hf_config)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        from mcore_rl.parallel import megatron_on_cpu

        megatron_on_cpu.apply()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a plain `python` run: a free port, not one another run may hold
            from mcore_rl.net import free_port

            os.environ["MASTER_PORT"] = str(free_port()) if world == 1 else "29500"
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world,
            timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes),
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp or parallel.tp,
            distributed_timeout_minutes=parallel.distributed_timeout_minutes,
        )
    torch.manual_seed(parallel.seed)
    model_parallel_cuda_manual_seed(parallel.seed)
    return Layout(world, rank, local_rank, parallel.tp, parallel.pp, dp, parallel.vpp, device, backend,
                  ep=parallel.ep, etp=parallel.etp or parallel.tp)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    """Global rank, 0 without torch.distributed (single-process tools and tests)."""
    return dist.get_rank() if dist.is_initialized() else 0


def from_rank0(value):
    """Rank 0's `value` on every rank (pickled; `value` on the other ranks is ignored). An exception there is raised
    on every rank, so no rank is left waiting in the next collective. `value` itself without torch.distributed."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (one tiny all-reduce); `flag` without torch.distributed."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    """dist.barrier() when torch.distributed is up; nothing otherwise."""
    if dist.is_initialized():
        dist.barrier()
