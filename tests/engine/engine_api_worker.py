"""torchrun worker (1 process): the bf16 path and the engine's smaller API surface.

    python -m torch.distributed.run --nproc_per_node 1 tests/engine/engine_api_worker.py OUT MODELS

* bf16 weights with fp32 master weights in the distributed optimizer: five steps on one repeated batch reduce
  the loss; the master weights are fp32 and the model weights follow them rounded to bf16.
* Weights written into a bf16 engine behind the optimizer's back reach the master weights after
  reload_master_weights (what loading an HF checkpoint through the bridge needs).
* Optimizer offload / onload are callable between steps (a no-op move on CPU) and change nothing.
* A forward-only engine (optim=None, e.g. the reference model) computes the same log-probs as the actor.
* Wrong-role calls raise ValueErrors whose messages the test checks.
Results go to OUT/engine_api.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, make_micro_batches, unpack
    from mcore_rl.engine.optimizer import inner_optimizers
    from mcore_rl.models import load_hf_config
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.testing import listed, unequal

    out, models_dir = Path(sys.argv[1]), Path(sys.argv[2])
    path = C.make_models(models_dir)["llama"]
    hf = load_hf_config(path)
    parallel = ParallelConfig()
    initialize(parallel)
    report = {}

    def nll(outputs, mb):  # maximise the log-likelihood of the response tokens
        mask = mb["loss_mask"]
        return -(outputs["logprobs"] * mask).sum(), {}

    seqs = C.sequences()
    mbs = make_micro_batches(seqs, max_tokens=32)
    norm = C.num_loss_tokens(seqs)
    optim = OptimConfig(lr=1e-3, clip_grad=1.0)

    engine = TrainEngine(hf, C.model_cfg(path, dtype="bf16"), parallel, optim)
    report["param_dtypes"] = sorted({str(p.dtype) for c in engine.model_chunks for p in c.parameters()})
    masters = [p for o in inner_optimizers(engine.optimizer) for g in o.shard_fp32_from_float16_groups for p in g]
    report["master_dtypes"] = sorted({str(p.dtype) for p in masters})
    report["num_masters"] = len(masters)

    # Weights set behind the optimizer's back, then reload_master_weights.
    with torch.no_grad():
        for c in engine.model_chunks:
            for p in c.parameters():
                p.mul_(0.5)
    engine.reload_master_weights()
    model_params = {id(m): p for o in inner_optimizers(engine.optimizer)
                    for mg, sg in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups)
                    for p, m in zip(mg, sg)}
    same_size = [m for m in masters if m.numel() == model_params[id(m)].numel()]
    report["masters_unlike_reload"] = unequal(listed(same_size), listed(
        model_params[id(m)].detach().view(-1)[:m.numel()].float() for m in same_size))

    losses = []
    for step in range(5):
        result = engine.train_step(mbs, nll, normalizer=norm)
        losses.append(result.loss)
        if step == 1:
            engine.offload_optimizer()
            engine.onload_optimizer()
    report["bf16_losses"] = losses
    report["bf16_grad_norm"] = result.grad_norm
    report["bf16_master_vs_model"] = max(
        (m - model_params[id(m)].detach().view(-1)[:m.numel()].float()).abs().max().item()
        for m in masters if m.numel() == model_params[id(m)].numel())

    # Offload / onload between steps changes nothing (fp32, two identical engines).
    a = TrainEngine(hf, C.model_cfg(path), parallel, optim)
    b = TrainEngine(hf, C.model_cfg(path), parallel, optim)
    with torch.no_grad():
        for pa, pb in zip(a.model_chunks[0].parameters(), b.model_chunks[0].parameters()):
            pb.copy_(pa)
    for step in range(2):
        a.train_step(mbs, nll, normalizer=norm)
        b.offload_optimizer()
        b.onload_optimizer()
        b.train_step(mbs, nll, normalizer=norm)
    report["offload_unequal"] = unequal(dict(a.model_chunks[0].named_parameters()),
                                        dict(b.model_chunks[0].named_parameters()))

    # A forward-only engine (reference model) with the actor's weights gives the actor's log-probs.
    ref_engine = TrainEngine(hf, C.model_cfg(path), parallel, optim=None)
    with torch.no_grad():
        for pa, pr in zip(a.model_chunks[0].parameters(), ref_engine.model_chunks[0].parameters()):
            pr.copy_(pa)
    lp_actor = unpack([o["logprobs"] for o in a.compute_logprobs(mbs)], mbs)
    lp_ref = unpack([o["logprobs"] for o in ref_engine.compute_logprobs(mbs)], mbs)
    report["ref_unequal"] = unequal(listed(lp_actor), listed(lp_ref))  # per sequence
    report["ref_requires_grad"] = any(p.requires_grad for p in ref_engine.model_chunks[0].parameters())

    critic = TrainEngine(hf, C.model_cfg(path, critic=True), parallel, optim=None, value_head=True)
    errors = {}
    for name, call in [
        ("backward_without_optimizer", lambda: ref_engine.forward_backward(mbs, nll)),
        ("logprobs_of_critic", lambda: critic.compute_logprobs(mbs)),
        ("values_of_actor", lambda: a.compute_values(mbs)),
        ("backward_without_loss_fn", lambda: a.forward_backward(mbs, None)),
        ("bad_normalizer", lambda: a.forward_backward(mbs, nll, normalizer=0.0)),
        ("no_micro_batches", lambda: a.forward_backward([], nll)),
    ]:
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    report["errors"] = errors

    C.write_json(out / "engine_api.json", report)
    destroy()
