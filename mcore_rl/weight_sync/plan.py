"""Which layout a weight sync hands the engine: a pure function of the actor's layout, the engine's facts, the
model's and the transport. No torch.distributed, SGLang or Megatron here; mcore_rl.weight_sync.sync gathers the
inputs on rank 0 (which owns the engine) and sends the plan to every rank.

Layouts, best first:
* shared: the engine holds handles to the actor's own parameters and copies them into its own at each sync (no
  export, no buckets). Needs everything engine needs, and rank 0 holding whole parameters (TP=1, PP=1; MoE models
  also EP=1 and expert TP=1).
* engine: buckets of SGLang's own parameters (fused q/k/v and gate/up, padded vocabulary), copied as they are.
  Needs a colocated tensor sync, a verified unquantized architecture (dense, or Qwen3-MoE / Mixtral, whose experts
  go as slices of SGLang's stacked expert parameters), and an engine at TP=1 (no pipeline or data
  parallelism, no quantization) that we launched with our weight loaders (they list its parameters).
* hf: buckets of HF names, mapped by SGLang's model.load_weights. Always possible.

    plan = plan_layout("auto", "tensor", ActorLayout(tp=2, pp=1), EngineFacts(), model_blocker=None)
    plan.layout == "engine"; plan.reason == "the actor is split (parallel.tp=2, parallel.pp=1): ..."

A layout asked for by name that is blocked is a ValueError naming what blocks it and what to set instead.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("hf", "engine", "shared")


@dataclass(frozen=True)
class ActorLayout:
    """How the trainer splits the actor's parameters."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism (MoE models; 1 for dense ones)."""
    etp: int = 1
    """Expert tensor parallelism (MoE models; Megatron sets it to tp for dense ones)."""

    @property
    def whole_on_rank0(self) -> bool:
        """Rank 0 holds every parameter whole (what the shared layout copies from)."""
        return self.tp * self.pp * self.ep * self.etp == 1

    def describe(self) -> str:
        """`parallel.tp=2, parallel.pp=1`, with ep and etp where they are not 1."""
        parts = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}"]
        parts += [f"parallel.{k}={v}" for k, v in (("ep", self.ep), ("etp", self.etp)) if v != 1]
        return ", ".join(parts)


