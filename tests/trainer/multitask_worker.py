"""torchrun worker (1 process): set up a multi-task run, run one step of the loop's parts, and count the trainable
parameters that exist in the process.

    python -m torch.distributed.run --nproc_per_node 1 tests/trainer/multitask_worker.py OUT HYDRA_OVERRIDES...

Every torch.nn.Parameter reachable by the garbage collector is inspected: the ones with requires_grad must be
exactly the actor engine's, once (two tasks, one set of actor weights), and the reference's must all be frozen.
Results go to OUT/params.json.
"""

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    import torch
    from hydra import compose, initialize_config_dir

    from mcore_rl.config.root import register, to_object
    from mcore_rl.trainer.loop import build_scheduler, collect_batches
    from mcore_rl.trainer.run import Run
    from mcore_rl.trainer.update import train_step

    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    register()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base=None):
        cfg = to_object(compose("config", overrides=overrides))
    trainer = Run(cfg)
    try:
        scheduler, _ = build_scheduler(cfg, trainer)
        batches, m = collect_batches(trainer, scheduler, 1)
        m.update(train_step(trainer, scheduler, batches))
        gc.collect()
        params = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Parameter)]
        trainable = {id(p): p for p in params if p.requires_grad}
        actor = {id(p): p for c in trainer.actor.model_chunks for p in c.parameters()}
        ref = [p for c in trainer.ref.model_chunks for p in c.parameters()]
        report = {
            "num_tasks_trained": sum(int(v) for k, v in m.items() if k.endswith("/trained")),
            "num_trainable": len(trainable),
            "num_actor": len(actor),
            "trainable_is_actor": set(trainable) == set(actor),
            "trainable_elements": sum(p.numel() for p in trainable.values()),
            "actor_elements": sum(p.numel() for p in actor.values()),
            "ref_trainable": [n for c in trainer.ref.model_chunks for n, p in c.named_parameters() if p.requires_grad],
            "ref_shares_actor_storage": any(p.data_ptr() in {a.data_ptr() for a in actor.values()} for p in ref),
            "num_engines_with_optimizer": sum(1 for e in (trainer.actor, trainer.ref, trainer.critic)
                                              if e is not None and e.optimizer is not None),
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "params.json").write_text(json.dumps(report, indent=1))
    finally:
        trainer.close()
    os._exit(0)
