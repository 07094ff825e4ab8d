"""Throughput figures as ratios against the raw libraries doing the same work in the same run.

    python tools/bench_throughput.py --json out.json train --model qwen2.5-0.5b       # GPU
    python tools/bench_throughput.py train --model tiny --seq-len 64 --tokens 512     # CPU smoke
    python tools/bench_throughput.py rollout --model smollm2                          # HF folder: tiny|smollm2|path
    python tools/bench_throughput.py weight_sync --model smollm2
    torchrun --nproc_per_node 2 tools/bench_throughput.py weight_sync --model smollm2 # TP=2 export
    python tools/bench_throughput.py e2e --model smollm2
    python tools/bench_throughput.py checkpoint --model qwen2.5-0.5b --dtype fp32     # CPU
    python tools/bench_throughput.py --json out.json all --model tiny --train-model tiny --seq-len 64 --tokens 512 \\
        --prompts 2 --n 2 --prompt-len 8 --max-new-tokens 8 --repeats 1 --warmup 1      # CPU smoke of everything

Sub-benchmarks (each callable alone; `all` runs them in one process sharing one SGLang engine):
  train        actor update vs a raw Megatron-Core loop; packed vs padded (train.*; --model names model dims)
  rollout      RolloutEngine.generate vs the raw sglang.Engine it holds (rollout.ratio_vs_raw)
  weight_sync  export + colocated update vs a plain copy of the bytes (weight_sync.ratio_vs_copy, .gb_per_s)
  e2e          one GRPO step and its parts vs raw generation + raw update + plain copy (e2e.ratio_vs_raw_parts)
  multitask    a multi-task recipe vs each task alone: step time and peak memory (multitask.*; own processes)
  checkpoint   checkpoint save (both optimizer formats) vs torch.save of the same tensors (checkpoint.*)
Prints a table; --json writes the figures. Under torchrun only weight_sync runs (TP = the number of processes).
See docs/performance.md.
"""

import argparse
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: multitask runs its tools/ and conf/
sys.path.insert(0, ROOT)

ENGINE_BENCHES = ("rollout", "weight_sync", "e2e")


def _train_args(p, model_flag: str) -> None:
    p.add_argument(model_flag, dest="train_model", default="qwen2.5-0.5b",
                   help="qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-3b | qwen2.5-7b | tiny (`all --train-model none` "
                        "skips train)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--train-warmup", type=int, default=2)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--recompute", default="none")
    p.add_argument("--fast-optimizer", default="auto", choices=("auto", "on", "off"),
                   help="our engine's OptimConfig.fast_optimizer (fused AdamW, foreach multi-tensor paths); the raw "
                        "loop always runs Megatron's optimizer as shipped")
    p.add_argument("--fused-swiglu", default="auto", choices=("auto", "on", "off"),
                   help="ModelConfig.fused_swiglu for both sides (same model builder)")
    p.add_argument("--packed-rope", default="on", choices=("on", "off"),
                   help="ModelConfig.packed_rope for both sides: off = Megatron's per-sequence RoPE")
    p.add_argument("--compile-rope", default="off", choices=("off", "on", "auto"),
                   help="ModelConfig.compile_rope for both sides: torch.compile the packed RoPE rotation")
    p.add_argument("--train-lm-head", default="all", choices=("all", "loss_tokens"),
                   help="ModelConfig.lm_head of our update: all (the raw loop's work: logits at every position) or "
                        "loss_tokens (the trainer's default: only where the loss mask reads them; MFU then counts "
                        "the output layer only where it ran)")


def _attention_arg(p) -> None:
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "te"),
                   help="train, weight_sync, e2e: both sides' layer spec, Megatron's local spec with torch SDPA or "
                        "Transformer Engine's (an MoE's experts then run as TE's grouped GEMMs)")


