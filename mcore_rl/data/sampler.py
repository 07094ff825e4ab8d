"""A resumable, seeded, endless batch sampler over an in-memory dataset.

Epoch e visits every item once, in the order `numpy.random.default_rng([seed, e]).permutation(n)` (or 0..n-1
without shuffling). Batches are consecutive runs of that stream and run on across epoch ends, so no item is ever
dropped and every item is seen equally often; a batch at an epoch end mixes the last items of epoch e with the
first of epoch e+1 (and, when batch_size > n, can hold an item twice).

The position is two integers (epoch, offset into that epoch's order), so `state_dict()` / `load_state_dict()`
resume exactly: a resumed run draws the same batches as an uninterrupted one. No worker processes and no
torch.distributed: every data-parallel rank builds the same sampler with the same seed, draws the same global
batch and takes its slice with `shard_batch`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


class EpochSampler(Generic[T]):
    def __init__(self, dataset: Sequence[T], batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; there is nothing to sample")
        if batch_size <= 0:
            raise ValueError(f"batch_size ({batch_size}) must be positive")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # epoch of the next item to be drawn
        self.offset = 0  # position of the next item within that epoch's order
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def order(self, epoch: int) -> np.ndarray:
        """Item indices in the order epoch `epoch` visits them."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch, advancing the position."""
        n = len(self.dataset)
        indices: list[int] = []
        while len(indices) < self.batch_size:
            take = min(self.batch_size - len(indices), n - self.offset)
            indices.extend(int(i) for i in self.order(self.epoch)[self.offset : self.offset + take])
            self.offset += take
            if self.offset == n:
                self.epoch += 1
                self.offset = 0
        return indices

    def next_batch(self) -> list[T]:
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[T]]:
        while True:
            yield self.next_batch()

    @property
    def num_consumed(self) -> int:
        """Items drawn so far, over all epochs."""
        return self.epoch * len(self.dataset) + self.offset

    def state_dict(self) -> dict[str, Any]:
        """The position plus what must match on resume; plain ints and bools, JSON-safe."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Refuses when the order would differ from the run that saved it."""
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_items", len(self.dataset))):
            if state[key] != mine:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has {key}={mine!r}; "
                    "resuming would not replay the same data order (same files, filters and seed are needed)"
                )
        if not 0 <= state["offset"] < len(self.dataset) or state["epoch"] < 0:
            raise ValueError(
                f"sampler state has an impossible position: epoch {state['epoch']}, offset {state['offset']}"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def shard_batch(batch: Sequence[T], rank: int, world_size: int) -> list[T]:
    """The contiguous slice of a global batch that data-parallel rank `rank` of `world_size` handles."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
    if len(batch) % world_size:
        raise ValueError(
            f"global batch of {len(batch)} does not split evenly over {world_size} data-parallel ranks; "
            "make the number of prompts per step a multiple of the data-parallel size"
        )
    per_rank = len(batch) // world_size
    return list(batch[rank * per_rank : (rank + 1) * per_rank])
