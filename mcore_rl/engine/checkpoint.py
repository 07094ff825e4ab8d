"""Save / load model + optimizer + LR schedule through Megatron dist checkpointing (torch_dist format).

The checkpoint is written to `<path>.tmp` and renamed to `<path>` only once every rank has finished, so a crash
never leaves a half-written checkpoint under the final name. The format reshards: a checkpoint saved at one
TP / PP / DP layout loads at another (the optimizer state uses the 'fully_reshardable' sharding type).

Workarounds for the plain torch-Adam path (no Transformer Engine / apex; each was seen failing on CPU):
* the default distributed-optimizer sharding type fails ('flattened_range is not supported'): we pass
  metadata={'distrib_optim_sharding_type': 'fully_reshardable'};
* building the state dict to load into needs Adam state to exist (a fresh optimizer has none and asserts):
  `_init_adam_state` runs one Adam step with lr 0 and zero grads first (weights stay bit-identical);
* loading the fully reshardable parameter state copies into every key of a parameter's Adam state but the
  checkpoint has no per-parameter 'step' (KeyError 'step'; the step travels in the param groups):
  `_step_tolerant_loading` lets that copy keep the step already set;
* after loading, every parameter's Adam `step` is one shared tensor object, so torch Adam increments it once per
  parameter per step and bias correction goes wrong (params drift silently): `_unshare_adam_steps` gives each
  parameter its own copy. tests/engine/test_checkpoint.py checks that a resumed run equals an uninterrupted one.

Entry scripts that save must keep their code under `if __name__ == "__main__":` (saving starts a helper process
that re-imports the main module).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from mcore_rl.engine.optimizer import inner_optimizers
from mcore_rl.parallel.runtime import barrier as _barrier
from mcore_rl.parallel.runtime import rank as _rank

SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def sharded_state_dict(chunks, optimizer=None, scheduler=None, extra: dict | None = None,
                       is_loading: bool = False) -> dict:
    """What gets saved: model chunks (GPTModel, unwrapped), optimizer, scheduler and a small `extra` dict."""
    state = {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=SHARDING_METADATA)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["extra"] = dict(extra or {})
    return state


def save(path: str | os.PathLike, chunks, optimizer=None, scheduler=None, extra: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the final path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = sharded_state_dict(chunks, optimizer, scheduler, extra, is_loading=False)
    dist_checkpointing.save(state, str(tmp))
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
    if optimizer is not None:
        _init_adam_state(optimizer)
    state = sharded_state_dict(chunks, optimizer, scheduler, is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        with _step_tolerant_loading(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra", {})


@contextlib.contextmanager
def _step_tolerant_loading(optimizer):
    """While loading: a parameter's tensors without 'step' keep the step the param groups already set."""
    patched = []
    for opt in inner_optimizers(optimizer):
        orig = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if orig is None or getattr(opt, "model_param_group_index_map", None) is None:
            continue

        def set_states(model_param, tensors, opt=opt, orig=orig):
            if "step" not in tensors:
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
