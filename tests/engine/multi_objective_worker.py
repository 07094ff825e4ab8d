"""torchrun worker for TrainEngine.multi_objective_step (per-objective clipping, then weighted sum).

    python -m torch.distributed.run --nproc_per_node 1 tests/engine/multi_objective_worker.py reference OUT MODELS
    python -m torch.distributed.run --nproc_per_node 2 tests/engine/multi_objective_worker.py layout OUT MODELS 2,1 1,1

Two objectives on the tiny Llama, fp32: A = the policy-gradient loss of engine_cases, B = 30 x the negative
log-likelihood (a much larger gradient, so that its clip engages). For each layout the worker records, from the
same initial weights: each objective's gradient alone (its own zero_grad + forward/backward), the norm the
optimizer reports for it, and the combined gradient multi_objective_step leaves in the main grads (they are not
zeroed by the optimizer step), plus the weights after the step. The reference (TP=1, one process) saves them
as dist checkpoints; layouts ("TP,PP", DP is the rest of the world) load them resharded and write differences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

COEFS = (0.7, 0.3)
CLIPS = (0.5, 0.2)
GLOBAL_CLIP = 0.3


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state

    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TaskGrad, TrainEngine, global_count, make_micro_batches
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize

    mode, out = sys.argv[1], Path(sys.argv[2])
    path = C.make_models(Path(sys.argv[3]))["llama"]
    hf = load_hf_config(path)
    cfg = C.model_cfg(path)
    ref = out / "ref"
    specs = ["1,1"] if mode == "reference" else sys.argv[4:]
    for spec in specs:
        tp, pp = (int(x) for x in spec.split(","))
        parallel = ParallelConfig(tp=tp, pp=pp)
        initialize(parallel)
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        all_seqs = C.sequences()
        mine = [s for i, s in enumerate(all_seqs) if i % dp == dp_rank]
        norm = C.num_loss_tokens(all_seqs)

        def loss_a(outputs, mb):
            loss, m = C.policy_loss(outputs, mb)
            return loss / norm, {}

        def loss_b(outputs, mb):
            return -30.0 * (outputs["logprobs"] * mb["loss_mask"]).sum() / norm, {}

        engine = TrainEngine(hf, cfg, parallel, OptimConfig(lr=C.LR, clip_grad=GLOBAL_CLIP, adam_eps=C.ADAM_EPS))
        if mode == "reference":
            ckpt.save(ref / "init", engine.model_chunks)
        else:
            ckpt.load(ref / "init", engine.model_chunks)
        mbs = make_micro_batches(mine, max_tokens=32, multiple_of=engine.micro_batch_multiple,
                                 min_micro_batches=engine.pp_size)
        assert global_count(mbs, "loss_mask") == norm

        alone, norms = {}, []
        for name, fn, ent in (("a", loss_a, True), ("b", loss_b, False)):
            engine.zero_grad()
            engine.forward_backward(mbs, fn, with_entropy=ent)
            engine.optimizer.prepare_grads()
            norms.append(float(engine.optimizer.get_grad_norm()))
            alone[name] = C.grads_by_name(engine)
        res, per = engine.multi_objective_step([
            TaskGrad(mbs, loss_a, COEFS[0], CLIPS[0], with_entropy=True),
            TaskGrad(mbs, loss_b, COEFS[1], CLIPS[1])])
        assert res.update_successful
        combined = C.grads_by_name(engine)
        params = C.params_by_name(engine.model_chunks)
        report = {"norms_alone": norms, "norms_step": [r.grad_norm for r in per], "clip_coefs": [r.clip_coef for r in per],
                  "combined_norm": res.grad_norm, "losses": [r.loss for r in per]}
        tag = f"tp{tp}_pp{pp}_dp{dp}"
        if mode == "reference":
            # Independent of Megatron's norm code: the plain 2-norm of each full gradient at TP=1.
            plain = [torch.sqrt(sum((g.double() ** 2).sum() for g in alone[k].values())).item() for k in "ab"]
            expected = {n: sum(c * min(1.0, clip / nrm) * alone[k][n].double()
                               for c, clip, nrm, k in zip(COEFS, CLIPS, plain, "ab")) for n in combined}
            total = torch.sqrt(sum((g ** 2).sum() for g in expected.values())).item()
            expected = {n: (g * min(1.0, GLOBAL_CLIP / (total + 1e-6))).float() for n, g in expected.items()}
            report.update(plain_norms=plain, expected_total=total,
                          combined_vs_expected=C.max_diff(combined, expected))
            for name, tensors in (("a", alone["a"]), ("b", alone["b"]), ("combined", combined), ("params", params)):
                C.save_tensors_as_model(tensors, hf, cfg, parallel, ref / name)
        else:
            report["diff"] = {name: C.max_diff(mine_t, C.load_model_tensors(hf, cfg, parallel, ref / name))
                              for name, mine_t in (("a", alone["a"]), ("b", alone["b"]), ("combined", combined),
                                                   ("params", params))}
        (out / tag).mkdir(parents=True, exist_ok=True)
        C.write_json(out / tag / f"rank{dist.get_rank()}.json", report)
        parallel_state.destroy_model_parallel()
    destroy()


if __name__ == "__main__":
    main()
