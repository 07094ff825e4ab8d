"""Per-sample sampling seeds: every sample's SGLang `sampling_seed` is a pure function of where it sits in the run.

    seed = sample_seed(cfg.rollout.random_seed, group_id, index)              # index: j-th sample of its group
    seed = sample_seed(random_seed, group_id, index, turn=2)                 # an agent trajectory's third turn
    seed = sample_seed(random_seed, group_id, index, stream="task:safety")    # one task of a multi-task run

group_id is unique per prompt within a run (step (s-1) * prompts_per_step + prompt index), so a resumed run
re-derives the same seeds for the same samples, and SGLang's seeded sampler (Gumbel-max over a hash of seed,
token position and vocabulary index) then draws the same tokens from the same logits, whichever engine process
or batch the request lands in. `stream` separates series of group ids numbered alike (the tasks of one run).

The hash is BLAKE2b of the key's canonical text, cut to 63 bits: SGLang keeps seeds in an int64 tensor, so
they must be non-negative and below 2**63. It does not depend on Python's hash randomisation or the platform.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63


def sample_seed(random_seed: int, group_id: int, index: int, turn: int = 0, stream: str = "") -> int:
    """The sampling seed of sample `index` of group `group_id` (its turn `turn`, for multi-turn trajectories),
    under the run's rollout.random_seed; in [0, 2**63)."""
    for name, value in (("group_id", group_id), ("index", index), ("turn", turn)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    key = f"mcore_rl/v1|{int(random_seed)}|{stream}|{int(group_id)}|{int(index)}|{int(turn)}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def group_seeds(random_seed: int, first_group_id: int, num_prompts: int, n: int, stream: str = "") -> list[int]:
    """Seeds of n samples of each of num_prompts prompts, in generate()'s order (prompt-major): sample j of
    prompt i is sample_seed(random_seed, first_group_id + i, j)."""
    return [sample_seed(random_seed, first_group_id + i, j, stream=stream)
            for i in range(num_prompts) for j in range(n)]
