"""The engine's own parameter table (names, shapes, dtypes), for weight syncs in SGLang's layout.

A sync in the engine layout (load_format="direct") looks every name up in the engine's named_parameters() inside
SGLang's scheduler; an unknown name or a wrong shape raises there and kills the scheduler. So the first such sync
checks the names first, against the running engine. SGLang has no call that lists the parameters of every model
(get_weights_by_name answers None for Qwen2, and a tensor update answers only success and a message), so the
table comes back through a custom weight loader that SGLang imports in its scheduler: `describe` is registered
with the engine (ServerArgs.custom_weight_loader, see settings.server_args) and called as a tensor update whose
one tensor's *name* is a file path on this host, where it writes the table as JSON. Tensor updates already
require the engine on the same host (shared-memory / CUDA IPC handles).

`load_flat` is the engine layout's loader for a bucket packed in one flat buffer per dtype (what the bridge
yields): SGLang's own load_format="direct" does the same copies, but is handed one tensor per parameter, and each
tensor crosses the process boundary as its own CUDA IPC handle and event (on an H200, 0.99 GB in 2 buckets:
15 ms through "direct", most of it per-tensor overhead). Here a bucket is (JSON spec, flat buffer) pairs.

`save` (same mechanism) writes the engine's parameters with torch.save: a way to read the engine's weights back,
for parity tests. Nothing here imports SGLang or Megatron; it runs inside SGLang's scheduler process.
"""

from __future__ import annotations

import json
import os

DESCRIBE = f"{__name__}.describe"
SAVE = f"{__name__}.save"
FLAT = f"{__name__}.load_flat"
LOADERS = (DESCRIBE, SAVE, FLAT)


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
            param = params[name]
            numel = param.numel()
            assert list(param.shape) == list(shape), (name, list(param.shape), shape)
            param.data.copy_(flat[offset:offset + numel].view(param.shape))


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


def save(model, named_tensors) -> None:
    """SGLang custom loader: torch.save {name: CPU copy} of the model's parameters to the path in the name."""
    import torch

    path = _path(named_tensors)
    torch.save({name: p.detach().cpu().clone() for name, p in model.named_parameters()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def check_names(sending: dict[str, tuple[int, ...]], engine: dict[str, tuple[int, ...]], what: str,
                complete: bool = True) -> None:
    """ValueError naming the tensors the engine lacks, those whose shape differs and (complete=True) the engine
    parameters not sent, instead of a KeyError or a failed assert inside SGLang's scheduler."""
    unexpected = sorted(set(sending) - set(engine))
    missing = sorted(set(engine) - set(sending)) if complete else []
    shapes = [f"{n} {tuple(sending[n])} vs the engine's {tuple(engine[n])}"
              for n in sorted(set(sending) & set(engine)) if tuple(sending[n]) != tuple(engine[n])]
    if not (unexpected or missing or shapes):
        return
    parts = []
    for label, names in (("not engine parameters", unexpected), ("engine parameters not sent", missing),
                         ("shape mismatches", shapes)):
        if names:
            more = f" (+{len(names) - 8} more)" if len(names) > 8 else ""
            parts.append(f"{label}: {', '.join(names[:8])}{more}")
    raise ValueError(f"{what} does not match the engine's parameters: {'; '.join(parts)}. Set "
                     "rollout.weight_sync_layout=hf to sync through SGLang's HF-name loader instead.")
