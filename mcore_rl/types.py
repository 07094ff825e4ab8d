"""The contract between rollout and training: plain dataclasses of Python lists and tensors.

A `Sample` is one prompt plus one generated response, as the rollout engine returns it and the reward
functions score it. A `RolloutBatch` collects samples of one step; the trainer turns it into padded or packed
tensors for Megatron. Nothing here imports Megatron or SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt and one sampled response, token ids only (the engine runs with skip_tokenizer_init)."""

    prompt_ids: list[int]
    response_ids: list[int]
    # log-prob of each response token under the rollout engine's policy; len == len(response_ids)
    rollout_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    group_id: int = 0  # samples generated from the same prompt share a group id (GRPO / RLOO)
    prompt_text: str = ""
    response_text: str = ""
    # task-specific fields carried from the dataset row (answer, target numbers, ...)
    meta: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    response_mask: list[int] | None = None
    """Which response tokens the policy generated (1: trained) and which a tool or the chat template put there
    (0: no loss, no KL, no entropy); len == len(response_ids). None = every response token is the model's (a
    single-turn sample), so single-turn batches are exactly what they were."""
    agent: AgentTrace | None = None
    """Multi-turn tool-using rollouts (mcore_rl.agent.rollout): turns, tool calls and why the trajectory ended."""
    routed_experts: Any = None
    """Mixture-of-experts rollouts with rollout.return_routed_experts: a torch integer tensor [P + R - 1,
    num_layers, topk], the experts the engine routed token j of prompt + response to in each layer, for every
    token it ran forward (all but the last); None otherwise."""
    versions: list[int] | None = None
    """Asynchronous rollouts (trainer.rollout_mode != sync): the policy version (RolloutEngine.policy_version, the
    trainer step whose weights) that generated each response token; len == len(response_ids). More than one
    value when a weight sync came while the sample was generating and it was continued with the new weights
    (trainer.partial_rollouts=continue). None in synchronous runs."""

    @property
    def policy_version(self) -> int | None:
        """The oldest weights that generated any of this sample's tokens (what its staleness is counted from)."""
        return min(self.versions) if self.versions else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the policy generated (all of them, for a single-turn sample)."""
        return len(self.response_ids) if self.response_mask is None else sum(self.response_mask)


@dataclass
class ToolCallRecord:
    """One tool call of a trajectory, as the agent metrics count it."""

    name: str | None
    """The tool the model named (None when the call did not say)."""
    error: str | None = None
    """None (ran), "malformed" (the call did not parse; no tool ran), or the tool's own error kind: "timeout",
    "exception", "bad_arguments", ..."""
    seconds: float = 0.0
    turn: int = 0


@dataclass
class AgentTrace:
    """What happened in one multi-turn trajectory (Sample.agent)."""

    num_turns: int = 0
    """Model turns (engine calls) of the trajectory."""
    end_reason: str = "answer"
    """answer (a turn without a tool call that ended by EOS / a stop token), max_turns (the last allowed turn
    called a tool), token_budget (agent.max_response_tokens reached), turn_length (a turn hit
    rollout.max_new_tokens without a call), abort (the engine aborted a turn)."""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """Per turn, [start, end) of the model's tokens in response_ids."""
    turn_rewards: list[float] = field(default_factory=list)
    """Per-turn rewards of agent.turn_reward (empty without it); their sum is added to the sample's reward."""
    turn_inputs: list[list[int]] | None = None
    """Debug (AgentRollout(record_inputs=True)): the exact token ids sent to the engine each turn."""


@dataclass
class RolloutBatch:
    samples: list[Sample]
    weight_version: int = 0
    """The engine's completed weight syncs when it generated these samples."""
    policy_version: int = 0
    """The trainer's numbering of those weights (RolloutEngine.policy_version)."""

    def __len__(self) -> int:
        return len(self.samples)
