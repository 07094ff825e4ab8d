"""Profile the training update against the raw Megatron step on a GPU (torch.profiler), and check the fast
paths (one-kernel packed attention, fused log-probs) against the reference paths on that GPU.

    python -m mcore_rl.bench.profile_train --model qwen2.5-0.5b --out DIR

Writes DIR/profile_train.json (correctness checks, interleaved step times per variant) and
DIR/profile_tables.txt (top CUDA-time ops of one step of each variant and of the raw step). Variants are
"attention impl : log-prob impl": loop:off is the code as it was before the fast paths (one SDPA call per packed
sequence, a host sync per layer; fp32 torch log-probs), auto:auto the default now.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from mcore_rl.bench.common import sync, timed


def _table(prof, rows=30) -> str:
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return avg.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except Exception:  # the key's name changed across torch versions
            continue
    return avg.table(row_limit=rows)


def _device_busy_s(prof) -> float:
    """Sum of the GPU kernels' time in the profile (seconds; kernels and memcpys, not the CPU ops that launched
    them): the GPU's busy time, since one stream runs one kernel at a time here."""
    from torch.autograd import DeviceType

    total = 0.0
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None)
        total += t if t is not None else getattr(e, "self_cuda_time_total", 0.0)
    return total / 1e6


def check_paths(device) -> dict:
    """Max abs differences between the fast paths and the reference paths on this device."""
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_rl.engine import logprobs as lp
    from mcore_rl.models import attention as att

    out = {}
    torch.manual_seed(0)
    # attention: 14 heads, 2 groups, d 64, variable lengths + trailing padding segment
    cfg = TransformerConfig(num_layers=1, hidden_size=14 * 64, num_attention_heads=14, num_query_groups=2,
                            kv_channels=64, attention_dropout=0.0)
    tp_one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    attns = {impl: att.SDPAttention(cfg, 1, None, "self", pg_collection=tp_one, packed_impl=impl).to(device)
             for impl in ("loop", "padded", "varlen")}
    for name, lengths in (("uniform", [512] * 4), ("variable", [300, 17, 700, 1, 229])):
        t = sum(lengths)
        cu = torch.tensor([0] + list(att._cumsum(lengths)), dtype=torch.int32, device=device)
        base = [torch.randn(t, h, 64, device=device, dtype=torch.bfloat16) for h in (14, 2, 2)]
        grads = {}
        outs = {}
        for impl in ("loop", "padded", "varlen"):
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
            q, k, v = (x.clone().requires_grad_() for x in base)
            o = attns[impl](q, k, v, None, packed_seq_params=params)
            g = torch.randn_like(o, generator=None) if not grads else grads["g"]
            grads["g"] = g
            o.backward(g)
            outs[impl] = (o.float(), q.grad.float(), k.grad.float(), v.grad.float())
        for impl in ("padded", "varlen"):
            out[f"attn.{name}.{impl}_vs_loop.max_abs_out"] = (outs[impl][0] - outs["loop"][0]).abs().max().item()
            out[f"attn.{name}.{impl}_vs_loop.max_abs_grad"] = max(
                (a - b).abs().max().item() for a, b in zip(outs[impl][1:], outs["loop"][1:]))
    # log-probs: 4096 rows x 151,936 (vocab 151,665 real), bf16 logits
    rows, V, vocab = 4096, 151936, 151665
    x = (torch.randn(rows, V, device=device) * 4).to(torch.bfloat16)
    tgt = torch.randint(0, vocab, (rows,), device=device)
    for T in (1.0, 0.7):
        for ent in (False, True):
            res = {}
            for mode in ("off", "auto"):
                lp.FUSED = mode
                a = x.clone().requires_grad_()
                lps, e = lp.vocab_parallel_logprobs(a, tgt, vocab, temperature=T, with_entropy=ent)
                g = torch.linspace(-1, 1, rows, device=device)
                loss = (lps * g).sum() + ((e * g.flip(0)).sum() if ent else 0)
                loss.backward()
                res[mode] = (lps, e, a.grad.float())
            key = f"logprobs.T{T}.entropy{int(ent)}"
            out[key + ".max_abs_logprob"] = (res["off"][0] - res["auto"][0]).abs().max().item()
            if ent:
                out[key + ".max_abs_entropy"] = (res["off"][1] - res["auto"][1]).abs().max().item()
            out[key + ".max_abs_grad"] = (res["off"][2] - res["auto"][2]).abs().max().item()
    lp.FUSED = "auto"
    # speed of the log-prob op alone at a train step's size (16k rows), forward + backward
    big = (torch.randn(16384, V, device=device) * 4).to(torch.bfloat16)
    tgt = torch.randint(0, vocab, (16384,), device=device)
    for mode in ("off", "auto"):
        lp.FUSED = mode

        def step():
            a = big.detach().requires_grad_()
            lps, _ = lp.vocab_parallel_logprobs(a, tgt, vocab)
            lps.sum().backward()

        step()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out[f"logprobs.16k_rows.{mode}.fwd_bwd_s"] = statistics.median(timed(step)[0] for _ in range(5))
        out[f"logprobs.16k_rows.{mode}.peak_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
    lp.FUSED = "auto"
    del x
    torch.cuda.empty_cache()
    return out


def _set_packed_attention(engine, impl: str) -> None:
    """Switch the live engine's SDPA layers to `impl` (ModelConfig.packed_attention) between variants: one engine
    for every variant keeps the weights and the memory layout the same."""
    from mcore_rl.models.attention import SDPAttention

    for chunk in engine.model_chunks:
        for module in chunk.modules():
            if isinstance(module, SDPAttention):
                module.packed_impl = impl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", default="loop:off,loop:auto,auto:off,auto:auto")
    p.add_argument("--out", default=".")
    args = p.parse_args()

    from mcore_rl.bench.train import (
        MODELS,
        RawMegatron,
        _pg_loss,
        _seqs,
        flops_per_token,
    )
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine import logprobs as lp
    from mcore_rl.engine.batching import make_micro_batches
    from mcore_rl.parallel import destroy, initialize

    os.makedirs(args.out, exist_ok=True)
    initialize(ParallelConfig())
    device = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"model": args.model, "torch": torch.__version__}
    result.update(check_paths(device))
    print(json.dumps(result, indent=1), flush=True)

    hf = MODELS[args.model]
    model_cfg = ModelConfig(dtype="bf16", attention="sdpa", max_seq_len=args.seq_len, lm_head="all")  # train's work
    n_seq = args.tokens // args.seq_len
    fixed = _seqs([args.seq_len] * n_seq, hf["vocab_size"], 0)
    ours = TrainEngine(hf, model_cfg, ParallelConfig(), OptimConfig(lr=1e-6, clip_grad=1.0))
    mbs = make_micro_batches(fixed, args.tokens)
    n_tok = sum(mb["loss_mask"].sum().item() for mb in mbs)
    raw = RawMegatron(hf, model_cfg, ParallelConfig())
    ids = torch.stack([s["input_ids"] for s in fixed]).to(raw.device)

    def our_step():
        ours.train_step(mbs, _pg_loss(n_tok))

    def raw_step():
        raw.step(ids)

    from torch.profiler import ProfilerActivity, profile

    tables = []
    fpt = flops_per_token(hf, args.seq_len)
    raw_times = []
    for variant in args.variants.split(","):
        impl, fused = variant.split(":")
        _set_packed_attention(ours, impl)
        lp.FUSED = fused
        for _ in range(2):
            our_step(), raw_step()
        t_ours, t_raw = [], []
        for _ in range(args.iters):
            t_ours.append(timed(our_step)[0])
            t_raw.append(timed(raw_step)[0])
        raw_times += t_raw
        mo, mr = statistics.median(t_ours), statistics.median(t_raw)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            our_step()
            sync()
        wall = timed(our_step)[0]
        result[f"{variant}.step_s"] = mo
        result[f"{variant}.raw_step_s"] = mr
        result[f"{variant}.ratio_vs_raw"] = mr / mo
        result[f"{variant}.mfu"] = args.tokens * fpt / mo / 772e12
        result[f"{variant}.profiled_device_busy_s"] = _device_busy_s(prof)
        tables.append(f"==== ours, attention={impl}, logprobs fused={fused}: step {mo:.4f} s (raw {mr:.4f} s, "
                      f"ratio {mr / mo:.3f}); profiled step kernels {_device_busy_s(prof):.4f} s, "
                      f"wall {wall:.4f} s\n" + _table(prof))
        print(tables[-1], flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        raw_step()
        sync()
    result["raw.step_s"] = statistics.median(raw_times)
    result["raw.mfu"] = args.tokens * fpt / result["raw.step_s"] / 772e12
    result["raw.profiled_device_busy_s"] = _device_busy_s(prof)
    tables.append(f"==== raw Megatron step: {result['raw.step_s']:.4f} s; profiled kernels "
                  f"{_device_busy_s(prof):.4f} s\n" + _table(prof))
    print(tables[-1], flush=True)
    _set_packed_attention(ours, model_cfg.packed_attention)
    lp.FUSED = "auto"
    with open(os.path.join(args.out, f"profile_train_{args.model}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"profile_tables_{args.model}.txt"), "w") as f:
        f.write("\n\n".join(tables))
    print(json.dumps(result, indent=1))
    destroy()


if __name__ == "__main__":
    main()