@dataclass(frozen=True)
class EngineFacts:
    """What the rollout engine is, as far as taking weights in its own layout goes (RolloutEngine.weights.facts)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    quantization: str | None = None
    """rollout.extra_args.quantization, if set."""
    moe_runner_backend: str | None = None
    """rollout.extra_args.moe_runner_backend, if set (SGLang's MoE kernels; some hold the experts differently)."""
    attached: bool = False
    """Attached to a server by URL (rollout.server_url) rather than launched by us."""
    weight_loaders: bool = True
    """Started with our custom weight loaders (the parameter listing, the flat and shared loads)."""

    @classmethod
    def from_config(cls, rollout, weight_loaders: bool) -> "EngineFacts":
        """The facts a RolloutConfig (`rollout`) gives, for an engine started with or without our loaders."""
        extra = rollout.extra_args
        return cls(tp_size=rollout.tp_size, pp_size=int(extra.get("pp_size") or 1),
                   dp_size=int(extra.get("dp_size") or 1), quantization=extra.get("quantization") or None,
                   moe_runner_backend=extra.get("moe_runner_backend") or None,
                   attached=rollout.server_url is not None, weight_loaders=weight_loaders)


@dataclass(frozen=True)
class LayoutPlan:
    layout: str
    """hf | engine | shared."""
    reason: str = ""
    """What ruled out the better layouts ('; '-joined); empty when none was ruled out or the layout was asked for."""

    def log_line(self) -> str | None:
        """The one line an auto choice that fell back logs (None: nothing to say)."""
        if not self.reason:
            return None
        if self.layout == "engine":
            return f"weight sync: engine layout (buckets, not shared parameters), since {self.reason}"
        return f"weight sync: HF layout (SGLang maps the names), since {self.reason}"


def engine_blocker(engine: EngineFacts) -> str | None:
    """Why this engine cannot take weights in its own layout (None: it can)."""
    if not engine.weight_loaders:
        return ("the engine was started without our weight loaders (weight_sync.layout=hf, or "
                "RolloutEngine(weight_loaders=False)), so it cannot list its parameters for the name check")
    if engine.tp_size != 1:
        return f"rollout.tp_size={engine.tp_size} (each engine rank would need its own shard; needs 1)"
    for key, value in (("pp_size", engine.pp_size), ("dp_size", engine.dp_size)):
        if value != 1:
            return f"rollout.extra_args.{key}={value} (needs 1)"
    if engine.quantization:
        return f"rollout.extra_args.quantization={engine.quantization!r} (needs an unquantized engine)"
    if engine.moe_runner_backend not in (None, "auto", "triton"):
        # flashinfer_cutlass holds [up; gate], triton_kernel transposes, flashinfer_trtllm pads and permutes: the
        # same shapes in some cases, so the name check alone would not catch them
        return (f"rollout.extra_args.moe_runner_backend={engine.moe_runner_backend!r} (the engine layout writes "
                "MoE experts as SGLang's triton runner holds them; needs auto or triton)")
    if engine.attached:
        return ("rollout.server_url attaches to a server we did not launch, so it cannot list its parameters "
                "for the name check")
    return None


def layout_blockers(transport: str, engine: EngineFacts, model_blocker: str | None) -> list[str]:
    """Why the engine layout (and so the shared one) cannot be used (empty: it can). model_blocker: why the
    checkpoint cannot be (mcore_rl.bridge.engine_layout.unsupported_reason)."""
    reasons = []
    if transport != "tensor":
        reasons.append(f"weight_sync.transport={transport} (the engine layout is for colocated tensor syncs)")
    for reason in (model_blocker, engine_blocker(engine)):
        if reason is not None:
            reasons.append(reason)
    return reasons


def shared_blockers(actor: ActorLayout) -> list[str]:
    """Why the shared layout cannot be used on top of layout_blockers (empty: it can)."""
    if actor.whole_on_rank0:
        return []
    return [f"the actor is split ({actor.describe()}): rank 0 does not hold whole parameters for the engine to "
            "copy from"]


def plan_layout(requested: str, transport: str, actor: ActorLayout, engine: EngineFacts,
                model_blocker: str | None) -> LayoutPlan:
    """The layout for weight_sync.layout=`requested` (auto | hf | engine | shared). auto takes the first possible of
    shared, engine, hf; a layout asked for by name but blocked raises ValueError."""
    blockers = layout_blockers(transport, engine, model_blocker)
    split = shared_blockers(actor)
    if requested == "hf":
        return LayoutPlan("hf")
    if requested in ("engine", "shared"):
        reasons = blockers + split if requested == "shared" else blockers
        if reasons:
            fallback = "auto (falls back to engine or hf)" if requested == "shared" else "auto (falls back to hf)"
            raise ValueError(f"weight_sync.layout={requested} is not possible: {'; '.join(reasons)}. Set "
                             f"weight_sync.layout={fallback} or hf.")
        return LayoutPlan(requested)
    if requested != "auto":
        raise ValueError(f"weight_sync.layout must be one of auto, {', '.join(LAYOUTS)}, got {requested!r}")
    if not blockers and not split:
        return LayoutPlan("shared")
    if not blockers:
        return LayoutPlan("engine", "; ".join(split))
    return LayoutPlan("hf", "; ".join(blockers))


def possible_layouts(transport: str, actor: ActorLayout, engine: EngineFacts, model_blocker: str | None) -> list[str]:
    """Every layout not ruled out here, worst first (the benchmark measures each)."""
    blockers = layout_blockers(transport, engine, model_blocker)
    return ["hf"] + (["engine"] if not blockers else []) + (["shared"] if not blockers and
                                                            not shared_blockers(actor) else [])
