"""What one training step carries between its parts: typed, built in one place (trainer/batch.py), returned by
the functions that make them (never filled in through a dict handed down).

    Rollout       the step's samples from the engine, scored, with the weight version that produced them
    Sequences     one data-parallel rank's token-space sequences, one tensor per sequence per field: what the
                  engine packs into micro batches (`for_engine()`)
    RLBatch       an rl task's batch after rewards, forward passes and advantages (rl_step.prepare)
    PreferenceBatch  a dpo task's pairs with the reference's log-probs (tasks.PreferenceTask)
    Skip          a task has nothing to train on this step, and why

Token space: entry j of a sequence's tensor belongs to token j of prompt + response (the prompt's entries are 0
and masked out by loss_mask). Response space ([B, R] tensors over the whole step's batch) is where the
algorithms work; trainer/batch.py converts between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from torch import Tensor

from mcore_rl.types import Sample


@dataclass
class Rollout:
    samples: list[Sample]
    """Every sample of the step (all ranks hold all of them), rewards filled in."""
    weight_version: int
    """Which policy generated them: the trainer step after whose update the engine got its weights (0 = the
    initial checkpoint; RolloutEngine.policy_version). Equal in a resumed and an uninterrupted run."""


@dataclass
class Sequences:
    """This rank's sequences. The optional fields are per-token tensors (float32 but for routed_experts), present
    when a loss or the model reads them."""

    input_ids: list[Tensor]
    """int64, prompt + response."""
    loss_mask: list[Tensor]
    """float32, 1 on the tokens a loss reads (the response)."""
    advantages: list[Tensor] | None = None
    rollout_logprobs: list[Tensor] | None = None
    """The engine's log-probs of the sampled tokens (the behaviour policy)."""
    old_logprobs: list[Tensor] | None = None
    """log pi_old: the actor's forward pass before the update (actor.old_logprobs=recompute)."""
    ref_logprobs: list[Tensor] | None = None
    old_values: list[Tensor] | None = None
    """The critic's values before its update."""
    returns: list[Tensor] | None = None
    """The critic's regression targets."""
    routed_experts: list[Tensor] | None = None
    """Routing replay (model.moe_routing_replay): per token, the experts the rollout engine routed it to in each
    layer, integer [P + R, num_layers, topk] (the last token, which the engine never ran forward, gets experts
    0..topk-1: its output is never read). The engine's field "routed_experts" (engine/forward_backward.ROUTES)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def with_fields(self, **values: list[Tensor]) -> "Sequences":
        """A copy with these fields set."""
        return replace(self, **values)

    def for_engine(self) -> list[dict[str, Tensor]]:
        """The engine's sequence dicts (mcore_rl.engine.batching.make_micro_batches), the present fields only."""
        present = [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]
        return [{name: values[i] for name, values in present} for i in range(len(self))]


@dataclass
class RLBatch:
    rollout: Rollout
    """The samples after filtering (dynamic sampling), all ranks'."""
    actor: Sequences
    """This rank's share, with advantages, rollout log-probs and (when present) old and reference log-probs."""
    critic: Sequences | None
    """This rank's share with old values and returns, when there is a critic."""
    kl: float | None
    """Token mean of k1 KL(actor || reference) on the samples (0.0 without a reference); None when the update
    measures it (old_source current: metric `kl` of the update)."""
    num_response_tokens: int
    old_source: str
    """What the update takes as log pi_old: recompute | current | rollout (rl_step.old_logprob_source)."""
    ref_in_update: bool = False
    """The reference log-probs are computed in the update, on its micro batches (ref.compute_at, rl_step.py), so
    `actor` holds none."""


@dataclass
class PreferenceBatch:
    actor: Sequences
    """This rank's pairs as consecutive (chosen, rejected) sequences, with the reference's log-probs."""
    num_response_tokens: int
    """Response tokens of the whole batch (all ranks)."""


@dataclass
class Skip:
    """A task has nothing to train on this step."""

    reason: str
