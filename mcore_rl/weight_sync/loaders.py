"""Our custom SGLang weight loaders (they run inside SGLang's scheduler process), and the checks and packing of what
the trainer sends them. The engine is started with them unless weight_sync.layout=hf (RolloutEngine(weight_loaders=)).

The engine's own parameter table (names, shapes, dtypes), for weight syncs in SGLang's layout.

A sync in the engine layout (load_format="direct") looks every name up in the engine's named_parameters() inside
SGLang's scheduler; an unknown name or a wrong shape raises there and kills the scheduler. So the first such sync
checks the names first, against the running engine. SGLang has no call that lists the parameters of every model
(get_weights_by_name answers None for Qwen2, and a tensor update answers only success and a message), so the
table comes back through a custom weight loader that SGLang imports in its scheduler: `describe` is registered
with the engine (ServerArgs.custom_weight_loader, see mcore_rl.rollout.settings.server_args) and called as a tensor
update whose one tensor's *name* is a file path on this host, where it writes the table as JSON. Tensor updates already
require the engine on the same host (shared-memory / CUDA IPC handles).

`load_flat` is the engine layout's loader for a bucket packed in one flat buffer per dtype (what the bridge
yields): SGLang's own load_format="direct" does the same copies, but is handed one tensor per parameter, and each
tensor crosses the process boundary as its own CUDA IPC handle and event (on an H200, 0.99 GB in 2 buckets:
15 ms through "direct", most of it per-tensor overhead). Here a bucket is (JSON spec, flat buffer) pairs.

`share` and `apply_shared` are the shared layout's (bridge.engine_layout.shared_plan): `share` keeps the trainer's
own parameters (CUDA IPC handles, or shared memory on CPU) with a copy plan; each `apply_shared` runs the plan.
`unshare` drops them before the engine is shut down: the engine's processes are killed, and a CUDA IPC handle (or
shared-memory mapping) they still hold is never given back to the trainer's process.

A name may address one slice of a stacked engine parameter, `{name}[{i}]` (an MoE expert's slice of FusedMoE's
`experts.w13_weight` / `w2_weight`, bridge.engine_layout.expert_slice): the loaders copy into `param[i]`, and the
name check counts a stacked parameter as sent once all of its slices are. SGLang's own load_format="direct" knows
no such names, so the receiver never sends them through it.

`save` (same mechanism) writes the engine's parameters with torch.save: a way to read the engine's weights back,
for parity tests. Nothing here imports SGLang or Megatron; it runs inside SGLang's scheduler process.
"""

from __future__ import annotations

import json
import os

DESCRIBE = f"{__name__}.describe"
SAVE = f"{__name__}.save"
FLAT = f"{__name__}.load_flat"
SHARE = f"{__name__}.share"
APPLY_SHARED = f"{__name__}.apply_shared"
UNSHARE = f"{__name__}.unshare"
LOADERS = (DESCRIBE, SAVE, FLAT, SHARE, APPLY_SHARED, UNSHARE)

# The trainer's parameters handed over by `share` (one set per engine process): token, ops, source tensors, and
# the copy program compiled against one model object and its first parameter's storage (recompiled if either
# changes, e.g. on a reload from disk).
_SHARED: dict = {}


def split_slice(name: str) -> tuple[str, int | None]:
    """(parameter name, slice index) of `{name}[{i}]`; (name, None) for a whole parameter."""
    if not name.endswith("]"):
        return name, None
    base, _, index = name[:-1].rpartition("[")
    return base, int(index)


def _target(params: dict, name: str):
    """The engine tensor a sent name fills: a parameter's data, or one slice of it."""
    base, index = split_slice(name)
    data = params[base].data
    return data if index is None else data[index]


def _path(named_tensors) -> str:
    named_tensors = list(named_tensors)
    if len(named_tensors) != 1:
        raise ValueError(f"expected one (path, tensor) pair, got {len(named_tensors)}")
    return named_tensors[0][0]


def describe(model, named_tensors) -> None:
    """SGLang custom loader: write {name: [shape, dtype]} of the model's parameters to the path in the name."""
    table = {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()}
    path = _path(named_tensors)
    with open(path + ".tmp", "w") as f:
        json.dump(table, f)
    os.replace(path + ".tmp", path)


def load_flat(model, named_tensors) -> None:
    """SGLang custom loader: each pair is (JSON [[name, offset, shape], ...], 1-D tensor); copy each slice into the
    engine parameter of that name (names and shapes were checked by the sender, see check_names)."""
    params = dict(model.named_parameters())
    for spec, flat in named_tensors:
        for name, offset, shape in json.loads(spec):
            dst = _target(params, name)
            numel = dst.numel()
            assert list(dst.shape) == list(shape), (name, list(dst.shape), shape)
            dst.copy_(flat[offset:offset + numel].view(dst.shape))


def pack_flat(named_tensors) -> list[tuple[str, object]] | None:
    """load_flat's input for tensors that are contiguous views of 1-D contiguous buffers (a bridge bucket): one
    (JSON spec, buffer) pair per buffer; None when some tensor is not such a view."""
    groups: dict[int, tuple[object, list]] = {}
    for name, t in named_tensors:
        base = t._base
        if base is None or base.dim() != 1 or not base.is_contiguous() or not t.is_contiguous() \
                or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        groups.setdefault(id(base), (base, []))[1].append([name, t.storage_offset() - base.storage_offset(),
                                                           list(t.shape)])
    return [(json.dumps(spec), base) for base, spec in groups.values()]


