"""Small, offline stand-ins for real checkpoints: a trained-on-the-fly BPE tokenizer with a chat template and
tiny randomly initialised HF models of every supported architecture; `unequal`, what differs between two sets
of tensors, for the reports of multi-process test workers (names and sizes, not a bare boolean).

Tests, the benchmark tool and examples use these because nothing can be downloaded from the HuggingFace Hub on
CI machines. Everything is seeded, so a given call produces the same files every time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "What is 12 + 7? The answer is 19. #### 19",
    "Compute 3 * 4 - 5. We get 7. #### 7",
    "the quick brown fox jumps over the lazy dog",
    "Use the numbers 3 5 7 to reach 22: <answer>3*5+7</answer>",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) \\boxed{42}",
    "user assistant system please think step by step and give the final answer",
]


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 512):
    """Train a byte-level BPE of `vocab_size` tokens, save it under `path`, and return it.

    Special tokens: <|end|> (eos), <|pad|>, and the role markers of CHAT_TEMPLATE.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return fast


# Per-architecture tiny configs. Head counts are chosen so that TP=2 divides both heads and query groups and
# grouped-query attention is exercised (4 heads, 2 kv heads).
_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Mixture-of-experts: 4 experts, top-2, so expert parallelism of 2 splits them and routing is not trivial.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
}

SUPPORTED_TINY_ARCHS = tuple(_ARCH)


def tiny_config(arch: str, vocab_size: int = 512, tied: bool = False, **overrides):
    import transformers

    if arch not in _ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH)}")
    cfg_name, _, extra = _ARCH[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        torch_dtype="float32",
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    return getattr(transformers, cfg_name)(**kwargs)


def make_tiny_hf_model(
    path: str | os.PathLike,
    arch: str = "qwen2",
    tied: bool = False,
    seed: int = 0,
    vocab_size: int = 512,
    **overrides,
) -> Path:
    """Write a tiny random HF causal LM (config, safetensors, tokenizer) to `path` and return the path.

    Weights are drawn with a larger std than HF's default init so logits are far from uniform and greedy
    decoding is not dominated by ties.
    """
    import torch
    import transformers

    path = Path(path)
    tok = make_tiny_tokenizer(path)
    # The embedding is larger than the tokenizer (as in real checkpoints), which also exercises vocab padding.
    if vocab_size < len(tok):
        raise ValueError(f"vocab_size ({vocab_size}) must be at least the tokenizer's size ({len(tok)})")
    cfg = tiny_config(arch, vocab_size=vocab_size, tied=tied, **overrides)
    cfg.eos_token_id = tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[arch][1])(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            else:  # norm weights: keep near one but not exactly, so a swapped norm shows up
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def unequal(a: Mapping[str, "torch.Tensor"], b: Mapping[str, "torch.Tensor"]) -> dict[str, float | str]:
    """name -> max |a - b| (float) for each tensor of `a` not exactly equal to b's, or why they cannot be
    compared (missing in b, shapes). {} when every tensor of `a` equals b's bit for bit."""
    import torch

    out: dict[str, float | str] = {}
    for name, x in a.items():
        y = b.get(name)
        if y is None:
            out[name] = "missing"
        elif x.shape != y.shape:
            out[name] = f"shape {list(x.shape)} vs {list(y.shape)}"
        elif not torch.equal(x, y):
            out[name] = (x.detach().double() - y.detach().double()).abs().max().item()
    return out


def listed(tensors) -> dict[str, "torch.Tensor"]:
    """An unnamed sequence of tensors, named by position ("0", "1", ...), for unequal()."""
    return {str(i): t for i, t in enumerate(tensors)}


def capture_routing_maps(chunks) -> dict[int, list["torch.Tensor"]]:
    """Forward hooks on every Megatron MoE router of `chunks`: each call's routing map ([tokens, experts] bool, a
    detached copy on the router's device), by layer index (0-based), in call order. The caller clears the dict
    between passes it wants apart."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen: dict[int, list] = {}

    def hook(router, args, output):
        seen.setdefault(router.layer_number - 1, []).append(output[1].detach().clone())

    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(hook)
    return seen
