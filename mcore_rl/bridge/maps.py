"""Per-architecture maps between HF tensors and Megatron-Core GPTModel parameters. Pure: no torch, no process groups.

A map is a table of `Rule`s: which HF tensors (one, or several fused into one Megatron parameter), which Megatron
parameter (candidate names: Megatron's local layer spec and its Transformer Engine spec name the layer norms
differently), how the parameter is split over tensor-parallel ranks (`Kind`), and the HF shapes in config symbols.
The table is chosen by mcore_rl.models.arch.resolve_arch from config.json (`architectures` / `model_type`).

    entries = expand(hf_config)            # every HF <-> Megatron pair of the whole model, in HF order
    dims = Dims.from_hf(hf_config)
    entry.hf_shapes(dims)                  # [(4096, 4096), (1024, 4096), (1024, 4096)] for a fused q, k, v

Mixture-of-experts layers (Qwen3-MoE, Mixtral) have one rule per expert matrix, expanded into one entry per global
expert `e` (`Entry.expert`): HF `mlp.experts.{e}.{gate,up,down}_proj.weight` (Mixtral
`block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`) <-> Megatron `mlp.experts.local_experts.{k}.linear_fc{1,2}.weight`
(SequentialMLP; TEGroupedMLP names them `mlp.experts.linear_fc{1,2}.weight{k}`), where `k` is the expert's index on
the expert-parallel rank that holds it (mcore_rl.bridge.bind reads it from the layer). Expert matrices are split
over the expert tensor-parallel group (parallel.etp) like their dense counterparts; the router is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mcore_rl.models.arch import resolve_arch


class Kind(str, Enum):
    """How a Megatron parameter relates to its HF tensors across tensor-parallel (TP) ranks."""

    REPLICATED = "replicated"  # norms: every TP rank holds the whole tensor
    ROW = "row"  # row-parallel linear (attention output, MLP down): split along dim 1, the input features
    VOCAB = "vocab"  # embedding / output layer: vocab zero-padded to a multiple of TP, split along dim 0
    QKV = "qkv"  # q, k, v fused as [q heads of group g, k_g, v_g] per query group, groups split over TP
    GATE_UP = "gate_up"  # gate and up fused as [gate_r; up_r] on each TP rank r


class Where(str, Enum):
    PRE = "pre"  # first pipeline stage (pre_process chunk)
    LAYER = "layer"  # the chunk holding the decoder layer
    POST = "post"  # last pipeline stage (post_process chunk)


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF names; "{i}" is the global layer index
    mcore: tuple[str, ...]  # Megatron names (relative to decoder.layers.{local} for layer rules); first found wins
    kind: Kind
    shapes: tuple[tuple[str, ...], ...]  # HF shape of each hf name in Dims symbols (see Dims.size)
    expert: bool = False  # one entry per expert: "{e}" in hf names is the global expert, "{k}" in mcore the local


@dataclass(frozen=True)
class Dims:
    """Model sizes from config.json, named by the symbols rules use for shapes."""

    hidden: int
    ffn: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab: int
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    expert_ffn: int = 0  # intermediate size of one expert

    @classmethod
    def from_hf(cls, hf: dict) -> "Dims":
        heads = hf["num_attention_heads"]
        arch = resolve_arch(hf)
        moe_dims = {}
        if arch.moe:
            from mcore_rl.models.moe import expert_ffn, num_experts

            moe_dims = dict(num_experts=num_experts(hf), expert_ffn=expert_ffn(hf, arch))
        return cls(
            hidden=hf["hidden_size"],
            ffn=hf["intermediate_size"],
            num_heads=heads,
            num_groups=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab=hf["vocab_size"],
            **moe_dims,
        )

    def size(self, symbol: str) -> int:
        return {
            "h": self.hidden,
            "f": self.ffn,
            "q": self.num_heads * self.head_dim,
            "kv": self.num_groups * self.head_dim,
            "d": self.head_dim,
            "v": self.vocab,
            "E": self.num_experts,
            "e": self.expert_ffn,
        }[symbol]


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter and its HF tensors, with concrete names."""

    hf: tuple[str, ...]
    mcore: tuple[str, ...]  # candidates; layer entries are relative to decoder.layers.{local}
    kind: Kind
    where: Where
    layer: int | None  # global layer index for Where.LAYER
    shapes: tuple[tuple[str, ...], ...]
    export: bool = True  # False for the last stage's copy of a tied embedding: loaded, never exported
    expert: int | None = None  # global expert index of an expert matrix; mcore names then hold "{k}" (local index)

    def hf_shapes(self, dims: Dims) -> list[tuple[int, ...]]:
        return [tuple(dims.size(s) for s in shape) for shape in self.shapes]


