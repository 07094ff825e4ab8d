"""Save / load model + optimizer + LR schedule through Megatron dist checkpointing (torch_dist format).

The checkpoint is written to `<path>.tmp` and renamed to `<path>` only once every rank has finished, so a crash
never leaves a half-written checkpoint under the final name.

Model weights always reshard: they load at any TP / PP / EP / DP layout. The distributed optimizer's state is saved
one of two ways (Megatron's `distrib_optim_sharding_type`, recorded in the checkpoint's content metadata with the
layout, and read back at load):
* 'dp_reshardable' (`reshardable=False`, the default here and in trainer.checkpoint_reshardable): each rank writes
  its own optimizer shard as it is, with no gather: 4.4x faster than the other on CPU (a 172M-parameter model
  with Adam, 2.75 GB: 3.0 s against 13.0 s, where torch.save of the same tensors takes 1.7-2.8 s). It loads back
  at the same TP / PP / EP / expert-TP / virtual-PP layout, at any DP size (tests/engine/test_checkpoint.py);
  another model-parallel layout is refused with a ValueError that says what to do.
* 'fully_reshardable' (`reshardable=True`): every DP group gathers its optimizer state on its first rank, in CPU
  memory, and writes it per parameter, so it loads at any layout. Checkpoints without content metadata (written
  before 2026-12-05) are of this kind.

Workarounds for the plain torch-Adam path (no Transformer Engine / apex; each was seen failing on CPU):
* Megatron's default sharding type ('fully_sharded_model_space') fails ('flattened_range is not supported'): we
  always pass one of the two above;
* building the state dict to load into needs Adam state to exist (a fresh optimizer has none and asserts):
  `_init_adam_state` runs one Adam step with lr 0 and zero grads first (weights stay bit-identical);
* loading the parameter state copies into every key of a parameter's Adam state, but the fully reshardable
  checkpoint has no per-parameter 'step' (KeyError 'step') and the dp_reshardable one restores a stale one (the
  step travels in the param groups): `_step_tolerant_loading` makes that copy keep the step the groups set;
* after loading, every parameter's Adam `step` is one shared tensor object, so torch Adam increments it once per
  parameter per step and bias correction goes wrong (params drift silently): `_unshare_adam_steps` gives each
  parameter its own copy. tests/engine/test_checkpoint.py checks that a resumed run equals an uninterrupted one.

Saves are synchronous and start no helper process (bridge.checkpoint.in_process_write_results); the writer
processes Megatron forks die with the saver (bridge.checkpoint.writers_die_with_saver).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from mcore_rl.bridge.checkpoint import in_process_write_results, writers_die_with_saver
from mcore_rl.engine.optimizer import inner_optimizers
from mcore_rl.parallel.runtime import barrier as _barrier
from mcore_rl.parallel.runtime import rank as _rank

FAST, RESHARDABLE = "dp_reshardable", "fully_reshardable"


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def layout(num_chunks: int) -> dict[str, int]:
    """The parallel layout a dp_reshardable optimizer state is tied to (this rank's view of it)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "vpp": num_chunks}


def sharded_state_dict(chunks, optimizer=None, scheduler=None, extra: dict | None = None,
                       is_loading: bool = False, sharding: str = FAST) -> dict:
    """What gets saved: model chunks (GPTModel, unwrapped), optimizer (its state in `sharding`: FAST or
    RESHARDABLE), scheduler and a small `extra` dict."""
    state = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata={"distrib_optim_sharding_type": sharding})
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["extra"] = dict(extra or {})
    return state


