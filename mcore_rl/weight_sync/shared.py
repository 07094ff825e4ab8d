"""Shared-parameter sync (weight_sync.layout=shared): the engine holds handles to the actor's own parameters (CUDA
IPC, or shared memory on CPU) and, at each sync, copies them into its own layout as bridge.engine_layout.shared_plan
says (loaders.apply_shared). No export, no bucket, no collective: rank 0 alone, holding whole parameters (TP=1,
PP=1), does it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class SharedParams:
    """Rank 0's side of the shared layout: the actor's parameters are handed to the engine once, as handles; each
    push has the engine copy them into its own parameters. They are handed over again when a parameter's storage
    moved (its .data reassigned, e.g. by a checkpoint load), which the trainer's in-place optimizer steps never do.
    receiver: the RolloutEngine's WeightReceiver."""

    def __init__(self, actor_chunks, hf: dict, receiver):
        import torch

        from mcore_rl.bridge.engine_layout import shared_plan

        self.params, self.ops = shared_plan(actor_chunks, hf)
        self.receiver = receiver
        self._where: list[int] | None = None
        self.nbytes = 0
        for _, shape, k, rows in self.ops:
            row = self.params[k].element_size() * (torch.Size(shape[1:]).numel())
            self.nbytes += row * (rows if isinstance(rows, int) else len(rows))
        self._share()  # now: names and shapes are checked against the engine before the first sync

    def _share(self) -> None:
        self.receiver.share_parameters(self.params, self.ops)
        self._where = self._storages()  # after sharing: on CPU the storages move into shared memory

    def _storages(self) -> list[int]:
        return [p.data_ptr() for p in self.params]

    def push(self) -> int:
        """Inside an open sync: the engine takes the current weights. Returns the bytes it copied."""
        import torch

        device = self.params[0].device
        if device.type == "cuda":  # the engine reads them from another process: the optimizer must be done
            torch.cuda.current_stream(device).synchronize()
        if self._where != self._storages():
            self._share()
        self.receiver.update_from_shared()
        return self.nbytes


class SharedSender:
    """The shared layout as a transport: shared is rank 0's SharedParams (None on the other ranks, which take no
    part)."""

    def __init__(self, shared: SharedParams | None):
        self.shared = shared

    def push(self) -> tuple[int, int]:
        """(version, bytes copied) of one complete sync on rank 0; (0, 0) elsewhere, at once."""
        if self.shared is None:
            return 0, 0
        receiver = self.shared.receiver
        with receiver.weight_update():  # abandoned (no version bump) if the push fails
            nbytes = self.shared.push()
        return receiver.version, nbytes

    def close(self) -> None:
        """Before the engine shuts down: the engine drops its handles to the actor's parameters. Best effort: an
        engine that is gone already holds nothing, and shutting down goes on either way."""
        if self.shared is None:
            return
        receiver = self.shared.receiver
        try:
            if receiver.alive:
                receiver.unshare_parameters()
        except Exception as e:  # noqa: BLE001 - shutting down: say why, do not stop the shutdown
            logger.warning("the engine did not drop the shared parameters before its shutdown (%s: %s)",
                           type(e).__name__, e)
