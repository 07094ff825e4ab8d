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
    routed_experts: Any = None
    """Mixture-of-experts rollouts with rollout.return_routed_experts: a torch integer tensor [P + R - 1,
    num_layers, topk], the experts the engine routed token j of prompt + response to in each layer, for every
    token it ran forward (all but the last); None otherwise."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class RolloutBatch:
    samples: list[Sample]
    weight_version: int = 0
    """The engine's completed weight syncs when it generated these samples."""
    policy_version: int = 0
    """The trainer's numbering of those weights (RolloutEngine.policy_version)."""

    def __len__(self) -> int:
        return len(self.samples)
