"""The one exception type of the rollout package."""


class RolloutEngineError(RuntimeError):
    """The SGLang engine could not start, died, timed out, or refused a request. The message says which,
    what was being done, and what to change; the engine is unusable after a death (`RolloutEngine.alive`)."""