def _layer_rules(qkv_bias: bool, qk_norm: bool, mlp: str = "dense") -> tuple[Rule, ...]:
    """The decoder layer of the Llama family. Names relative to model.layers.{i} / decoder.layers.{local}.
    mlp: "dense", or the MoE block of "qwen3_moe" / "mixtral" (_moe_rules)."""
    p = "model.layers.{i}."
    attn = p + "self_attn."
    rules = [
        Rule((p + "input_layernorm.weight",),
             ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), Kind.REPLICATED, (("h",),)),
        Rule((attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
             ("self_attention.linear_qkv.weight",), Kind.QKV, (("q", "h"), ("kv", "h"), ("kv", "h"))),
    ]
    if qkv_bias:
        rules.append(Rule((attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                          ("self_attention.linear_qkv.bias",), Kind.QKV, (("q",), ("kv",), ("kv",))))
    if qk_norm:
        rules += [
            Rule((attn + "q_norm.weight",), ("self_attention.q_layernorm.weight",), Kind.REPLICATED, (("d",),)),
            Rule((attn + "k_norm.weight",), ("self_attention.k_layernorm.weight",), Kind.REPLICATED, (("d",),)),
        ]
    rules += [
        Rule((attn + "o_proj.weight",), ("self_attention.linear_proj.weight",), Kind.ROW, (("h", "q"),)),
        Rule((p + "post_attention_layernorm.weight",),
             ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), Kind.REPLICATED, (("h",),)),
    ]
    if mlp != "dense":
        return tuple(rules) + _moe_rules(mlp)
    rules += [
        Rule((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
             ("mlp.linear_fc1.weight",), Kind.GATE_UP, (("f", "h"), ("f", "h"))),
        Rule((p + "mlp.down_proj.weight",), ("mlp.linear_fc2.weight",), Kind.ROW, (("h", "f"),)),
    ]
    return tuple(rules)


# HF names of the MoE block: (router, expert prefix, gate, up, down), relative to model.layers.{i}.
_MOE_HF = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1", "w3", "w2"),
}


def _moe_rules(style: str) -> tuple[Rule, ...]:
    """Router and per-expert SwiGLU matrices. Megatron names: SequentialMLP first, TEGroupedMLP second."""
    router, expert, gate, up, down = _MOE_HF[style]
    p = "model.layers.{i}."
    e = p + expert
    return (
        Rule((p + router,), ("mlp.router.weight",), Kind.REPLICATED, (("E", "h"),)),
        Rule((e + gate + ".weight", e + up + ".weight"),
             ("mlp.experts.local_experts.{k}.linear_fc1.weight", "mlp.experts.linear_fc1.weight{k}"),
             Kind.GATE_UP, (("e", "h"), ("e", "h")), expert=True),
        Rule((e + down + ".weight",),
             ("mlp.experts.local_experts.{k}.linear_fc2.weight", "mlp.experts.linear_fc2.weight{k}"),
             Kind.ROW, (("h", "e"),), expert=True),
    )


