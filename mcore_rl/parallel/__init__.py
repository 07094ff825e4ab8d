"""Process groups and devices: torch.distributed + Megatron parallel state (runtime.py), CPU support."""

from mcore_rl.parallel.runtime import Layout, barrier, destroy, env_world, from_rank0, initialize, rank, validate

__all__ = ["Layout", "barrier", "destroy", "env_world", "from_rank0", "initialize", "rank", "validate"]
