"""Broadcast sync (weight_sync.transport=distributed; disaggregated training and rollout): the trainer rank that
holds the full HF tensors and the engine's ranks form one process group; each bucket is broadcast from the trainer
(gloo on CPU, NCCL on GPU) while the engine receives it. The engine side blocks until the trainer side acts and
vice versa, so both are driven from here: the engine call is started in the background, the trainer's collective
runs, then both are awaited, with engine death and timeouts turned into RolloutEngineError. No Megatron here.

    with DistributedWeightSender(engine, master_address=my_ip) as sender:   # connect() ... close()
        sender.sync(buckets)        # begin, broadcast every bucket, end: one flush, version + 1
"""

from __future__ import annotations

import datetime
import time
from typing import Iterable

from mcore_rl.net import free_port
from mcore_rl.rollout import sgl_kernel_stand_in
from mcore_rl.rollout.backend import POLL_S
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.weight_sync.receiver import NamedTensors, PendingCall
from mcore_rl.weight_sync.tensor import push_buckets


class DistributedWeightSender:
    """Trainer side of a broadcast weight sync to one RolloutEngine (rank 0 of a group with the engine's ranks).

    master_address must be an address of this host that the engine's processes can reach (this rank hosts the
    group's rendezvous store); master_port None picks a free port. backend None: NCCL when CUDA is available,
    else gloo. Buckets are broadcast from the device they are on (NCCL: move them to this rank's GPU first)."""

    def __init__(self, engine, master_address: str = "127.0.0.1", master_port: int | None = None,
                 backend: str | None = None, group_name: str = "mcore_rl_weight_sync",
                 timeout_s: float | None = None):
        """engine: the RolloutEngine."""
        import torch

        self.engine = engine
        self.weights = engine.weights
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group_name = group_name
        self.timeout_s = timeout_s or engine.cfg.request_timeout_s
        self._group = None
        self._broken: str | None = None

    # -- group ------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Form the group: the engine's ranks join in the background while this rank creates rank 0."""
        if self._group is not None:
            return
        sgl_kernel_stand_in.install()
        from sglang.srt.utils import init_custom_process_group

        port = self.master_port or free_port(self.master_address)
        world_size = 1 + self.engine.num_ranks
        pending = self.weights.init_weights_update_group(self.master_address, port, 1, world_size, self.group_name,
                                                         self.backend)
        from mcore_rl.rollout.launch_env import without_torchrun_env

        try:
            with without_torchrun_env():  # else, under torchrun, rank 0 would not host the group's store
                self._group = init_custom_process_group(
                    backend=self.backend, init_method=f"tcp://{self.master_address}:{port}", world_size=world_size,
                    rank=0, group_name=self.group_name, timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise RolloutEngineError(
                f"could not form the weight-update group at {self.master_address}:{port} ({self.backend}): {e}. "
                "master_address must be an address of this host that the engine can reach.") from e
        pending.wait()
        self._broken = None

    def close(self) -> None:
        """Leave the group on both sides (the engine side only while it is alive)."""
        group, self._group = self._group, None
        if group is None:
            return
        import torch.distributed as dist

        try:
            if self.engine.alive:
                self.weights.destroy_weights_update_group(self.group_name)
        finally:
            dist.destroy_process_group(group)

    def __enter__(self) -> DistributedWeightSender:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sending ----------------------------------------------------------------------------------------------
    def sync(self, buckets: Iterable[NamedTensors]) -> int:
        """One complete sync: open it, broadcast every bucket, close it (flush, version + 1). Returns the new
        version. `buckets` may be a generator, so the bridge can build each bucket just in time."""
        with self.weights.weight_update():
            for bucket in buckets:
                self.send_bucket(bucket)
        return self.weights.version

    def send_bucket(self, named_tensors: NamedTensors) -> None:
        """Broadcast one bucket inside an open sync (engine.weights.weight_update() or begin_update())."""
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("send_bucket() before connect(): use `with DistributedWeightSender(...) as sender:`")
        if self._broken is not None:
            raise RolloutEngineError(f"the weight-update group is unusable after an earlier failure "
                                     f"({self._broken}); close() and connect() again")
        named_tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
        names = [name for name, _ in named_tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]
        shapes = [list(t.shape) for _, t in named_tensors]
        pending = self.weights.update_weights_from_distributed(names, dtypes, shapes, self.group_name)
        try:
            works = [dist.broadcast(t, group=self._group, group_src=0, async_op=True) for _, t in named_tensors]
            self._wait_broadcasts(works, pending)
            pending.wait()
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise

    def _wait_broadcasts(self, works, pending: PendingCall) -> None:
        """Wait for our side of the broadcasts while watching the engine's side: if the engine fails or dies
        first, our sends would wait for receivers that never come."""
        deadline = time.monotonic() + self.timeout_s
        while not all(w.is_completed() for w in works):
            if pending.done():
                pending.wait()  # raises if the engine side failed
                break
            if not self.engine.alive:
                raise RolloutEngineError(f"SGLang {self.engine.backend.name} died during a broadcast weight sync: "
                                         f"{self.engine.backend.dead_reason()}")
            if time.monotonic() > deadline:
                raise RolloutEngineError(f"broadcasting a weight bucket did not finish within {self.timeout_s:g} s")
            time.sleep(POLL_S / 4)
        for w in works:
            w.wait()


class BroadcastSender:
    """The broadcast transport for the trainer: every rank iterates the exporter (destination 0, HF layout); rank 0
    (engine: its RolloutEngine; None elsewhere) forms the group with the engine at the first push and broadcasts
    each bucket it receives."""

    def __init__(self, exporter, engine):
        self.exporter, self.engine = exporter, engine
        self._sender: DistributedWeightSender | None = None

    def push(self) -> tuple[int, int]:
        """(version, bytes) of one complete sync; collective."""
        if self.engine is not None and self._sender is None:
            self._sender = DistributedWeightSender(self.engine)
            self._sender.connect()
        receiver = None if self.engine is None else self.engine.weights
        send = None if self._sender is None else (lambda named, layout: self._sender.send_bucket(named))
        return push_buckets(self.exporter, receiver, send)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
