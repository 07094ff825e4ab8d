"""Partial rollouts: samples that a weight sync interrupted, continued with the new weights from their prefix.

    interrupt = Interrupt()
    batch = engine.generate(prompts, n, interrupt=interrupt, ...)   # another thread: interrupt.fire() at a sync
    stamp(batch.samples, version)                                   # each token: the version that generated it
    ... the weight sync ...
    continue_samples(engine, batch.samples, sampling, new_version)  # the unfinished ones, in place

An interrupted sample comes back with the tokens it had (finish_reason "abort"); continuing it sends prompt +
those tokens as the new prompt, so the engine recomputes their keys and values with the new weights and samples
the rest from there. Its log-probs are then those of the weights that generated each token, which is what the
off-policy corrections need (the behaviour policy, token by token), and `Sample.versions` says which weights
those were. Knows nothing of Megatron or of the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from mcore_rl.rollout.backend import Interrupt
from mcore_rl.rollout.seeds import sample_seed
from mcore_rl.types import Sample


def stamp(samples: Sequence[Sample], version: int) -> None:
    """Record that `version` generated every response token of these (fresh) samples."""
    for s in samples:
        s.versions = [version] * len(s.response_ids)


def unfinished(samples: Sequence[Sample]) -> list[Sample]:
    return [s for s in samples if s.finish_reason == "abort"]


def num_segments(sample: Sample) -> int:
    """How many runs of one version its tokens form (0 for a sample with no tokens yet)."""
    v = sample.versions or []
    return (1 + sum(a != b for a, b in zip(v, v[1:]))) if v else 0


def continue_samples(engine, samples: Sequence[Sample], sampling, version: int, *,
                     interrupt: Interrupt | None = None, seed_stream: str = "") -> int:
    """Generate the rest of every unfinished sample of `samples` (finish_reason "abort") with the engine's current
    weights, policy version `version`, appending tokens, log-probs and versions in place; returns how many were
    continued. A sample's budget is what `sampling.max_new_tokens` leaves it. All go in one generate call with
    the largest budget, each cut at its own: the first L tokens of an autoregressive sample are distributed as a
    sample of at most L tokens, so the cut changes nothing but the compute spent past it. A sample interrupted
    again (by `interrupt`) is still unfinished afterwards.

    Each continuation is sampled with its sample's own seed (mcore_rl.rollout.seeds: rollout.random_seed, group,
    index in the group, seed_stream), and SGLang's seeded sampler draws its noise per absolute token position, so
    a sample continued with unchanged weights is the sample it would have been uninterrupted (with
    rollout.deterministic; the random draws of its first segment are not replayed, their positions are past).
    `samples` is prompt-major with the samples of a group together, as generate returns them."""
    todo, budgets = [], []
    for s in unfinished(samples):
        budget = sampling.max_new_tokens - len(s.response_ids)
        if budget <= 0:  # cut by the interrupt exactly at its budget
            s.finish_reason = "length"
            continue
        todo.append(s)
        budgets.append(budget)
    if not todo:
        return 0
    index_in_group, seen = {}, {}
    for s in samples:
        index_in_group[id(s)] = seen.get(s.group_id, 0)
        seen[s.group_id] = index_in_group[id(s)] + 1
    seeds = [sample_seed(engine.cfg.random_seed, s.group_id, index_in_group[id(s)], stream=seed_stream)
             for s in todo]
    batch = engine.generate([s.prompt_ids + s.response_ids for s in todo], n=1,
                            sampling=dataclasses.replace(sampling, max_new_tokens=max(budgets)),
                            sampling_seeds=seeds, interrupt=interrupt)
    for s, c, budget in zip(todo, batch.samples, budgets):
        k = min(len(c.response_ids), budget)
        s.response_ids = s.response_ids + c.response_ids[:k]
        s.rollout_logprobs = s.rollout_logprobs + c.rollout_logprobs[:k]
        s.versions = (s.versions or []) + [version] * k
        s.finish_reason = c.finish_reason if len(c.response_ids) <= budget else "length"
    return len(todo)
