"""WeightSync: the training loop's one handle on weight sync, from the Megatron actor to the rollout engine.

    sync = WeightSync(cfg.weight_sync, actor.model_chunks, hf, rollout, scratch_dir=..., model_path=...)
    version = sync.sync()     # every trainer rank, between the update and the next generation
    sync.last_bytes; sync.close()

Global rank 0 owns the engine (`rollout`; None on the other ranks). At the first sync rank 0 plans the layout
(plan.plan_layout, from the actor's TP / PP, the engine's facts, the model's and the transport) and sends it to
every rank, since the ranks that gather and send must pack buckets alike; the plan is then checked against the
running engine (names and shapes), falling back to hf where that fails unless the layout was asked for by name.
Each sync then goes through one transport: shared.py (no export), tensor.py (colocated buckets), distributed.py
(broadcast group) or disk.py (an HF folder the engine reloads).
"""

from __future__ import annotations

import logging

from mcore_rl.config.weight_sync import WeightSyncConfig
from mcore_rl.weight_sync.plan import ActorLayout, EngineFacts, LayoutPlan, plan_layout

logger = logging.getLogger(__name__)


def plan_inputs(hf: dict, rollout) -> tuple[ActorLayout, EngineFacts, str | None]:
    """plan_layout's inputs in this process (rank 0, which owns `rollout`): the actor's TP / PP / EP / expert TP
    (the expert sizes of MoE models only: Megatron reports expert TP = TP for a dense one), the engine's facts
    and why the checkpoint cannot use the engine layout (None: it can)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.bridge.engine_layout import unsupported_reason
    from mcore_rl.models.arch import resolve_arch

    experts = (ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()) \
        if resolve_arch(hf).moe else (1, 1)
    actor = ActorLayout(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                        *experts)
    return actor, rollout.weights.facts, unsupported_reason(hf)


def choose_layout(cfg: WeightSyncConfig, hf: dict, rollout, requested: str | None = None) -> LayoutPlan:
    """Rank 0: the plan for `requested` (default cfg.layout), its fallback logged in one line. ValueError when a
    layout asked for by name is blocked."""
    plan = plan_layout(requested or cfg.layout, cfg.transport, *plan_inputs(hf, rollout))
    line = plan.log_line()
    if line is not None:
        logger.info("%s", line)
    return plan


class WeightSync:
    def __init__(self, cfg: WeightSyncConfig, actor_chunks, hf: dict, rollout, scratch_dir: str = "",
                 model_path: str = "", bucket_bytes: int | None = None):
        """rollout: the RolloutEngine on global rank 0, None elsewhere. scratch_dir and model_path serve the disk
        transport (where the folder is written; where its config and tokenizer files come from). bucket_bytes
        overrides cfg.bucket_mb (tests use buckets smaller than a MiB)."""
        self.cfg = cfg
        self.actor_chunks, self.hf, self.rollout = actor_chunks, hf, rollout
        self.scratch_dir, self.model_path = scratch_dir, model_path
        self.bucket_bytes = bucket_bytes or cfg.bucket_mb << 20
        self.layout: str | None = None
        """hf | engine | shared, once chosen (first sync)."""
        self.exporter = None
        """The HFWeightExporter of the bucketed transports (None for the shared layout, or before the first sync)."""
        self.last_bytes = 0
        """Bytes moved by the last sync (on rank 0)."""
        self._sender = None

    @property
    def receiver(self):
        return None if self.rollout is None else self.rollout.weights

    def sync(self) -> int:
        """Push the actor's current weights; returns the engine's weight version after the sync (0 off rank 0).
        Collective over every trainer rank."""
        if self._sender is None:
            self._sender = self._setup()
        version, self.last_bytes = self._sender.push()
        return version

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()

    # -- setup (first sync) -----------------------------------------------------------------------------------
    def _setup(self):
        """Choose the layout (rank 0) and build the transport: collective, once."""
        import torch.distributed as dist

        from mcore_rl.parallel.runtime import from_rank0

        rank0 = dist.get_rank() == 0
        choice = None
        if rank0:
            try:
                choice = choose_layout(self.cfg, self.hf, self.rollout).layout
            except Exception as e:  # every rank must hear of it, or the others wait in the next collective
                choice = e
        layout = from_rank0(choice)
        if layout == "shared":
            from mcore_rl.weight_sync.shared import SharedParams, SharedSender

            shared = []

            def share() -> None:  # hands the parameters over, checking names and shapes against the engine
                shared.append(SharedParams(self.actor_chunks, self.hf, self.receiver))

            if self._fits_engine("shared", share):
                if rank0:
                    logger.info("weight sync: shared layout (the engine copies the actor's parameters into its own)")
                self.layout = layout
                return SharedSender(shared[0] if shared else None)
            layout = "hf"
        self.exporter = self._exporter(layout)
        if layout == "engine":
            def check() -> None:
                from mcore_rl.weight_sync.loaders import check_names

                check_names({n: s for n, s, _ in self.exporter.tensor_specs()}, self.receiver.engine_parameters(),
                            "the engine-layout export")

            if not self._fits_engine("engine", check):
                layout = "hf"
                self.exporter = self._exporter(layout)
            elif rank0:
                logger.info("weight sync: engine layout (SGLang's own parameters, copied as they are)")
        self.layout = layout
        if self.cfg.transport == "disk":
            from mcore_rl.weight_sync.disk import DiskSender

            return DiskSender(self.exporter, self.receiver, self.model_path, self.scratch_dir)
        if self.cfg.transport == "distributed":
            from mcore_rl.weight_sync.distributed import BroadcastSender

            return BroadcastSender(self.exporter, self.rollout)
        from mcore_rl.weight_sync.tensor import TensorSender

        return TensorSender(self.exporter, self.receiver)

    def _fits_engine(self, layout: str, check) -> bool:
        """Collective. Rank 0 runs `check`, which raises ValueError when `layout` does not fit the running engine:
        False then (fall back to hf, logged), unless `layout` was asked for by name, when the error is raised on
        every rank, as is any other exception of `check`."""
        import torch.distributed as dist

        from mcore_rl.parallel.runtime import from_rank0

        verdict = None
        if dist.get_rank() == 0:
            try:
                check()
            except ValueError as e:
                verdict = e if self.cfg.layout == layout else "hf"
                if verdict == "hf":
                    logger.warning("weight sync: HF layout, since %s", e)
            except Exception as e:
                verdict = e
        return from_rank0(verdict) != "hf"

    def _exporter(self, layout: str):
        from mcore_rl.bridge import HFWeightExporter

        exporter = HFWeightExporter(self.actor_chunks, self.hf, bucket_bytes=self.bucket_bytes, destination=0,
                                    layout=layout)
        exporter.plan()  # collective: every rank builds it here, together
        return exporter