def save(path: str | os.PathLike, chunks, optimizer=None, scheduler=None, extra: dict | None = None,
         reshardable: bool = False) -> Path:
    """Collective: every rank calls it. Returns the final path. reshardable: the optimizer state in the slower
    format that loads at any layout; False (default): the per-rank one (see the module's docstring)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    sharding = RESHARDABLE if reshardable else FAST
    state = sharded_state_dict(chunks, optimizer, scheduler, extra, is_loading=False, sharding=sharding)
    meta = {"distrib_optim_sharding_type": sharding, "layout": layout(len(chunks))}
    in_process_write_results()
    with writers_die_with_saver():
        dist_checkpointing.save(state, str(tmp), content_metadata=meta)
    _barrier()
    if _rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def load(path: str | os.PathLike, chunks, optimizer=None, scheduler=None, strict: bool = True) -> dict:
    """Collective. Loads into the given (freshly built) chunks / optimizer / scheduler; returns `extra`.

    Pass optimizer=None to load the weights only (e.g. a reference model from an actor checkpoint).
    """
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a Megatron dist checkpoint (no metadata.json)")
    sharding = RESHARDABLE
    if optimizer is not None:
        meta = dist_checkpointing.load_content_metadata(str(path)) or {}
        sharding = meta.get("distrib_optim_sharding_type", RESHARDABLE)
        saved, here = meta.get("layout"), layout(len(chunks))
        if sharding == FAST and _model_parallel(saved) != _model_parallel(here):
            raise ValueError(
                f"the checkpoint {str(path)!r} holds its optimizer state in the fast format, which loads only at the "
                f"model-parallel layout it was saved at ({layout_str(saved)}), not at this run's "
                f"({layout_str(here)}; DP may differ). Resume at that layout; or take its weights with a fresh "
                f"optimizer (python tools/convert_hf.py to-hf --ckpt {str(path)!r} --hf-dir <the run's model.path> "
                "--out DIR, then model.path=DIR); to change layouts on resume, save with "
                "trainer.checkpoint_reshardable=true")
        _init_adam_state(optimizer)
    state = sharded_state_dict(chunks, optimizer, scheduler, is_loading=True, sharding=sharding)
    loaded = dist_checkpointing.load(state, str(path))
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        # no_grad: the dp_reshardable load copies into the fp32 main params in place, outside Megatron's no_grad
        with _step_tolerant_loading(optimizer), torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra", {})


def _model_parallel(lay: dict | None) -> dict | None:
    """A layout without its DP size: Megatron's dp_reshardable state loads at another DP size (checked: saved at
    DP2, loaded at DP1, Adam's moments and the fp32 weights equal those of the reshardable format's load, for a
    dense model and for an MoE at EP1 with its separate expert optimizer)."""
    return None if lay is None else {k: v for k, v in lay.items() if k != "dp"}


def layout_str(lay: dict | None) -> str:
    """'tp 1 x pp 1 x dp 2' (+ ep and vpp where not 1, etp where not tp, its default) of a `layout()` dict, for
    messages; 'layout not recorded' for checkpoints that predate it."""
    if not lay:
        return "layout not recorded"
    parts = [f"{k} {lay[k]}" for k in ("tp", "pp", "dp") if k in lay]
    parts += [f"{k} {lay[k]}" for k in ("ep", "vpp") if lay.get(k, 1) != 1]
    if lay.get("etp", lay.get("tp")) != lay.get("tp"):
        parts.append(f"etp {lay['etp']}")
    return " x ".join(parts)


@contextlib.contextmanager
def _step_tolerant_loading(optimizer):
    """While loading: every parameter's Adam `step` is the one the checkpoint's param groups carry, which Megatron's
    load_state_dict has set on the state just before it copies the per-parameter tensors in.

    Neither format stores a usable per-parameter step: the fully reshardable state has none (a KeyError without
    this), and the dp_reshardable one keeps it as a non-persistent object, i.e. the step of the state the load
    was built from (`_init_adam_state`'s 1), which would overwrite the right one: a run resumed from step 2 or
    later then had a wrong bias correction (found by the trainer's exact-resume tests; the engine test resumed
    from step 1, where the two agree)."""
    patched = []
    for opt in inner_optimizers(optimizer):
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if orig is None or getattr(opt, "model_param_group_index_map", None) is None:
            continue

        def set_states(model_param, tensors, opt=opt, orig=orig):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            step = opt.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
            return orig(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


@torch.no_grad()
def _init_adam_state(optimizer) -> None:
    """Create Adam state where there is none, leaving weights untouched (lr 0, zero grads); loading fills it."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None or len(torch_opt.state) > 0:
            continue
        lrs = [group["lr"] for group in torch_opt.param_groups]
        for group in torch_opt.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                if p.numel() and p.grad is None:
                    p.grad = torch.zeros_like(p)
        torch_opt.step()
        for group, lr in zip(torch_opt.param_groups, lrs):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = None


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor (load leaves them all pointing at one)."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.clone()
