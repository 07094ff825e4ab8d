"""SGLang rollouts: engine lifecycle and generation from token ids; weights arrive through `RolloutEngine.weights`
(mcore_rl.weight_sync). Imports nothing from Megatron; SGLang itself is imported only when an engine starts. See
docs/rollout.md."""

from mcore_rl.rollout.engine import RolloutEngine, SamplingParams
from mcore_rl.rollout.errors import RolloutEngineError

__all__ = ["RolloutEngine", "RolloutEngineError", "SamplingParams"]