EMBEDDING = Rule(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), Kind.VOCAB, (("v", "h"),))
FINAL_NORM = Rule(("model.norm.weight",), ("decoder.final_layernorm.weight",), Kind.REPLICATED, (("h",),))
LM_HEAD = Rule(("lm_head.weight",), ("output_layer.weight",), Kind.VOCAB, (("v", "h"),))


@dataclass(frozen=True)
class ArchMap:
    name: str
    layer: tuple[Rule, ...]


# The declarative table: one map per architecture in mcore_rl.models.arch.ARCHS.
ARCH_MAPS = {
    "llama": ArchMap("llama", _layer_rules(qkv_bias=False, qk_norm=False)),
    "mistral": ArchMap("mistral", _layer_rules(qkv_bias=False, qk_norm=False)),
    "qwen2": ArchMap("qwen2", _layer_rules(qkv_bias=True, qk_norm=False)),
    "qwen3": ArchMap("qwen3", _layer_rules(qkv_bias=False, qk_norm=True)),
    "qwen3_moe": ArchMap("qwen3_moe", _layer_rules(qkv_bias=False, qk_norm=True, mlp="qwen3_moe")),
    "mixtral": ArchMap("mixtral", _layer_rules(qkv_bias=False, qk_norm=False, mlp="mixtral")),
}

# HF tensors that carry no weights (buffers some older checkpoints saved).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def arch_map(hf: dict) -> ArchMap:
    """The map for this config.json; ValueError listing the supported architectures otherwise."""
    return ARCH_MAPS[resolve_arch(hf).name]


def tied(hf: dict) -> bool:
    return bool(hf.get("tie_word_embeddings", False))


def expand(hf: dict) -> list[Entry]:
    """Every entry of the whole model in HF order: embedding, layers 0..L-1, final norm, output layer.

    With tied embeddings HF stores only model.embed_tokens.weight; the last pipeline stage's copy of it (Megatron's
    output_layer.weight when that stage has no embedding) is an entry that is loaded but never exported.
    """
    amap = arch_map(hf)
    num_experts = Dims.from_hf(hf).num_experts
    entries = [Entry(EMBEDDING.hf, EMBEDDING.mcore, EMBEDDING.kind, Where.PRE, None, EMBEDDING.shapes)]
    for i in range(hf["num_hidden_layers"]):
        for r in amap.layer:
            if not r.expert:
                entries.append(Entry(tuple(n.format(i=i) for n in r.hf), r.mcore, r.kind, Where.LAYER, i, r.shapes))
                continue
            for e in range(num_experts):
                entries.append(Entry(tuple(n.format(i=i, e=e) for n in r.hf), r.mcore, r.kind, Where.LAYER, i,
                                     r.shapes, expert=e))
    entries.append(Entry(FINAL_NORM.hf, FINAL_NORM.mcore, FINAL_NORM.kind, Where.POST, None, FINAL_NORM.shapes))
    if tied(hf):
        entries.append(Entry(EMBEDDING.hf, LM_HEAD.mcore, Kind.VOCAB, Where.POST, None, EMBEDDING.shapes,
                             export=False))
    else:
        entries.append(Entry(LM_HEAD.hf, LM_HEAD.mcore, LM_HEAD.kind, Where.POST, None, LM_HEAD.shapes))
    return entries


def expected_hf_tensors(hf: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor an HF checkpoint of this config must hold."""
    dims = Dims.from_hf(hf)
    out = {}
    for e in expand(hf):
        for name, shape in zip(e.hf, e.hf_shapes(dims)):
            out[name] = shape
    return out


def allowed_extra(hf: dict, name: str) -> bool:
    """HF tensors a checkpoint may hold beyond the map without being 'unexpected'."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    # Some tied checkpoints also store the (identical) output weight; the embedding is the source of truth.
    return tied(hf) and name == "lm_head.weight"


def resolve_name(candidates: tuple[str, ...], present) -> str | None:
    """First candidate present in `present` (a container of Megatron names), or None."""
    for name in candidates:
        if name in present:
            return name
    return None
