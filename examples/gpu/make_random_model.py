"""Write a random HF model folder (bf16 safetensors) at the dimensions of mcore_rl.bench.train.MODELS, for GPU
benchmarks without hub downloads:

    python examples/gpu/make_random_model.py --size 1.5b --out /tmp/model_1.5b
    python examples/gpu/make_random_model.py --size qwen3-moe-2b --out /tmp/moe_2b
    python tools/bench_throughput.py --json all.json all --model /tmp/model_1.5b --train-model none ...
    # a folder the trainer can run (tools/train_ppo.py model.path=...): another folder's tokenizer, its vocabulary
    python examples/gpu/make_random_model.py --size qwen3-moe-2b --tokenizer smollm2 --out /tmp/moe_2b_tok

Qwen2 sizes tie embeddings, as in the released Qwen2.5-0.5B / 1.5B / 3B (the released 7B is untied). Same recipe
as colocated_sync.py (seed 0). The MoE sizes are Qwen3-MoE folders (untied, as the released ones), with HF's
initialisation (std 0.02), so the router's choices are spread over the experts.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.bench.train import MODELS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.5b", help="0.5b | 1.5b | 3b | 7b | tiny | qwen3-moe-2b | tiny-moe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=None,
                    help="copy this HF folder's tokenizer (or smollm2's) and take its vocabulary size and special ids")
    args = ap.parse_args()
    import transformers

    name = args.size if args.size in MODELS else f"qwen2.5-{args.size}"
    if name not in MODELS:
        raise SystemExit(f"--size {args.size!r}: choose one of 0.5b, 1.5b, 3b, 7b, {', '.join(MODELS)}")
    hf = MODELS[name]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta")
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tokenizer = None
    if args.tokenizer:
        from mcore_rl.models.smollm2 import resolve_model_path

        src = resolve_model_path(args.tokenizer)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src)
        hf = dict(hf, vocab_size=len(tokenizer))
        src_cfg = transformers.AutoConfig.from_pretrained(src)  # its model's special ids, as the trainer reads them
        special = {k: getattr(src_cfg, k, None) for k in special}
    if hf["model_type"] == "qwen3_moe":
        moe_keys = ("head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                    "decoder_sparse_step", "mlp_only_layers")
        cfg = transformers.Qwen3MoeConfig(**{k: hf[k] for k in keys + moe_keys}, tie_word_embeddings=False,
                                          **special)
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen2Config(**{k: hf[k] for k in keys}, tie_word_embeddings=True, **special)
        model_cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters")


if __name__ == "__main__":
    main()
