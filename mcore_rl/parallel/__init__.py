"""Process groups and devices: torch.distributed + Megatron parallel state (runtime.py), CPU support."""

from mcore_rl.parallel.runtime import Layout, barrier, destroy, env_world, initialize, rank, validate

__all__ = ["Layout", "barrier", "destroy", "env_world", "initialize", "rank", "validate"]
