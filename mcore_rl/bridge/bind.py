"""Which map entries this rank holds: binds the architecture map to the parameters of this rank's model chunks.

A rank holds the entries of its pipeline stage(s): the embedding on the first stage, its decoder layers (found by
each layer's global `layer_number`, so any pipeline split and virtual stages work), the final norm and output layer
on the last stage; of a mixture-of-experts layer, only the experts of its expert-parallel rank (the layer's
`local_expert_indices`). Chunks may be wrapped (DDP, Float16Module): they are unwrapped through `.module`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel

from mcore_rl.bridge.maps import Entry, Where, arch_map, expand, resolve_name


def unwrap(chunk) -> GPTModel:
    model = chunk
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise TypeError(f"expected a (wrapped) megatron GPTModel, got {type(chunk).__name__}")
    return model


@dataclass
class Bound:
    index: int  # position of the entry in maps.expand(hf): the model-wide HF order
    entry: Entry
    chunk: int  # index into the rank's chunk list
    name: str  # Megatron parameter name within the chunk
    param: torch.nn.Parameter


def holds_value_head(model: GPTModel) -> bool:
    """Whether `model` (an unwrapped chunk) is a critic's last stage: its output layer is the builder's scalar
    value head, which has no HF counterpart."""
    from mcore_rl.models.builder import ValueHead

    return isinstance(getattr(model, "output_layer", None), ValueHead)


def bind(chunks: list, hf: dict, *, critic: bool | None = None) -> list[Bound]:
    """This rank's entries, in HF order within each chunk. Critic chunks bind everything but the value head.

    critic: whether the chunks are a critic's (ModelInfo.is_critic); None reads it from each chunk's modules
    (`holds_value_head`), for callers that hold only the chunks."""
    entries = expand(hf)
    bound = []
    for c, model in enumerate(unwrap(ch) for ch in chunks):
        params = dict(model.named_parameters())
        is_critic = holds_value_head(model) if critic is None else critic
        local = {layer.layer_number - 1: j for j, layer in enumerate(model.decoder.layers)}
        used = set()
        for index, e in enumerate(entries):
            prefix = ""
            if e.where == Where.PRE:
                if not model.pre_process:
                    continue
            elif e.where == Where.POST:
                if not model.post_process:
                    continue
                is_output = e.mcore == ("output_layer.weight",)
                # Tied on one stage: the output layer reuses the embedding parameter. A critic's output is its
                # value head, which has no HF counterpart.
                if is_output and ((not e.export and model.pre_process) or is_critic):
                    continue
            else:
                if e.layer not in local:
                    continue
                prefix = f"decoder.layers.{local[e.layer]}."
            if e.expert is not None:
                # Expert parallelism: this rank holds the experts its MoE layer lists, under local indices.
                held = list(model.decoder.layers[local[e.layer]].mlp.local_expert_indices)
                if e.expert not in held:
                    continue
                candidates = tuple(prefix + n.format(k=held.index(e.expert)) for n in e.mcore)
            else:
                candidates = tuple(prefix + n for n in e.mcore)
            name = resolve_name(candidates, params)
            if name is None:
                raise ValueError(
                    f"the Megatron model has none of {list(candidates)} for HF tensor(s) {list(e.hf)}: the "
                    "model was built with a layer spec this bridge does not know"
                )
            used.add(name)
            bound.append(Bound(index, e, c, name, params[name]))
        unbound = [n for n in params if n not in used and not (is_critic and n.startswith("output_layer."))]
        if unbound:
            raise ValueError(
                f"Megatron parameters with no HF counterpart in the {arch_map(hf).name} map: {unbound[:8]}; "
                "the model config enables something the bridge does not map"
            )
    return bound
