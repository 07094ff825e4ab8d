"""SGLang's own parameter names and layout for the Llama-family decoders and their mixture-of-experts relatives
(Qwen3-MoE, Mixtral), so a weight sync can hand the engine tensors it copies as they are (no name mapping). Pure,
except shared_plan, which reads a live model.

The "engine" sync layout differs from the HF layout in four ways, each read from SGLang 0.5.17's sources:
* q, k, v of a layer are one parameter `self_attn.qkv_proj.{weight,bias}` = rows [q; k; v]
  (models/qwen2.py, llama.py, qwen3.py build QKVParallelLinear; layers/linear.py
  QKVParallelLinear._get_shard_offset_mapping puts q at 0, k at num_heads*head_dim, v after k, at TP=1);
* gate and up are one parameter `mlp.gate_up_proj.weight` = rows [gate; up] (MergedColumnParallelLinear with
  output_sizes [ffn, ffn]; shard i at sum(output_sizes[:i]));
* the embedding and the untied output layer have the vocabulary padded with zero rows to a multiple of 64
  (layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE; its weight_loader zero-fills the padding).
* the routed experts of an MoE layer are two stacked parameters of its FusedMoE (`mlp.experts` for qwen3_moe,
  `block_sparse_moe.experts` for mixtral): `experts.w13_weight` [E, 2I, H], whose expert e is rows [gate_e; up_e]
  (layers/moe/fused_moe_triton/layer.py _load_w13: w1 at row 0, w3 at row I; quantization/unquant.py
  create_weights), and `experts.w2_weight` [E, H, I] = down_e. One bridge entry is one expert's matrix, so it
  becomes one slice of the stacked parameter, named `{stacked}[{e}]` (expert_slice): the experts of one layer may
  arrive in several buckets (and, at EP > 1, from several ranks); the engine's loaders resolve the name to
  `param[e]` (mcore_rl.weight_sync.loaders.split_slice). The router `gate.weight` [E, H] keeps its HF name.
Everything else keeps its HF name and shape. With tie_word_embeddings SGLang sets `lm_head = model.embed_tokens`
(pipeline size 1), so named_parameters() has no lm_head.weight; the bridge never exports a tied output layer.

The exporter packs q, k, v (and gate, up) of one Megatron parameter back to back in a bucket's flat buffer, so
each fused engine tensor is a view over that region: no extra copy. Valid only for an engine at TP=1 and
pipeline size 1 (each rank would otherwise need its own shard) and unquantized weights; the rollout side checks
the names and shapes against the running engine before the first sync.

The "shared" sync layout exports nothing: shared_plan says, per engine parameter (or expert slice), which Megatron
parameter of an actor held whole by one rank (TP=1, PP=1, EP=1, expert TP=1) it is copied from and in which row
order, and the engine runs that plan on handles to the actor's own parameters
(mcore_rl.weight_sync.loaders.apply_shared). An expert slice `w13_weight[e]` comes from the local expert's
`linear_fc1.weight` ([gate; up] at expert TP 1: the same rows), `w2_weight[e]` from its `linear_fc2.weight`.

Not covered, and refused or caught by the name check: quantized checkpoints or engines, shared experts (Qwen2-MoE,
DeepSeek: the bridge refuses those architectures), an engine at TP > 1 or with expert parallelism or redundant
experts (w13_weight then holds other or more experts than the model: the check reports the slices not sent), and
MoE runner backends that pad or transpose the stacked experts (flashinfer_trtllm pads I to a multiple of 128,
triton_kernels stores them transposed: caught by the check unless H = 2I). Backends that permute the stacked
experts in place after loading (aiter on ROCm, AMX packing on CPUs with AMX, flashinfer_trtllm) keep the shapes;
SGLang's own tensor updates do not redo that permutation either, so no colocated sync layout serves them.
"""

from __future__ import annotations

from mcore_rl.bridge.maps import Dims, Entry, Kind, expand
from mcore_rl.models.arch import resolve_arch

# Architectures whose SGLang model classes were read for the layout above (the names bridge.maps uses).
ENGINE_LAYOUT_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE, at TP=1

_FUSED = {Kind.QKV: ("q_proj", "qkv_proj"), Kind.GATE_UP: ("gate_proj", "gate_up_proj")}
_STACKED = {Kind.GATE_UP: "w13_weight", Kind.ROW: "w2_weight"}  # FusedMoE's parameter per expert matrix kind


def expert_slice(stacked: str, expert: int) -> str:
    """The name of expert `expert`'s slice of a stacked engine parameter: `{stacked}[{expert}]`. No module name
    has a bracket, so the engine's loaders tell slices from parameters by it (loaders.split_slice)."""
    return f"{stacked}[{expert}]"


