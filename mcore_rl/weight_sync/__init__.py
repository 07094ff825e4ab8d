"""Weight sync from the Megatron actor to the SGLang rollout engine, both sides (docs/rollout.md).

plan.py (which layout: pure) -> sync.py (WeightSync, the loop's handle: plans once, then pushes through one
transport) -> shared.py | tensor.py | distributed.py | disk.py (the trainer-side senders) -> receiver.py (the
engine's side, owned by RolloutEngine as `engine.weights`) -> loaders.py (our loaders inside SGLang's scheduler).
Megatron, torch.distributed and SGLang are imported only inside the functions that need them: the rollout package
imports receiver.py, and SGLang's scheduler imports loaders.py.
"""

from mcore_rl.weight_sync.sync import WeightSync

__all__ = ["WeightSync"]
