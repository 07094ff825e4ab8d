"""The layout planner against hand-worked cases: every fallback of auto with its one log line, every layout asked
for by name but blocked with its message, and the planner's independence from torch, Megatron and SGLang."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mcore_rl.weight_sync.plan import (ActorLayout, EngineFacts, LayoutPlan, engine_blocker, layout_blockers,
                                       plan_layout, possible_layouts)

WHOLE, TP2, PP2 = ActorLayout(1, 1), ActorLayout(2, 1), ActorLayout(1, 2)
ENGINE = EngineFacts()
QUANTIZED = "the checkpoint is quantized (quantization_config.quant_method='awq')"
SPLIT_TP2 = ("the actor is split (parallel.tp=2, parallel.pp=1): rank 0 does not hold whole parameters for the "
             "engine to copy from")
SPLIT_PP2 = ("the actor is split (parallel.tp=1, parallel.pp=2): rank 0 does not hold whole parameters for the "
             "engine to copy from")
ENGINE_TP2 = "rollout.tp_size=2 (each engine rank would need its own shard; needs 1)"
DISTRIBUTED = "weight_sync.transport=distributed (the engine layout is for colocated tensor syncs)"


def test_auto_takes_shared_when_nothing_blocks():
    plan = plan_layout("auto", "tensor", WHOLE, ENGINE, None)
    assert plan == LayoutPlan("shared") and plan.log_line() is None


@pytest.mark.parametrize("actor, reason", [(TP2, SPLIT_TP2), (PP2, SPLIT_PP2)])
def test_auto_falls_back_to_engine_when_the_actor_is_split(actor, reason):
    plan = plan_layout("auto", "tensor", actor, ENGINE, None)
    assert plan == LayoutPlan("engine", reason)
    assert plan.log_line() == f"weight sync: engine layout (buckets, not shared parameters), since {reason}"


@pytest.mark.parametrize("transport, engine, model_blocker, reason", [
    ("tensor", EngineFacts(tp_size=2), None, ENGINE_TP2),
    ("tensor", EngineFacts(pp_size=2), None, "rollout.extra_args.pp_size=2 (needs 1)"),
    ("tensor", EngineFacts(dp_size=4), None, "rollout.extra_args.dp_size=4 (needs 1)"),
    ("tensor", EngineFacts(quantization="fp8"), None,
     "rollout.extra_args.quantization='fp8' (needs an unquantized engine)"),
    ("tensor", EngineFacts(attached=True), None,
     "rollout.server_url attaches to a server we did not launch, so it cannot list its parameters for the name "
     "check"),
    ("tensor", EngineFacts(weight_loaders=False), None,
     "the engine was started without our weight loaders (weight_sync.layout=hf, or "
     "RolloutEngine(weight_loaders=False)), so it cannot list its parameters for the name check"),
    ("tensor", ENGINE, QUANTIZED, QUANTIZED),
    ("disk", ENGINE, None, "weight_sync.transport=disk (the engine layout is for colocated tensor syncs)"),
    # several blockers: transport, then the model, then the engine, all named
    ("distributed", EngineFacts(tp_size=2), QUANTIZED, f"{DISTRIBUTED}; {QUANTIZED}; {ENGINE_TP2}"),
])
def test_auto_falls_back_to_hf_naming_every_blocker(transport, engine, model_blocker, reason):
    for actor in (WHOLE, TP2):  # the actor's split adds nothing once the engine layout is ruled out
        plan = plan_layout("auto", transport, actor, engine, model_blocker)
        assert plan == LayoutPlan("hf", reason)
        assert plan.log_line() == f"weight sync: HF layout (SGLang maps the names), since {reason}"


def test_engine_blocker_names_one_reason_first_the_missing_loaders():
    assert engine_blocker(ENGINE) is None
    everything = EngineFacts(tp_size=2, pp_size=2, quantization="fp8", attached=True, weight_loaders=False)
    assert engine_blocker(everything).startswith("the engine was started without our weight loaders")
    assert engine_blocker(EngineFacts(tp_size=2, quantization="fp8")) == ENGINE_TP2
    assert layout_blockers("tensor", ENGINE, None) == []


def test_hf_asked_for_is_always_possible():
    for transport, engine, blocker in (("tensor", ENGINE, None), ("distributed", EngineFacts(tp_size=2), QUANTIZED)):
        assert plan_layout("hf", transport, TP2, engine, blocker) == LayoutPlan("hf")


def test_engine_and_shared_asked_for_where_possible():
    assert plan_layout("engine", "tensor", TP2, ENGINE, None) == LayoutPlan("engine")  # a split actor is fine
    assert plan_layout("engine", "tensor", WHOLE, ENGINE, None) == LayoutPlan("engine")
    assert plan_layout("shared", "tensor", WHOLE, ENGINE, None) == LayoutPlan("shared")


@pytest.mark.parametrize("requested, transport, actor, engine, model_blocker, message", [
    ("engine", "tensor", WHOLE, ENGINE, QUANTIZED,
     f"weight_sync.layout=engine is not possible: {QUANTIZED}. Set weight_sync.layout=auto (falls back to hf) or hf."),
    ("engine", "tensor", WHOLE, EngineFacts(tp_size=2), None,
     f"weight_sync.layout=engine is not possible: {ENGINE_TP2}. Set weight_sync.layout=auto (falls back to hf) or "
     "hf."),
    ("engine", "distributed", WHOLE, ENGINE, QUANTIZED,
     f"weight_sync.layout=engine is not possible: {DISTRIBUTED}; {QUANTIZED}. Set weight_sync.layout=auto (falls "
     "back to hf) or hf."),
    ("shared", "tensor", PP2, ENGINE, None,
     f"weight_sync.layout=shared is not possible: {SPLIT_PP2}. Set weight_sync.layout=auto (falls back to engine "
     "or hf) or hf."),
    ("shared", "tensor", TP2, EngineFacts(tp_size=2), None,
     f"weight_sync.layout=shared is not possible: {ENGINE_TP2}; {SPLIT_TP2}. Set weight_sync.layout=auto (falls "
     "back to engine or hf) or hf."),
    ("shared", "tensor", WHOLE, EngineFacts(attached=True), None,
     "weight_sync.layout=shared is not possible: rollout.server_url attaches to a server we did not launch, so it "
     "cannot list its parameters for the name check. Set weight_sync.layout=auto (falls back to engine or hf) or "
     "hf."),
    ("direct", "tensor", WHOLE, ENGINE, None, "weight_sync.layout must be one of auto, hf, engine, shared, got "
     "'direct'"),
])
def test_blocked_layout_asked_for_says_what_to_change(requested, transport, actor, engine, model_blocker, message):
    with pytest.raises(ValueError) as e:
        plan_layout(requested, transport, actor, engine, model_blocker)
    assert str(e.value) == message


def test_possible_layouts():
    assert possible_layouts("tensor", WHOLE, ENGINE, None) == ["hf", "engine", "shared"]
    assert possible_layouts("tensor", TP2, ENGINE, None) == ["hf", "engine"]
    assert possible_layouts("tensor", WHOLE, ENGINE, QUANTIZED) == ["hf"]
    assert possible_layouts("distributed", WHOLE, ENGINE, None) == ["hf"]


def test_the_planner_imports_no_torch_megatron_or_sglang():
    code = ("import sys, mcore_rl.weight_sync.plan; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'sglang'}); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_moe_actor_with_expert_parallelism_is_split_for_the_shared_layout():
    ep2 = ActorLayout(1, 1, ep=2)
    reason = ("the actor is split (parallel.tp=1, parallel.pp=1, parallel.ep=2): rank 0 does not hold whole "
              "parameters for the engine to copy from")
    assert plan_layout("auto", "tensor", ep2, ENGINE, None) == LayoutPlan("engine", reason)
    etp2 = ActorLayout(1, 1, ep=1, etp=2)
    assert plan_layout("auto", "tensor", etp2, ENGINE, None).layout == "engine"
    assert "parallel.etp=2" in plan_layout("auto", "tensor", etp2, ENGINE, None).reason
    assert plan_layout("auto", "tensor", ActorLayout(1, 1, ep=1, etp=1), ENGINE, None) == LayoutPlan("shared")


def test_moe_checkpoints_take_the_engine_and_shared_layouts():
    from mcore_rl.bridge.engine_layout import unsupported_reason
    from tests.bridge.test_engine_layout import MIXTRAL, QWEN3_MOE

    for hf in (QWEN3_MOE, MIXTRAL):
        assert plan_layout("auto", "tensor", WHOLE, ENGINE, unsupported_reason(hf)) == LayoutPlan("shared")
    blocker = unsupported_reason(dict(QWEN3_MOE, quantization_config={"quant_method": "fp8"}))
    assert plan_layout("auto", "tensor", WHOLE, ENGINE, blocker).layout == "hf"


def test_moe_runner_backends_that_hold_experts_differently_block_the_engine_layout():
    for backend in (None, "auto", "triton"):
        assert engine_blocker(EngineFacts(moe_runner_backend=backend)) is None
    reason = ("rollout.extra_args.moe_runner_backend='flashinfer_cutlass' (the engine layout writes MoE experts as "
              "SGLang's triton runner holds them; needs auto or triton)")
    assert engine_blocker(EngineFacts(moe_runner_backend="flashinfer_cutlass")) == reason
    assert plan_layout("auto", "tensor", WHOLE, EngineFacts(moe_runner_backend="flashinfer_cutlass"),
                       None) == LayoutPlan("hf", reason)
