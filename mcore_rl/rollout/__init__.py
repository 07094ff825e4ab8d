"""SGLang rollouts: engine lifecycle, generation from token ids, and weight receiving. Imports nothing from
Megatron; SGLang itself is imported only when an engine starts. See docs/rollout.md."""

from mcore_rl.rollout.engine import PendingCall, RolloutEngine, SamplingParams
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.rollout.weight_sync import DistributedWeightSender

__all__ = ["DistributedWeightSender", "PendingCall", "RolloutEngine", "RolloutEngineError", "SamplingParams"]
