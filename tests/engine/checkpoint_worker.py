"""torchrun worker: a resumed run equals an uninterrupted one (model + optimizer + LR schedule checkpoints).

    python -m torch.distributed.run --nproc_per_node 2 tests/engine/checkpoint_worker.py OUT MODELS

At DP=2 (the distributed optimizer shards Adam state and fp32 master weights over both ranks), fp32:
A trains 3 steps; B trains 1 step and saves; C, built fresh (different random weights), loads B's checkpoint
and trains 2 more steps. C's weights, losses and learning rates must equal A's bit for bit. D repeats C without
the per-parameter Adam `step` fix, to record how far the known Megatron pitfall would have moved the weights.
B saves in the fast format (b_step1, which C and D load) and in the reshardable one (b_step1_r; G resumes from
it at the same layout: equal to A bit for bit), then trains a second step and saves b_step2 (fast): H resumes from
it (Adam's step must be 2, not the 1 a fresh load starts from) and trains the third: equal to A bit for bit.
Then the parallel state is rebuilt as TP=2: the fast-format checkpoint is refused there, and E loads the
reshardable one resharded (optimizer included) and trains the same 2 steps: equal to A up to fp32 reduction
order. Results go to OUT/checkpoint/rank<r>.json.
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
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.engine.optimizer import inner_optimizers
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    out, models_dir = Path(sys.argv[1]) / "checkpoint", Path(sys.argv[2])
    path = C.make_models(models_dir)["qwen2"]
    hf = load_hf_config(path)
    cfg = C.model_cfg(path)
    optim = OptimConfig(lr=C.LR, min_lr=1e-4, lr_warmup_steps=2, lr_warmup_init=1e-4, lr_decay_style="cosine",
                        lr_decay_steps=5, weight_decay=0.01, adam_eps=C.ADAM_EPS)

    def data():
        dp_rank = parallel_state.get_data_parallel_rank()
        dp = parallel_state.get_data_parallel_world_size()
        mbs = make_micro_batches(C.dp_share(C.sequences(), dp_rank, dp), max_tokens=32)
        return mbs, global_count(mbs)

    def steps(engine, n):
        mbs, norm = data()
        log = []
        for _ in range(n):
            r = engine.train_step(mbs, C.policy_loss, normalizer=norm, with_entropy=True)
            log.append((r.loss, r.lr, r.grad_norm))
        return log

    parallel = ParallelConfig(tp=1)
    initialize(parallel)
    rank = dist.get_rank()
    report = {}

    a = TrainEngine(hf, cfg, parallel, optim)
    ckpt.save(out / "init", a.model_chunks)
    log_a = steps(a, 3)
    params_a = C.params_by_name(a.model_chunks)
    ckpt.save(out / "a_final", a.model_chunks)

    b = TrainEngine(hf, cfg, parallel, optim)
    ckpt.load(out / "init", b.model_chunks)
    log_b = steps(b, 1)
    b.save_checkpoint(out / "b_step1", extra={"trainer_step": 1}, reshardable=False)
    # overwriting an existing one is atomic too
    b.save_checkpoint(out / "b_step1", extra={"trainer_step": 1}, reshardable=False)
    b.save_checkpoint(out / "b_step1_r", extra={"trainer_step": 1}, reshardable=True)
    # From step 2 too: the Adam step (in the param groups) must beat the stale per-parameter one of the fast format
    steps(b, 1)
    b.save_checkpoint(out / "b_step2", reshardable=False)
    del b
    h = TrainEngine(hf, cfg, parallel, optim)
    h.load_checkpoint(out / "b_step2")
    report["adam_steps_after_step2_load"] = sorted({float(s["step"]) for o in inner_optimizers(h.optimizer)
                                                    for s in o.optimizer.state.values()})
    steps(h, 1)
    report["resumed_from_step2_equal"] = all(torch.equal(p, params_a[k])
                                             for k, p in C.params_by_name(h.model_chunks).items())
    del h

    c = TrainEngine(hf, cfg, parallel, optim)
    report["fresh_differs"] = C.max_diff(C.params_by_name(c.model_chunks), params_a)["abs"]
    extra = c.load_checkpoint(out / "b_step1")
    report["extra"] = extra
    report["num_steps_after_load"] = c.num_steps
    report["scheduler_steps_after_load"] = c.scheduler.num_steps
    steps_c = [s.get("step") for o in inner_optimizers(c.optimizer) for s in o.optimizer.state.values()]
    report["distinct_step_tensors"] = len({id(s) for s in steps_c}) == len(steps_c)
    log_c = log_b + steps(c, 2)
    report["resumed_equal"] = all(torch.equal(p, params_a[k]) for k, p in C.params_by_name(c.model_chunks).items())
    report["resumed_diff"] = C.max_diff(C.params_by_name(c.model_chunks), params_a)["abs"]
    report["log_a"], report["log_c"] = log_a, log_c

    # Without the fix: every parameter's Adam step is one shared tensor after load.
    fix = ckpt._unshare_adam_steps
    ckpt._unshare_adam_steps = lambda optimizer: None
    d = TrainEngine(hf, cfg, parallel, optim)
    d.load_checkpoint(out / "b_step1")
    steps(d, 2)
    ckpt._unshare_adam_steps = fix
    report["without_step_fix_diff"] = C.max_diff(C.params_by_name(d.model_chunks), params_a)["abs"]

    # The reshardable format at the same layout: the same resumed run.
    g = TrainEngine(hf, cfg, parallel, optim)
    g.load_checkpoint(out / "b_step1_r")
    steps(g, 2)
    report["resumed_reshardable_equal"] = all(torch.equal(p, params_a[k])
                                              for k, p in C.params_by_name(g.model_chunks).items())
    del g

    # Resume at another layout: TP=2 (DP=1), same world. The fast format refuses it, naming the way out; the
    # reshardable one loads resharded.
    parallel_state.destroy_model_parallel()
    parallel = ParallelConfig(tp=2)
    initialize(parallel)
    e = TrainEngine(hf, cfg, parallel, optim)
    try:
        e.load_checkpoint(out / "b_step1")
        report["fast_at_other_layout"] = "loaded"
    except ValueError as err:
        report["fast_at_other_layout"] = str(err)
    e.load_checkpoint(out / "b_step1_r")
    log_e = log_b + steps(e, 2)
    ref = C.load_model_tensors(hf, cfg, parallel, out / "a_final")
    report["resharded_diff"] = C.max_diff(C.params_by_name(e.model_chunks), ref)
    report["log_e"] = log_e

    C.write_json(out / f"rank{rank}.json", report)
    destroy()
