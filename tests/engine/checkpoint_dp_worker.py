"""torchrun worker (1 process): the checkpoints checkpoint_worker.py saved at DP=2, loaded at DP=1.

    python -m torch.distributed.run --nproc_per_node 1 tests/engine/checkpoint_dp_worker.py OUT MODELS

The fast format (each rank's optimizer shard as it was) and the reshardable one (gathered, per parameter) of the
same state must give the same fp32 weights and Adam moments here; a layout the fast format refuses is a
model-parallel one only. Writes OUT/checkpoint/dp1.json."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.optimizer import inner_optimizers
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    out, models_dir = Path(sys.argv[1]) / "checkpoint", Path(sys.argv[2])
    path = C.make_models(models_dir)["qwen2"]
    hf, cfg = load_hf_config(path), C.model_cfg(path)
    parallel = ParallelConfig()
    initialize(parallel)

    def optimizer_state(path):
        engine = TrainEngine(hf, cfg, parallel, OptimConfig(lr=C.LR))
        engine.load_checkpoint(path)
        state = {}
        for i, opt in enumerate(inner_optimizers(engine.optimizer)):
            for g, group in enumerate(opt.optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    state[f"{i}.{g}.{j}.param"] = p.detach().clone()
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[f"{i}.{g}.{j}.{key}"] = opt.optimizer.state[p][key].clone()
        return state

    fast, reshardable = optimizer_state(out / "b_step1"), optimizer_state(out / "b_step1_r")
    report = {"diff": C.max_diff(fast, reshardable),
              "moments_nonzero": all(bool(v.abs().max() > 0) for k, v in reshardable.items() if "exp_avg" in k)}
    C.write_json(out / "dp1.json", report)
    destroy()
