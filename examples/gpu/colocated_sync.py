"""GPU proof of the colocated path on one GPU: Megatron actor (bf16) + in-process SGLang engine.

    python examples/gpu/colocated_sync.py --out result.json [--attn triton|fa3] [--size 0.5b|tiny]

Builds a random model at Qwen2.5-0.5B dimensions, loads the same weights into the Megatron actor and SGLang,
then: generation throughput; the log-prob gap between SGLang's sampled-token log-probs and the actor's; one
policy-gradient step; the colocated weight sync (bridge export -> update_weights_from_tensor per bucket, CUDA
IPC); the gap again after the sync; engine memory release / resume and optimizer offload, with the memory they
free. Prints and writes the figures.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mcore_rl.bench.train import QWEN2_5_0_5B, TINY  # noqa: E402


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def free_gib():
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--attn", default="triton")
    ap.add_argument("--size", default="0.5b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    res = {}

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches, unpack
    from mcore_rl.parallel import initialize
    from mcore_rl.rollout.engine import RolloutEngine
    from mcore_rl.weight_sync import WeightSync

    hf = dict(QWEN2_5_0_5B if args.size == "0.5b" else TINY, tie_word_embeddings=True, torch_dtype="bfloat16")
    path = "/tmp/colocated_model"
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
    cfg = Qwen2Config(**{k: hf[k] for k in keys}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    hf = json.load(open(os.path.join(path, "config.json")))
    initialize(ParallelConfig(), hf)
    actor = TrainEngine(hf, ModelConfig(dtype="bf16", attention="sdpa", max_seq_len=1024), ParallelConfig(),
                        OptimConfig(lr=1e-5))
    load_hf_weights(actor.model_chunks, path, hf)
    actor.reload_master_weights()
    log("actor ready, free GiB", free_gib())

    rcfg = RolloutConfig(device="cuda", dtype="bf16", attention_backend=args.attn, sampling_backend="pytorch",
                         mem_fraction_static=0.35, enable_memory_saver=True, show_progress=False,
                         request_batch_size=args.prompts, max_new_tokens=args.new, ignore_eos=True,
                         extra_args={"cuda_graph_max_bs_decode": 64, "disable_prefill_cuda_graph": True})
    t = time.time()
    rollout = RolloutEngine(rcfg, path)
    res["engine_start_s"] = time.time() - t
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, hf["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()

    def generate():
        t = time.time()
        batch = rollout.generate(prompts, n=1)
        torch.cuda.synchronize()
        return batch.samples, time.time() - t

    generate()  # warm-up (compiles triton kernels)
    samples, dt = generate()
    ntok = sum(len(s.response_ids) for s in samples)
    res["generate_tokens_per_s"] = ntok / dt
    log("generate", ntok, "tokens in", dt, "s")

    def gap(samples):
        seqs = []
        for s in samples:
            ids = torch.tensor(s.prompt_ids + s.response_ids)
            mask = torch.zeros(len(ids))
            mask[len(s.prompt_ids):] = 1
            seqs.append({"input_ids": ids, "loss_mask": mask,
                         "adv": torch.randn(len(ids), generator=g).sign()})
        mbs = make_micro_batches(seqs, 16384)
        out = unpack([o["logprobs"] for o in actor.compute_logprobs(mbs)], mbs)
        diffs = torch.cat([(o[len(s.prompt_ids):].float().cpu() - torch.tensor(s.rollout_logprobs)).abs()
                           for o, s in zip(out, samples)])
        return mbs, float(diffs.mean()), float(diffs.max())

    mbs, res["logprob_gap_mean_before"], res["logprob_gap_max_before"] = gap(samples)
    # Train while the engine's memory is released, optimizer state offloaded while the engine generates.
    before = free_gib()
    rollout.release_memory()
    res["release_freed_gib"] = free_gib() - before
    n_tok = sum(mb["loss_mask"].sum().item() for mb in mbs)

    def loss_fn(out, mb):
        return -(out["logprobs"] * mb["adv"] * mb["loss_mask"]).sum() / n_tok, {}

    res["train_step_grad_norm"] = actor.train_step(mbs, loss_fn).grad_norm
    before = free_gib()
    actor.offload_optimizer()
    res["optimizer_offload_freed_gib"] = free_gib() - before
    t = time.time()
    rollout.resume_memory()
    res["resume_s"] = time.time() - t
    sync = WeightSync(WeightSyncConfig(), actor.model_chunks, hf, rollout, scratch_dir="/tmp/scratch", model_path=path)
    sync.sync()  # warm-up (plan + first transfer)
    torch.cuda.synchronize()
    t = time.time()
    sync.sync()
    torch.cuda.synchronize()
    res["sync_s"] = time.time() - t
    res["sync_gb"] = sync.last_bytes / 1e9
    res["sync_gb_per_s"] = res["sync_gb"] / res["sync_s"]
    samples2, _ = generate()
    _, res["logprob_gap_mean_after_sync"], res["logprob_gap_max_after_sync"] = gap(samples2)
    actor.onload_optimizer()
    res["weight_version"] = rollout.weight_version
    log(json.dumps(res, indent=1))
    json.dump(res, open(args.out, "w"), indent=1)
    rollout.shutdown()


if __name__ == "__main__":
    main()
