"""Process groups and devices: torch.distributed + Megatron parallel state (runtime.py), CPU support."""

from mcore_rl.parallel.runtime import Layout, destroy, env_world, initialize, validate

__all__ = ["Layout", "destroy", "env_world", "initialize", "validate"]
