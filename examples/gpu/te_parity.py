"""Transformer Engine's layer spec against Megatron-Core's local spec (torch SDPA) on one GPU, both in bf16, with HF
transformers in fp32 as the reference: the same HF weights loaded into each, the same token ids, full-vocab logits.

    python3 examples/gpu/te_parity.py --model smollm2 --json te_parity.json      # or an HF folder

Passes when TE's largest logit error against HF fp32 is at most `--tol-factor` (default 1.5) times the local spec's
own, i.e. TE is as close to the fp32 model as the bf16 SDPA path already is (bf16 rounding, not a wrong layer).
Then one optimizer step of the TE model (forward + backward + Adam) checks that it trains. Needs CUDA and TE.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def megatron_logits(path: str, hf: dict, attention: str, ids: torch.Tensor, train_step: bool = False) -> dict:
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.builder import build_model

    built = build_model(hf, ModelConfig(dtype="bf16", attention=attention, max_seq_len=4096, lm_head="all"),
                        ParallelConfig())
    load_hf_weights(built.chunks, path, hf)
    model = built.chunks[0]
    model.eval()
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)[..., :hf["vocab_size"]].float()
    out = {"logits": logits, "layer": ",".join(sorted({type(m).__name__ for n, m in model.named_modules()
                                                       if n.endswith("core_attention")}))}
    if train_step:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        losses = []
        for _ in range(2):  # the second loss must be lower: the step moved the weights the right way
            out_logits = model(ids, pos, attention_mask=None)[..., :hf["vocab_size"]].float()
            loss = torch.nn.functional.cross_entropy(out_logits[:, :-1].reshape(-1, out_logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        out["train_losses"] = losses
    del model, built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="an HF folder, or smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tol-factor", type=float, default=1.5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", default="te", choices=("te", "sdpa"), help="sdpa: a CPU smoke run of the script")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.models.smollm2 import resolve_model_path
    from mcore_rl.parallel import destroy, initialize

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    path = resolve_model_path(args.model)
    hf = load_hf_config(path)
    initialize(ParallelConfig(), hf)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, hf["vocab_size"] - 1, (args.batch, args.seq_len), generator=g).to(dev)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    del ref_model
    local = megatron_logits(path, hf, "sdpa", ids)
    te = megatron_logits(path, hf, args.compare, ids, train_step=True)
    err_local = (local["logits"] - ref).abs().max().item()
    err_te = (te["logits"] - ref).abs().max().item()
    result = {
        "model": args.model, "shape": [args.batch, args.seq_len], "logit_abs_max": ref.abs().max().item(),
        "local_spec_core_attention": local["layer"], "te_spec_core_attention": te["layer"],
        "local_bf16_vs_hf_fp32_max_abs": err_local, "te_bf16_vs_hf_fp32_max_abs": err_te,
        "te_vs_local_max_abs": (te["logits"] - local["logits"]).abs().max().item(),
        "te_vs_local_mean_abs": (te["logits"] - local["logits"]).abs().mean().item(),
        "argmax_agreement_te_local": (te["logits"].argmax(-1) == local["logits"].argmax(-1)).float().mean().item(),
        "te_train_losses": te["train_losses"], "tol_factor": args.tol_factor,
    }
    result["pass"] = bool(err_te <= args.tol_factor * err_local and te["train_losses"][1] < te["train_losses"][0])
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    destroy()
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
