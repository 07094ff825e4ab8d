"""torchrun worker (2 processes, gloo): MoE actors synced into a real SGLang engine (CPU, fp32) in the engine and the
shared layouts, against the HF layout and HF transformers.

    python -m torch.distributed.run --nproc_per_node 2 tests/weight_sync/moe_sync_worker.py OUT SEED0 SEED1 [...]

Arguments after OUT come in pairs per model: the checkpoint the engine starts on (seed 0) and the one the actor
loads (seed 1). Rank 0 owns the engine. Per model:
* EP=2 (each rank holds 2 of the 4 experts): weight_sync.layout=auto must pick the engine layout (the actor is
  split over EP ranks, so not shared); buckets of 16 KiB spread one layer's experts over several buckets. The synced
  engine -> E. Reload seed 0 from disk, sync in the HF layout -> H. E == H bit for bit; greedy tokens and log-probs
  of E equal HF transformers' on seed 1.
* EP=1 (Megatron state rebuilt, the engine kept): auto must pick the shared layout. Reload seed 0, shared sync
  -> S1 == H bit for bit. Perturb every actor parameter in place (as an optimizer step would), shared sync -> S2,
  engine-layout sync of the same actor -> E2: S2 == E2 bit for bit, and every parameter changed (S2 != S1).
Writes OUT/result.json (rank 0).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BUCKET_BYTES = 1 << 14
NUM_NEW = 16


def differ(a: dict, b: dict) -> list[str]:
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def actor_at(hf: dict, path: str, ep: int):
    """A Megatron actor (fp32, TP=1, PP=1, EP=ep) holding the checkpoint at `path`; rebuilds the parallel state."""
    from megatron.core import parallel_state as ps

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.parallel import initialize

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    parallel = ParallelConfig(ep=ep)
    initialize(parallel, hf)
    actor = TrainEngine(hf, ModelConfig(dtype="fp32", max_seq_len=256), parallel, None)
    load_hf_weights(actor.model_chunks, path, hf)
    return actor


def check_model(engine_path: str, actor_path: str, scratch: str) -> dict:
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.weight_sync import WeightSync
    from tests.rollout.conftest import HFReference

    hf = load_hf_config(actor_path)
    rank0 = int(os.environ["RANK"]) == 0
    rollout = ref = prompts = None
    out: dict = {}
    actor = actor_at(hf, actor_path, ep=2)  # first, as the trainer does: torch.distributed before the engine
    if rank0:
        from mcore_rl.rollout.engine import RolloutEngine

        ref = HFReference(actor_path)
        prompts = ref.stable_prompts(num=4, num_new=NUM_NEW)
        rollout = RolloutEngine(RolloutConfig(device="cpu", dtype="fp32", max_total_tokens=2048, show_progress=False,
                                              log_level="error"), engine_path)

    def weight_sync(actor, layout: str = "auto") -> WeightSync:
        return WeightSync(WeightSyncConfig(layout=layout), actor.model_chunks, hf, rollout, scratch_dir=scratch,
                          model_path=actor_path, bucket_bytes=BUCKET_BYTES)

    def params() -> dict | None:
        return rollout.weights.save_parameters() if rank0 else None

    def reload() -> None:
        if rank0:
            rollout.weights.update_weights_from_disk(engine_path)

    def matches_hf() -> dict:
        """Greedy tokens equal HF generate's on seed 1 and the largest log-prob gap to HF's log-softmax."""
        sampling = rollout.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW, ignore_eos=True)
        batch = rollout.generate([p for p, _ in prompts], sampling=sampling)
        equal, gap = 0, 0.0
        for sample, (prompt, expected) in zip(batch.samples, prompts):
            equal += sample.response_ids == expected
            lp = ref.logprobs(prompt, sample.response_ids)
            gap = max(gap, float((torch.tensor(sample.rollout_logprobs) - lp).abs().max()))
        return {"greedy_equal": equal, "greedy_compared": len(prompts), "logprob_gap": gap}

    try:
        s0 = params()
        if rank0:  # the two seeds disagree on these prompts: matching seed 1 later shows the sync took effect
            out["seed0_vs_hf_transformers"] = matches_hf()
        # -- EP=2: auto -> engine layout ------------------------------------------------------------------------
        auto = weight_sync(actor)
        auto.sync()
        e = params()
        plan = auto.exporter.plan()
        spans = {}  # layer -> buckets holding its expert slices
        for k, bucket in enumerate(plan):
            for item in bucket.items:
                if item.expert is not None:
                    spans.setdefault(item.hf[0].split(".")[2], set()).add(k)
        if rank0:
            out.update(ep2_layout=auto.layout, num_buckets=len(plan),
                       max_buckets_per_layer_experts=max(len(s) for s in spans.values()),
                       slice_names=[n for n, _, _ in auto.exporter.tensor_specs() if n.endswith("]")][:3],
                       engine_ep2_vs_hf_transformers=matches_hf())
        reload()
        weight_sync(actor, "hf").sync()
        h = params()
        if rank0:
            # the norms are ones in both seeds: only matrices must change
            out.update(engine_ep2_equals_hf_layout=differ(e, h) == [],
                       unchanged_by_sync=[n for n in e if e[n].dim() >= 2 and torch.equal(e[n], s0[n])])
        del actor, auto
        # -- EP=1: auto -> shared layout; in-place updates reach the engine -------------------------------------
        actor = actor_at(hf, actor_path, ep=1)
        reload()
        shared = weight_sync(actor)
        shared.sync()
        s1 = params()
        if rank0:
            out.update(ep1_layout=shared.layout, shared_equals_hf_layout=differ(s1, h) == [],
                       shared_vs_hf_transformers=matches_hf())
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for chunk in actor.model_chunks:
                for p in chunk.parameters():
                    p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.02)
        shared.sync()
        s2 = params()
        weight_sync(actor, "engine").sync()
        e2 = params()
        if rank0:
            out.update(shared_in_place_equals_engine=differ(s2, e2) == [],
                       unchanged_by_perturbed_sync=[n for n in s2 if torch.equal(s2[n], s1[n])],
                       names=sorted(s2))
        reload()
    finally:
        if rollout is not None:
            rollout.shutdown()
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    from mcore_rl.parallel import destroy

    out_dir, paths = sys.argv[1], sys.argv[2:]
    results = {}
    for engine_path, actor_path in zip(paths[0::2], paths[1::2]):
        results[os.path.basename(os.path.dirname(actor_path))] = check_model(engine_path, actor_path,
                                                                             os.path.join(out_dir, "scratch"))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f, indent=1)
    destroy()
