"""torchrun worker: one RL step (rl_step.prepare + update_actor) from the same weights and samples, once per
source of the old log-probs, on a real Megatron actor and reference (fp32, gloo, DP = the number of processes).

    python -m torch.distributed.run --nproc_per_node 2 tests/trainer/old_logprobs_worker.py OUT

Runs: recompute (the forward pass), current (auto's shortcut: the update's own log-probs, detached), rollout
(the samples' rollout log-probs, which are the actor's own minus a known per-token gap), and current with the
reference's log-probs computed in the update (ref.compute_at=update; once more with the reference's graph layout
run eagerly, which auto picks). Rank 0 writes, to
OUT/result.json, each run's step metrics, the weights' max abs change and the max abs weight difference between
runs, and the figures the rollout run's loss must see, worked out here from the gap.
"""

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if __name__ == "__main__":
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.config.rl import ActorConfig, AlgorithmConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.testing import make_tiny_hf_model
    from mcore_rl.trainer import rl_step as rl
    from mcore_rl.trainer.batch import sample_sequences
    from mcore_rl.trainer.step_data import Rollout
    from mcore_rl.types import Sample

    out = Path(sys.argv[1])
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:  # the actor and a different reference (so that KL(actor || ref) is not 0)
        make_tiny_hf_model(out / "actor", "qwen2", seed=3)
        make_tiny_hf_model(out / "ref", "qwen2", seed=4)
    parallel = ParallelConfig()
    initialize(parallel)
    dist.barrier()
    actor_path, ref_path = str(out / "actor"), str(out / "ref")
    hf = load_hf_config(actor_path)
    model_cfg = ModelConfig(dtype="fp32", max_seq_len=128)
    dp_group = ps.get_data_parallel_group()
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def engine(path, optim: ActorConfig | None, cfg: ModelConfig = model_cfg):
        e = TrainEngine(hf, cfg, parallel, dataclasses.replace(optim, lr_decay_steps=1) if optim else None)
        load_hf_weights(e.model_chunks, path, hf)
        if optim:
            e.reload_master_weights()
        return e

    def params(e):
        return [p.detach().clone() for p in e.model_chunks[0].parameters()]

    # 2 groups x 4 samples, responses of different lengths, rewards that vary within a group
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate((6, 9, 4, 11, 7, 5, 10, 8)):
        samples.append(Sample(prompt_ids=torch.randint(5, 500, (5,), generator=g).tolist(),
                              response_ids=torch.randint(5, 500, (n,), generator=g).tolist(),
                              rollout_logprobs=[], finish_reason="stop", group_id=i // 4,
                              reward=float(torch.rand((), generator=g))))
    # rollout log-probs = the actor's own minus gap in [0, 0.1): a known trainer / engine gap
    probe = engine(actor_path, None)
    mbs = rl.micro_batches(probe, sample_sequences(samples), 64)
    current = rl.gather_tokens(probe.compute_logprobs(mbs), mbs, "logprobs")
    gaps = []
    for s, lp in zip(samples, current):
        gap = 0.1 * torch.rand(len(s.response_ids), generator=g)
        s.rollout_logprobs = (lp[len(s.prompt_ids):] - gap).tolist()
        gaps.append(gap)
    gap = torch.cat(gaps).double()
    del probe

    algo = AlgorithmConfig(adv_estimator="grpo", n_samples_per_prompt=4)
    result = {"runs": {}}
    ref = engine(ref_path, None)
    # the reference with the CUDA graphs' fixed layout run eagerly (model.forward_cuda_graphs=static)
    ref_static = engine(ref_path, None, dataclasses.replace(model_cfg, forward_cuda_graphs="static"))
    in_update = {"current": False,  # ref.compute_at: forward (auto with an eager reference)
                 "ref_in_update": rl.ref_in_update("update", ref, old_source="current", kl_in_reward=False),
                 "ref_in_update_static": rl.ref_in_update("auto", ref_static, old_source="current",
                                                          kl_in_reward=False)}
    result["auto_with_eager_ref"] = rl.ref_in_update("auto", ref, old_source="current", kl_in_reward=False)
    # the forward pass packs like the update (forward budget = the update's), so recompute's old log-probs equal
    # the update's bit for bit and the comparison below is exact
    base = dict(lr=1e-3, clip_grad=1.0, kl_loss_coef=0.1, entropy_coef=0.01, max_tokens_per_micro_batch=32,
                forward_max_tokens_per_micro_batch=32)
    weights = {}
    init = None
    masked = dict(name="token_mask", low=0.5, high=1.05)  # drops the tokens whose gap is above log 1.05
    for label, source, actor_cfg in (("recompute", "recompute", ActorConfig(**base, tis_cap=1.05)),
                                     ("current", "current", ActorConfig(**base, tis_cap=1.05)),
                                     ("ref_in_update", "current", ActorConfig(**base, tis_cap=1.05)),
                                     ("ref_in_update_static", "current", ActorConfig(**base, tis_cap=1.05)),
                                     ("rollout", "rollout", ActorConfig(**base, old_logprobs="rollout")),
                                     ("rollout_2epochs", "rollout",
                                      ActorConfig(**base, old_logprobs="rollout", ppo_epochs=2)),
                                     ("masked", "recompute", ActorConfig(**base, off_policy_correction=masked))):
        actor = engine(actor_path, actor_cfg)
        if init is None:
            init = params(actor)
        ctx = rl.StepContext(actor, ref_static if label == "ref_in_update_static" else ref, None, None, dp_group,
                             dp_rank, dp_size, 1.0)
        batch, m = rl.prepare(ctx, Rollout(samples, 0), algo, actor_cfg, 16, None, source,
                              in_update.get(label, False))
        m.update(rl.update_actor(ctx, batch, actor_cfg, 1, 16))
        result["runs"][label] = m
        weights[label] = params(actor)
        del actor

    def max_diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    result["update_size"] = max_diff(weights["recompute"], init)
    result["diff_current"] = max_diff(weights["current"], weights["recompute"])
    result["diff_rollout"] = max_diff(weights["rollout"], weights["recompute"])
    result["diff_ref_in_update"] = max_diff(weights["ref_in_update"], weights["current"])
    result["diff_ref_in_update_static"] = max_diff(weights["ref_in_update_static"], weights["current"])
    # what the rollout run's loss sees: ratio = exp(log pi - rollout) = exp(gap) on every response token
    # what the corrections see: rho = pi_old / pi_rollout = exp(gap) on every response token
    rho = gap.exp()
    result["expected_correction"] = {"ratio_mean": float(rho.mean()), "ratio_max": float(rho.max()),
                                     "over_1.05": float((rho > 1.05).double().mean()),
                                     "mismatch_kl": float((rho - gap - 1).mean())}
    result["diff_masked"] = max_diff(weights["masked"], weights["recompute"])
    result["expected_rollout"] = {"ratio_mean": float(gap.exp().mean()), "ppo_kl": float(-gap.mean()),
                                  "logprob_diff": float(gap.mean()), "logprob_diff_max": float(gap.max()),
                                  "kl_k3": float((gap.exp() - gap - 1).mean())}
    result["dp_size"] = dp_size
    if rank0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    destroy()