def _engine_args(p) -> None:
    p.add_argument("--model", default="smollm2", help="HF folder: tiny (random, vocab 512) | smollm2 | a path")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout / step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256, help="every sample gets exactly this many (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--sync-layout", choices=("auto", "hf", "engine", "shared", "all"), default="auto",
                   help="weight_sync: how weights reach SGLang: the engine copies the actor's own parameters "
                        "(shared), buckets of its own parameters (engine), buckets of HF names (hf), what the "
                        "trainer picks (auto), or each possible one measured in one run (all; e2e then uses auto)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=4096)
    p.add_argument("--forward-max-tokens-per-micro-batch", type=int, default=0,
                   help="e2e: token budget of the forward-only passes' micro batches (0 = twice the update's, as "
                        "the trainer's actor.forward_max_tokens_per_micro_batch)")
    p.add_argument("--no-ref", action="store_true", help="e2e without the reference model's forward")
    p.add_argument("--forward-cuda-graphs", default="off", choices=("off", "on", "both"),
                   help="e2e: ModelConfig.forward_cuda_graphs of the actor and the reference (their forward-only "
                        "passes replayed from CUDA graphs); both: steps with and without graphs interleaved in one "
                        "run against the same raw parts (e2e.graphs.* are the graphed steps)")
    p.add_argument("--ref-compute-at", default="auto", choices=("auto", "forward", "update"),
                   help="e2e: the trainer's ref.compute_at; auto computes the reference log-probs in the update "
                        "where the reference runs from CUDA graphs, forward before it")
    p.add_argument("--lm-head", default="loss_tokens", choices=("loss_tokens", "all"),
                   help="e2e: ModelConfig.lm_head of the actor and the reference (the trainer's default: logits "
                        "only at response tokens); the raw update always computes them at every position")
    p.add_argument("--old-logprobs", choices=("auto", "recompute"), default="auto",
                   help="e2e: auto skips the old log-prob forward (one update a step: exactly on-policy, as the "
                        "trainer's actor.old_logprobs=auto); recompute runs it")
    p.add_argument("--rollout-mode", choices=("sync", "one_step_off_policy"), default="sync",
                   help="e2e: one_step_off_policy generates the next step's batch while this one trains, as "
                        "trainer.rollout_mode does (docs/async.md)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="e2e: one more step of each side under torch.profiler; per-phase wall and GPU busy time "
                        "(e2e.profile.*) and DIR/e2e_profile.txt with the top operators")
    p.add_argument("--sync-debug", action="store_true",
                   help="e2e, GPU only: one more step of ours and one raw update under torch's sync debug mode; "
                        "e2e.sync_debug.* count their host syncs and say where they come from")
    p.add_argument("--rollout-attention", default="triton", choices=("triton", "fa3", "auto"),
                   help="SGLang's attention backend on a GPU (auto: what rollout.attention_backend=auto picks)")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="SGLang KV cache tokens on CPU")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="SGLang's share of GPU memory (default 0.35; lower it for larger models colocated)")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the figures here")
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="actor update vs raw Megatron-Core")
    _train_args(train, "--model")
    _attention_arg(train)
    for name, helptext in (("rollout", "RolloutEngine.generate vs raw sglang.Engine.generate"),
                           ("weight_sync", "colocated weight sync vs a plain copy"),
                           ("e2e", "one GRPO step vs the sum of raw parts")):
        engine_bench = sub.add_parser(name, help=helptext)
        _engine_args(engine_bench)
        _attention_arg(engine_bench)
    mt = sub.add_parser("multitask", help="a multi-task run vs each of its tasks run alone (step time, memory)")
    mt.add_argument("--experiment", default="multitask_grpo_dpo", help="a recipe with `tasks:` (conf/experiment/)")
    mt.add_argument("--steps", type=int, default=4, help="steps per run (the first is not timed)")
    mt.add_argument("--nproc", type=int, default=2, help="torchrun processes per run")
    mt.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model.path=... tasks.0.batch_size=4")
    ck = sub.add_parser("checkpoint", help="checkpoint save vs torch.save of the same tensors")
    ck.add_argument("--model", default="qwen2.5-0.5b", help="model dims, as for train")
    ck.add_argument("--dtype", default="bf16")
    ck.add_argument("--repeats", type=int, default=3)
    ck.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    everything = sub.add_parser("all", help="train, rollout, weight_sync and e2e in one process")
    _engine_args(everything)
    _train_args(everything, "--train-model")
    _attention_arg(everything)
    return parser.parse_args()


def _progress(what: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"[bench_throughput] {what}", file=sys.stderr, flush=True)


def _save_partial(result: dict, json_path: str | None) -> None:
    """Write the figures so far to `json_path`.partial (rank 0), so a later sub-benchmark's failure keeps them."""
    if json_path and int(os.environ.get("RANK", 0)) == 0:
        with open(json_path + ".partial", "w") as f:
            json.dump(result, f, indent=1)