def unsupported_reason(hf: dict) -> str | None:
    """Why this checkpoint cannot be synced in the engine layout (None: it can)."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        return f"the checkpoint is quantized (quantization_config.quant_method={method!r})"
    try:
        arch = resolve_arch(hf).name
    except ValueError as e:
        return str(e)
    if arch not in ENGINE_LAYOUT_ARCHS:
        return (f"SGLang's parameter layout of architecture {arch!r} has not been verified (verified: "
                f"{', '.join(ENGINE_LAYOUT_ARCHS)})")
    return None


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def engine_tensors(entry: Entry, dims: Dims) -> list[tuple[str, tuple[int, ...]]]:
    """(engine name, engine shape) of the tensors one bridge entry becomes. Their elements, in order, are the
    entry's HF tensors back to back (in the entry's HF order) followed by zero padding, if any."""
    shapes = entry.hf_shapes(dims)
    if entry.expert is not None:
        # qwen3_moe `...mlp.experts.{e}.gate_proj.weight`, mixtral `...block_sparse_moe.experts.{e}.w1.weight`
        marker = f".experts.{entry.expert}."
        assert marker in entry.hf[0] and entry.kind in _STACKED, entry
        stacked = entry.hf[0].split(marker)[0] + ".experts." + _STACKED[entry.kind]
        rest = shapes[0][1:]
        assert all(s[1:] == rest for s in shapes), shapes
        return [(expert_slice(stacked, entry.expert), (sum(s[0] for s in shapes), *rest))]
    if entry.kind in _FUSED:
        part, fused = _FUSED[entry.kind]
        name = entry.hf[0]
        assert f".{part}." in name, name
        rest = shapes[0][1:]
        assert all(s[1:] == rest for s in shapes), shapes
        return [(name.replace(f".{part}.", f".{fused}."), (sum(s[0] for s in shapes), *rest))]
    if entry.kind == Kind.VOCAB:
        (rows, *rest), = shapes
        return [(entry.hf[0], (padded_vocab(rows), *rest))]
    return list(zip(entry.hf, shapes))


def shared_plan(chunks: list, hf: dict) -> tuple[list, list[list]]:
    """How an engine that holds handles to this rank's Megatron parameters fills its own from them (the "shared"
    sync layout, mcore_rl.weight_sync.loaders.apply_shared): (parameters, ops). Each op is
    [engine name, engine shape, index into parameters, rows], where rows is either the number of leading rows
    copied as they are (the rest of the engine tensor, vocabulary padding, is left alone) or the list of source
    rows, in engine order (fused q/k/v: Megatron interleaves them per query group, SGLang stacks q, k, v).

    Valid for a model held whole by this rank (TP=1, one pipeline stage, and for MoE models EP=1 and expert TP=1;
    ValueError otherwise). An MoE expert's matrices become one op each, on its slice `{stacked}[e]` of SGLang's
    stacked expert parameter. The row orders come from bridge.transforms.from_shards applied to row numbers, so
    this plan and the HF export cannot disagree.
    """
    import torch

    from mcore_rl.bridge.bind import bind
    from mcore_rl.bridge.transforms import from_shards

    dims = Dims.from_hf(hf)
    params, ops = [], []
    for b in bind(chunks, hf):
        if not b.entry.export:
            continue
        (name, shape), = engine_tensors(b.entry, dims)
        p = b.param
        if tuple(shape[1:]) != tuple(p.shape[1:]) or (b.entry.kind == Kind.ROW and tuple(shape) != tuple(p.shape)):
            raise ValueError(f"{name}: engine shape {tuple(shape)} does not follow from the Megatron parameter "
                             f"{b.name} {tuple(p.shape)}; the shared layout needs an actor at TP=1 and PP=1 (MoE: "
                             "expert TP=1)")
        if b.entry.kind in (Kind.QKV, Kind.GATE_UP, Kind.VOCAB):
            order = torch.cat(from_shards(b.entry.kind, [torch.arange(p.shape[0])], dims))
        else:
            order = torch.arange(p.shape[0])
        hf_rows = sum(s[0] for s in b.entry.hf_shapes(dims))
        if len(order) != hf_rows or hf_rows > shape[0]:
            raise ValueError(f"{name}: the Megatron parameter {b.name} {tuple(p.shape)} holds {len(order)} of its "
                             f"{hf_rows} rows; the shared layout needs an actor at TP=1 and PP=1 (MoE: expert TP=1)")
        rows = len(order) if torch.equal(order, torch.arange(len(order))) else order.tolist()
        ops.append([name, list(shape), len(params), rows])
        params.append(p)
    wanted = sum(1 for e in expand(hf) if e.export)
    if len(ops) != wanted:  # expert parallelism: the experts of other EP ranks are not here (bind skips them)
        raise ValueError(f"this rank holds {len(ops)} of the model's {wanted} exported parameters; the shared layout "
                         "needs an actor held whole by one rank (parallel.tp=1, pp=1, ep=1, etp=1)")
    return params, ops
