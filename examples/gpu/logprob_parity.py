"""Where the rollout engine's and the trainer's log-probs part, on the same tokens.

SGLang samples responses (temperature 1, a fixed number of new tokens) and returns their log-probs; then, teacher
forced on the same sequences: the trainer's model (this project's Megatron build, the model dtype), the same with
SGLang's expert routes replayed (mixture-of-experts models), and HF transformers in fp32 and in the model dtype.

    python examples/gpu/logprob_parity.py --model /tmp/moe_tok --json parity.json    # on a GPU: bf16
    python examples/gpu/logprob_parity.py --model tiny-moe --json parity.json         # CPU smoke run: fp32

For each pair, the mean and max |difference| over response tokens. Reading it: `sglang~hf_fp32` and
`trainer~hf_fp32` say which side drifts from the exact values; `hf_<dtype>~hf_fp32` is what the dtype alone costs
with HF's kernels; `trainer_replay~sglang` is what is left once both use the same experts; `route_agreement` is
the share of (token, layer) pairs where the trainer's own top-k equals the experts SGLang used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TINY = {"tiny": "qwen2", "tiny-moe": "qwen3_moe"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF folder, or tiny / tiny-moe (made here, random)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64, help="new tokens a sample (ignore_eos)")
    ap.add_argument("--dtype", default=None, help="bf16 on a GPU, fp32 on CPU unless given")
    ap.add_argument("--rollout-attention", default="triton", help="SGLang's attention backend on a GPU")
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-spread", type=float, default=1.0,
                    help="tiny-moe only: move each router's expert rows to this fraction of their distance from "
                         "their mean (< 1: the experts' logits differ by less, relative to their size; near-ties "
                         "that the two sides' numerics flip)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    d = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b)])
    return {"mean": float(d.mean()), "max": float(d.max())}


def hf_logprobs(path: str, seqs: list[list[int]], starts: list[int], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Teacher-forced log-probs of each sequence's tokens from `starts[i]` on, by transformers in `dtype`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for ids, start in zip(seqs, starts):
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
            out.append(lp[start - 1:].cpu())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def narrow_routers(path: str, spread: float) -> None:
    """Each MoE router (`...mlp.gate.weight`, [experts, hidden]) of the HF folder, in place: rows -> their mean +
    spread x (row - mean). Scaling a router alone would not do: it scales the logits and their differences alike."""
    import glob

    from safetensors.torch import load_file, save_file

    for f in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith("mlp.gate.weight"):
                mean = w.mean(dim=0, keepdim=True)
                tensors[name] = (mean + spread * (w - mean)).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})


def main(argv=None) -> dict:
    args = parse_args(argv)
    from mcore_rl.bench.common import random_prompts, start_engine
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, make_micro_batches
    from mcore_rl.engine.batching import unpack
    from mcore_rl.engine.forward_backward import ROUTES
    from mcore_rl.models import build_model, load_hf_config
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.testing import capture_routing_maps
    from mcore_rl.trainer.batch import token_routes

    cuda = torch.cuda.is_available()
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    scratch = tempfile.TemporaryDirectory()
    path = args.model
    if path in TINY:
        from mcore_rl.testing import make_tiny_hf_model

        path = str(make_tiny_hf_model(os.path.join(scratch.name, path), TINY[path], seed=args.seed))
        if args.router_spread != 1.0:
            narrow_routers(path, args.router_spread)
    hf = load_hf_config(path)
    moe = bool(hf.get("num_experts") or hf.get("num_local_experts"))
    result: dict = {"model": args.model, "dtype": dtype, "moe": moe, "router_spread": args.router_spread,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "prompts": args.prompts,
                    "prompt_len": args.prompt_len, "new_tokens": args.new}

    # 1. SGLang samples, with its log-probs (and routes)
    overrides = dict(dtype=dtype, return_routed_experts=moe)
    if cuda:
        overrides.update(attention_backend=args.rollout_attention, mem_fraction_static=args.mem_fraction_static)
    engine = start_engine(path, 8192, **overrides)
    try:
        prompts = random_prompts(args.prompts, args.prompt_len, hf["vocab_size"], seed=args.seed)
        samples = engine.generate(prompts, n=1, sampling=engine.default_sampling(
            temperature=1.0, max_new_tokens=args.new, ignore_eos=True)).samples
    finally:
        engine.shutdown()
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    starts = [len(s.prompt_ids) for s in samples]
    lps = {"sglang": [torch.tensor(s.rollout_logprobs) for s in samples]}

    # 2. the trainer's model, own routing and (MoE) SGLang's routes replayed; one sequence a micro batch
    initialize(ParallelConfig())
    try:
        cfg = ModelConfig(path=path, dtype=dtype, attention="sdpa", max_seq_len=max(map(len, seqs)) + 8,
                          lm_head="all", moe_routing_replay=moe)
        built = build_model(hf, cfg, ParallelConfig())
        load_hf_weights(built.chunks, path, hf)
        trainer = TrainEngine(hf, cfg, ParallelConfig(), None, model=built)
        chosen = capture_routing_maps(trainer.model_chunks) if moe else None

        def trainer_logprobs(routes=None, engine=trainer):
            batch = [{"input_ids": torch.tensor(ids), "loss_mask": torch.ones(len(ids))} for ids in seqs]
            if routes is not None:
                for seq, r in zip(batch, routes):
                    seq[ROUTES] = r
            mbs = make_micro_batches(batch, micro_batch_size=1)
            per_seq = unpack([o["logprobs"] for o in engine.compute_logprobs(mbs)], mbs)
            return [lp[start:].float().cpu() for lp, start in zip(per_seq, starts)]

        lps["trainer"] = trainer_logprobs()
        if moe:
            routes = token_routes(samples)
            result["route_agreement"] = _agreement(chosen, routes)
            chosen.clear()
            lps["trainer_replay"] = trainer_logprobs(routes)
        del trainer, built, trainer_logprobs
        if cuda:
            torch.cuda.empty_cache()
    finally:
        destroy()

    # 3. transformers, fp32 and the model dtype
    device = torch.device("cuda" if cuda else "cpu")
    lps["hf_fp32"] = hf_logprobs(path, seqs, starts, torch.float32, device)
    if dtype != "fp32":
        lps[f"hf_{dtype}"] = hf_logprobs(path, seqs, starts, torch.bfloat16 if dtype == "bf16" else torch.float16,
                                         device)
    names = list(lps)
    result["gaps"] = {f"{a}~{b}": gap(lps[a], lps[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    result["logprob_mean"] = float(torch.cat(lps["hf_fp32"]).mean())
    for pair, g in result["gaps"].items():
        print(f"{pair:28s} mean {g['mean']:.3e}  max {g['max']:.3e}")
    if moe:
        print(f"route agreement (trainer's own top-k == SGLang's): {result['route_agreement']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    scratch.cleanup()
    return result


def _agreement(chosen: dict[int, list[torch.Tensor]], routes: list[torch.Tensor]) -> float:
    """Share of (token, layer) pairs, over every token but each sequence's last (which the engine never ran),
    where the routing map's experts equal the given routes."""
    same = total = 0
    for layer, maps in chosen.items():
        for rmap, r in zip(maps, routes):
            mine = rmap.cpu().nonzero()[:, 1].view(rmap.size(0), -1)[:-1].sort(dim=-1).values
            theirs = r[:-1, layer].long().sort(dim=-1).values
            same += int((mine == theirs).all(dim=-1).sum())
            total += mine.size(0)
    return same / max(total, 1)


if __name__ == "__main__":
    main()
