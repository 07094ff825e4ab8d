"""torchrun worker: model.forward_cuda_graphs=static (the CUDA graphs' fixed layout, run eagerly) against off.

    python -m torch.distributed.run --nproc_per_node N tests/engine/graphed_forward_worker.py OUT MODELS

N = 1 (TP1) or 2 (TP2). For both tiny architectures (untied and tied output layer), fp32 engines with the same
weights compute log-probs (and entropies, at temperature 1 and 0.7) of packed micro batches both ways: with a loss
mask (loss_tokens rows), without one (every position), with lm_head=all, with sequences longer than the shape's
token bucket allows pieces of, and with tail padding (pad_to_multiple_of). Results go to OUT/graphed_<tp>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    import os

    import torch
    import torch.distributed as dist

    import engine_cases as C
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, make_micro_batches
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    out, models_dir = Path(sys.argv[1]), Path(sys.argv[2])
    tp = int(os.environ["WORLD_SIZE"])
    parallel = ParallelConfig(tp=tp)
    initialize(parallel)
    rank = dist.get_rank()

    def cases(seed: int):
        g = torch.Generator().manual_seed(seed)
        short = C.sequences(seed)
        long = []
        for n in (200, 37, 150):  # one longer than half the smallest token bucket: its own length bound
            long.append({"input_ids": torch.randint(0, 500, (n,), generator=g),
                         "loss_mask": (torch.arange(n) >= 10).float()})
        no_mask = [{"input_ids": s["input_ids"]} for s in short]
        return {
            "masked": make_micro_batches(short, max_tokens=32),
            "masked_padded_tail": make_micro_batches(short, max_tokens=40, pad_to_multiple_of=8),
            "long": make_micro_batches(long, max_tokens=256),
            "no_mask": make_micro_batches(no_mask, max_tokens=48),
        }

    results = {}
    for arch, path in C.make_models(models_dir).items():
        hf = load_hf_config(path)
        for lm_head in ("loss_tokens", "all"):
            engines = {}
            for mode in ("off", "static"):
                cfg = C.model_cfg(path, lm_head=lm_head)
                cfg.max_seq_len = 512
                cfg.forward_cuda_graphs = mode
                engines[mode] = TrainEngine(hf, cfg, parallel)
            init = out / f"init_{arch}_{tp}"
            if lm_head == "loss_tokens":
                ckpt.save(init, engines["off"].model_chunks)
                ckpt.load(init, engines["static"].model_chunks)
            else:
                for eng in engines.values():
                    ckpt.load(init, eng.model_chunks)
            assert engines["off"].graphed is None and engines["static"].graphed is not None
            if lm_head == "loss_tokens":  # what an engine says when graphs were asked for and are not used
                on = C.model_cfg(path, lm_head=lm_head)
                on.max_seq_len, on.forward_cuda_graphs = 512, "on"
                results[f"{arch}/off_reason"] = [engines["static"].graphs_off_reason, engines["off"].graphs_off_reason,
                                                 TrainEngine(hf, on, parallel).graphs_off_reason]
            for name in cases(0):
                for temperature, entropy in ((1.0, True), (0.7, False)):
                    outs = {mode: eng.compute_logprobs(cases(0)[name], temperature=temperature, with_entropy=entropy)
                            for mode, eng in engines.items()}
                    key = f"{arch}/{lm_head}/{name}/t{temperature}"
                    for field in outs["off"][0]:
                        a = [o[field] for o in outs["off"]]
                        b = [o[field] for o in outs["static"]]
                        results[f"{key}/{field}/max_diff"] = max((x - y).abs().max().item() for x, y in zip(a, b))
                        results[f"{key}/{field}/zeros_differ"] = sum(int(((x == 0) != (y == 0)).sum())
                                                                     for x, y in zip(a, b))
                        results[f"{key}/{field}/nonzero"] = sum(int((x != 0).sum()) for x in a)
                        results[f"{key}/{field}/shapes_equal"] = all(x.shape == y.shape for x, y in zip(a, b))
        # With capture on, a shape met for the first time goes to the eager pass (capture costs three passes):
        # on CPU nothing may be captured, so one call of new shapes must run entirely through `eager`.
        from mcore_rl.engine.graphed_forward import GraphedForward

        eng = engines["off"]
        graphed = GraphedForward(eng.model_chunks[0], eng.model_info, capture=True)
        calls = []

        def eager(mbs):
            calls.append(len(mbs))
            return eng.compute_logprobs(mbs)

        mbs = cases(0)["long"]  # two micro batches of different shapes (one met twice would be captured)
        first = graphed.compute_logprobs(mbs, eager)
        plain = eng.compute_logprobs(cases(0)["long"])
        results[f"{arch}/first_sight_eager_calls"] = calls
        results[f"{arch}/first_sight_captures"] = graphed.num_captures
        results[f"{arch}/first_sight_seen"] = sorted(graphed.seen.values())
        results[f"{arch}/first_sight_max_diff"] = max((a["logprobs"] - b["logprobs"]).abs().max().item()
                                                      for a, b in zip(first, plain))
        results[f"{arch}/num_micro_batches"] = len(mbs)
    if rank == 0:
        C.write_json(out / f"graphed_tp{tp}.json", results)
    destroy()
