"""Write a random HF Qwen2 model folder at Qwen2.5 dimensions (bf16 safetensors), for GPU benchmarks without hub
downloads:

    python examples/gpu/make_random_model.py --size 1.5b --out /tmp/model_1.5b
    python tools/bench_throughput.py --json all.json all --model /tmp/model_1.5b --train-model none ...

Embeddings are tied, as in the released Qwen2.5-0.5B / 1.5B / 3B (the released 7B is untied). Same recipe as
colocated_sync.py (seed 0).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.bench.train import MODELS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.5b", help="0.5b | 1.5b | 3b | 7b | tiny")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = MODELS["tiny" if args.size == "tiny" else f"qwen2.5-{args.size}"]
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta")
    cfg = Qwen2Config(**{k: hf[k] for k in keys}, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters")


if __name__ == "__main__":
    main()
