"""torchrun worker (2 processes, DP=2): OptimConfig.fast_optimizer "on" against Megatron's optimizer as shipped.

    python -m torch.distributed.run --nproc_per_node 2 tests/engine/fast_optim_worker.py OUT MODELS

From the same initial weights and batches, three steps with fast_optimizer="off" (torch's foreach AdamW and
Megatron's pure-Python multi-tensor fallbacks) and with "on" (fused AdamW, foreach fallbacks):
* fp32, distributed optimizer (fp32 master weights are the model weights; the grad norm goes through the
  fallback l2 norm, clipping through the fallback scale: clip_grad is set below the norm);
* bf16 weights, non-distributed optimizer (its fp32 master -> bf16 model copy goes through the fallback scale).
Then the fused run resumes from a step-1 checkpoint. Results go to OUT/fast_optim/rank<r>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    import torch.distributed as dist
    from megatron.core import parallel_state

    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, fast_optim, global_count, make_micro_batches
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.engine.optimizer import _master_params, inner_optimizers
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    out, models_dir = Path(sys.argv[1]) / "fast_optim", Path(sys.argv[2])
    path = C.make_models(models_dir)["qwen2"]
    hf = load_hf_config(path)
    parallel = ParallelConfig(tp=1)
    initialize(parallel)
    rank = dist.get_rank()
    report = {}

    calls = {"l2": 0, "scale": 0}
    l2, scale = fast_optim.foreach_l2_norm, fast_optim.foreach_scale

    def counting_l2(*a):
        calls["l2"] += 1
        return l2(*a)

    def counting_scale(*a):
        calls["scale"] += 1
        return scale(*a)

    fast_optim.foreach_l2_norm, fast_optim.foreach_scale = counting_l2, counting_scale

    def data():
        mbs = make_micro_batches(C.dp_share(C.sequences(), parallel_state.get_data_parallel_rank(),
                                            parallel_state.get_data_parallel_world_size()), max_tokens=32)
        return mbs, global_count(mbs)

    def run(dtype, distributed, fast, init, n=3, save=None, load=None):
        # clip_grad 0.05 is below the norms of these steps, so clipping (the fallback scale) really runs
        optim = OptimConfig(lr=C.LR, clip_grad=0.05, weight_decay=0.01, adam_eps=C.ADAM_EPS,
                            use_distributed_optimizer=distributed, fast_optimizer=fast)
        eng = TrainEngine(hf, C.model_cfg(path, dtype), parallel, optim)
        if load is not None:
            eng.load_checkpoint(load)
        else:
            ckpt.load(init, eng.model_chunks)
            eng.reload_master_weights()
        mbs, norm = data()
        log = []
        for _ in range(n):
            r = eng.train_step(mbs, C.policy_loss, normalizer=norm, with_entropy=True)
            log.append([r.loss, r.grad_norm])
        if save is not None:
            eng.save_checkpoint(save)
        torch_opts = [o.optimizer for o in inner_optimizers(eng.optimizer)]
        fused = [bool(g.get("fused")) for o in torch_opts for g in o.param_groups]
        step_devices = sorted({str(s["step"].device) for o in torch_opts for s in o.state.values()})
        masters = {str(i): p.detach().clone()
                   for i, p in enumerate(p for o in inner_optimizers(eng.optimizer) for p in _master_params(o))}
        return C.params_by_name(eng.model_chunks), log, fused, step_devices, masters

    for dtype, distributed in (("fp32", True), ("bf16", False)):
        tag = f"{dtype}_{'dist' if distributed else 'local'}"
        init = out / f"init_{tag}"
        ckpt.save(init, TrainEngine(hf, C.model_cfg(path, dtype), parallel).model_chunks)
        start = C.load_model_tensors(hf, C.model_cfg(path, dtype), parallel, init)
        calls.update(l2=0, scale=0)
        p_off, log_off, fused_off, _, m_off = run(dtype, distributed, "off", init)
        calls_off = dict(calls)
        p_on, log_on, fused_on, steps_on, m_on = run(dtype, distributed, "on", init)
        report[tag] = {
            "moved": C.max_diff(p_off, start),
            "diff": C.max_diff(p_on, p_off),
            "master_diff": C.max_diff(m_on, m_off)["abs"] if m_off else None,
            "log_off": log_off, "log_on": log_on,
            "fused_off": fused_off, "fused_on": fused_on, "step_devices_on": steps_on,
            "calls_off": calls_off, "calls_on": {k: calls[k] - calls_off[k] for k in calls},
        }

    # Resume with the fused optimizer: 1 step + save, fresh engine loads and runs 2 more == 3 uninterrupted.
    init = out / "init_fp32_dist"
    p_a, log_a, *_ = run("fp32", True, "on", init)
    _, log_b, *_ = run("fp32", True, "on", init, n=1, save=out / "b_step1")
    p_c, log_c, *_ = run("fp32", True, "on", init, n=2, load=out / "b_step1")
    report["resume"] = {"equal": all(torch.equal(p, p_a[k]) for k, p in p_c.items()),
                        "diff": C.max_diff(p_c, p_a)["abs"], "log_a": log_a, "log_bc": log_b + log_c}

    C.write_json(out / f"rank{rank}.json", report)
    destroy()
