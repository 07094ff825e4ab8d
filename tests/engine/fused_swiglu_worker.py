"""torchrun worker (1 process): ModelConfig.fused_swiglu="on" (Megatron's torch.compile'd SwiGLU) against "off".

    python -m torch.distributed.run --nproc_per_node 1 tests/engine/fused_swiglu_worker.py OUT MODELS

Two fp32 engines with the same weights: log-probs of a packed batch and the gradients of one policy-loss
backward. Results go to OUT/fused_swiglu.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    out, models_dir = Path(sys.argv[1]), Path(sys.argv[2])
    path = C.make_models(models_dir)["llama"]
    hf = load_hf_config(path)
    parallel = ParallelConfig()
    initialize(parallel)
    results = {}
    init = out / "init"
    for setting in ("off", "on"):
        cfg = C.model_cfg(path)
        cfg.fused_swiglu = setting
        eng = TrainEngine(hf, cfg, parallel, OptimConfig(lr=C.LR))
        if setting == "off":
            ckpt.save(init, eng.model_chunks)
        else:
            ckpt.load(init, eng.model_chunks)
        mbs = make_micro_batches(C.sequences(), max_tokens=32)
        lp = [o["logprobs"] for o in eng.compute_logprobs(mbs)]
        eng.zero_grad()
        eng.forward_backward(mbs, C.policy_loss, normalizer=global_count(mbs), with_entropy=True)
        results[setting] = {"fusion": eng.config.bias_activation_fusion, "logprobs": lp,
                            "grads": C.grads_by_name(eng)}
    off, on = results["off"], results["on"]
    C.write_json(out / "fused_swiglu.json", {
        "fusion": [off["fusion"], on["fusion"]],
        "logprob_diff": max((a - b).abs().max().item() for a, b in zip(on["logprobs"], off["logprobs"])),
        "grad_diff": C.max_diff(on["grads"], off["grads"]),
    })
    destroy()