def pack_each(named_tensors) -> list[tuple[str, object]]:
    """load_flat's input for any tensors: one (JSON spec, 1-D view) pair per tensor (a copy only for a
    non-contiguous one). For names SGLang's load_format="direct" cannot take (slices)."""
    return [(json.dumps([[name, 0, list(t.shape)]]), t.contiguous().view(-1)) for name, t in named_tensors]


def share(model, named_tensors) -> None:
    """SGLang custom loader: keep the trainer's parameters (CUDA IPC / shared-memory handles, not copies) for
    apply_shared. The first pair's name is JSON {"token", "ops"} (bridge.engine_layout.shared_plan's ops); the
    tensors are the sources the ops index, in order. Replaces what an earlier call kept."""
    named_tensors = list(named_tensors)
    spec = json.loads(named_tensors[0][0])
    _SHARED.clear()
    _SHARED.update(token=spec["token"], ops=spec["ops"], sources=[t for _, t in named_tensors])


def apply_shared(model, named_tensors) -> None:
    """SGLang custom loader: copy the shared trainer parameters into the engine's, as `share`'s ops say. The one
    pair's name is the token `share` was given (a mismatch means the engine lost them: a bug, asserted). The
    caller has finished writing the sources; this returns once the copies are done, so it may write again."""
    import torch

    token = _path(named_tensors)
    assert _SHARED.get("token") == token, f"apply_shared: token {token!r}, shared {_SHARED.get('token')!r}"
    program = _SHARED.get("program")
    where = next(model.parameters()).data_ptr()  # a reload that replaces parameter storage recompiles too
    if program is None or program[0]() is not model or program[1] != where:
        program = _SHARED["program"] = (_weak(model), where, _compile(model, _SHARED["ops"], _SHARED["sources"]))
    copies, gathers = program[2]
    for dsts, srcs in copies:
        torch._foreach_copy_(dsts, srcs)
    for dst, src, index in gathers:
        if dst.dtype == src.dtype:
            torch.index_select(src, 0, index, out=dst)
        else:
            dst.copy_(src.index_select(0, index))
    device = _SHARED["sources"][0].device
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def unshare(model, named_tensors) -> None:
    """SGLang custom loader: drop the shared trainer parameters (and the program compiled against them). Freeing
    the tensors rebuilt from CUDA IPC handles tells the trainer's process that they are released."""
    _SHARED.clear()


def _weak(model):
    import weakref

    return weakref.ref(model)


def _compile(model, ops, sources):
    """(copies grouped by dtype pair for torch._foreach_copy_, [(dst, src, row index)]) for these ops."""
    import torch

    params = dict(model.named_parameters())
    copies: dict = {}
    gathers = []
    for name, shape, k, rows in ops:
        dst, src = _target(params, name), sources[k]
        assert list(dst.shape) == list(shape), (name, list(dst.shape), shape)
        if isinstance(rows, int):
            group = copies.setdefault((dst.dtype, src.dtype), ([], []))
            group[0].append(dst[:rows])
            group[1].append(src[:rows])
        else:
            index = torch.tensor(rows, dtype=torch.long, device=src.device)
            gathers.append((dst[:len(rows)], src, index))
    return list(copies.values()), gathers


def save(model, named_tensors) -> None:
    """SGLang custom loader: torch.save {name: CPU copy} of the model's parameters to the path in the name."""
    import torch

    path = _path(named_tensors)
    torch.save({name: p.detach().cpu().clone() for name, p in model.named_parameters()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def check_names(sending: dict[str, tuple[int, ...]], engine: dict[str, tuple[int, ...]], what: str,
                complete: bool = True) -> None:
    """ValueError naming the tensors the engine lacks, those whose shape differs and (complete=True) the engine
    parameters not sent, instead of a KeyError or a failed assert inside SGLang's scheduler. A slice `{name}[i]`
    must address an existing row i of `name` with the shape of that row; a parameter counts as sent once all of
    its slices are."""
    unexpected, shapes, slices = [], [], {}
    for n in sorted(sending):
        base, index = split_slice(n)
        if base not in engine or (index is not None and not 0 <= index < (engine[base] or (0,))[0]):
            unexpected.append(n)
            continue
        want = tuple(engine[base]) if index is None else tuple(engine[base][1:])
        if tuple(sending[n]) != want:
            shapes.append(f"{n} {tuple(sending[n])} vs the engine's {want}")
        if index is not None:
            slices.setdefault(base, set()).add(index)
    missing = []
    for n in sorted(engine) if complete else []:
        if n in sending:
            continue
        if n not in slices:
            missing.append(n)
        elif len(slices[n]) < engine[n][0]:
            left = sorted(set(range(engine[n][0])) - slices[n])
            missing.append(f"{n} (slices {left[:8]}{' ...' if len(left) > 8 else ''} of {engine[n][0]})")
    if not (unexpected or missing or shapes):
        return
    parts = []
    for label, names in (("not engine parameters", unexpected), ("engine parameters not sent", missing),
                         ("shape mismatches", shapes)):
        if names:
            more = f" (+{len(names) - 8} more)" if len(names) > 8 else ""
            parts.append(f"{label}: {', '.join(names[:8])}{more}")
    raise ValueError(f"{what} does not match the engine's parameters: {'; '.join(parts)}. Set "
                     "weight_sync.layout=hf to sync through SGLang's HF-name loader instead.")