def run_engine_benches(args, names, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from mcore_rl.bench import common
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.parallel import initialize
    from mcore_rl.rollout.settings import gpu_attention_backend

    scratch = tempfile.TemporaryDirectory(prefix="bench_")  # the tiny model's folder; removed at exit
    path = common.model_folder(args.model, scratch.name) if int(os.environ.get("RANK", 0)) == 0 else None
    if world > 1:  # rank 0 made the folder; the others wait for it
        box = [path]
        initialize(ParallelConfig(tp=world))
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    hf = load_hf_config(path)
    parallel = ParallelConfig(tp=world)
    initialize(parallel, hf)
    result: dict = {"hf_model": args.model}
    _progress("starting the SGLang engine")
    overrides = {} if args.mem_fraction_static is None else {"mem_fraction_static": args.mem_fraction_static}
    if torch.cuda.is_available():
        overrides["attention_backend"] = args.rollout_attention
        result["rollout.attention_backend"] = (args.rollout_attention if args.rollout_attention != "auto" else
                                               gpu_attention_backend())
    engine = common.start_engine(path, args.max_total_tokens, **overrides) if dist.get_rank() == 0 else None
    try:
        prompts = common.random_prompts(args.prompts, args.prompt_len, hf["vocab_size"])
        if "rollout" in names:
            _progress("rollout")
            from mcore_rl.bench import rollout

            result.update(rollout.run(engine, prompts, args.n, args.max_new_tokens, args.repeats, args.warmup))
            _save_partial(result, args.json)
        # the actor's optimizer only where it trains (e2e): weight_sync alone then fits larger models
        graphs = getattr(args, "forward_cuda_graphs", "off")
        graphs_both = graphs == "both"
        if graphs_both:  # without a GPU the graphs' fixed layout runs eagerly (static): the same code path
            import torch

            graphs = "on" if torch.cuda.is_available() else "static"
        actor = (common.load_actor(path, hf, parallel, with_optimizer="e2e" in names, lm_head=args.lm_head,
                                   attention=args.attention, forward_cuda_graphs=graphs)
                 if {"weight_sync", "e2e"} & set(names) else None)
        if "weight_sync" in names:
            _progress("weight_sync")
            from mcore_rl.bench import weight_sync

            result.update(weight_sync.run(engine, actor.model_chunks, hf, args.bucket_mb << 20, args.repeats,
                                          args.warmup, layout=args.sync_layout))
            _save_partial(result, args.json)
        if "e2e" in names:
            _progress("e2e")
            from mcore_rl.bench import e2e

            ref = None if args.no_ref else common.load_actor(path, hf, parallel, with_optimizer=False,
                                                             lm_head=args.lm_head, attention=args.attention,
                                                             forward_cuda_graphs=graphs)
            result.update(e2e.run(engine, actor, ref, hf, prompts, args.n, args.max_new_tokens, args.bucket_mb << 20,
                                  args.max_tokens_per_micro_batch, args.repeats, args.warmup, args.old_logprobs,
                                  "auto" if args.sync_layout == "all" else args.sync_layout,
                                  args.forward_max_tokens_per_micro_batch, args.rollout_mode, args.profile,
                                  attention=args.attention, graphs_both=graphs_both,
                                  sync_debug=args.sync_debug, ref_compute_at=args.ref_compute_at))
        if args.json and os.path.exists(args.json + ".partial"):  # complete: main writes args.json
            os.remove(args.json + ".partial")
    finally:
        if engine is not None:
            engine.shutdown()
        scratch.cleanup()
    return result


def main() -> None:
    args = parse_args()
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.parallel import destroy, initialize

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and args.what != "weight_sync":
        raise ValueError(f"under torchrun ({world} processes) only weight_sync runs (TP={world}); run "
                         f"{args.what!r} as a plain `python tools/bench_throughput.py {args.what}`")
    result: dict = {}
    if args.what == "multitask":  # three training runs of their own (torchrun subprocesses)
        from mcore_rl.bench import multitask

        _progress("multitask: the recipe with all its tasks, then each task alone")
        result.update(multitask.run(ROOT, args.experiment, args.steps, args.nproc, args.overrides))
        _report(result, args.json)
        return
    try:
        if args.what == "checkpoint":
            from mcore_rl.bench import checkpoint

            _progress("checkpoint")
            initialize(ParallelConfig())
            result.update(checkpoint.run(args.model, args.dtype, args.repeats, args.dir))
        if args.what == "train" or (args.what == "all" and args.train_model != "none"):
            from mcore_rl.bench.train import run

            _progress("train")
            initialize(ParallelConfig())
            result.update(run(args.train_model, args.seq_len, args.tokens, args.iters, args.train_warmup, args.dtype,
                              recompute=args.recompute, fast_optimizer=args.fast_optimizer,
                              fused_swiglu=args.fused_swiglu, lm_head=args.train_lm_head,
                              packed_rope=args.packed_rope == "on", compile_rope=args.compile_rope,
                              attention=args.attention))
        if args.what in ENGINE_BENCHES or args.what == "all":
            names = ENGINE_BENCHES if args.what == "all" else (args.what,)
            result.update(run_engine_benches(args, names, world))
    finally:
        destroy()
    if int(os.environ.get("RANK", 0)) != 0:
        return
    _report(result, args.json)


def _report(result: dict, json_path: str | None) -> None:
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()},
                      f, indent=1)


if __name__ == "__main__":
    main()
