"""Worker (one process, world size 1): the same perturbed Megatron actor synced into real SGLang in the engine
layout and in the HF layout must leave bit-identical engine parameters.

    python tests/weight_sync/sync_layout_worker.py OUT MODEL [MODEL ...]

Per model: start an engine on the checkpoint, read its parameters back (S0); check that a bucket with an HF name
in the engine layout is refused before it reaches SGLang; perturb every actor parameter; sync (engine layout,
buckets as flat buffers) -> E; reload the checkpoint from disk; sync (HF layout) -> H; reload; the engine layout
again as separate tensors (SGLang's load_format="direct") -> D; reload; the shared layout -> S1; scale every
actor parameter in place and sync shared again (nothing handed over again) -> S2, against an engine-layout sync
of the same weights; give the final norm new storage and sync shared (handed over again) -> S3, against the
engine layout. Then the cache flush: greedy log-probs of a prompt whose KV was cached before a shared sync must
equal those after an explicit flush, and (control) differ after a sync that skipped the flush. Last, closing the
shared layout's sync has the engine drop the actor's shared-memory segments (its processes map none of them). Writes
OUT/result.json with, per model, whether E == H == D == S1, S2 == E2, S3 == E3 bit for bit, whether every parameter
changed (E != S0, S2 != S1), the flush checks, the layouts that ran and the names.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def mapped_segments() -> int:
    """How many of this process's torch shared-memory segments the engine's processes map."""
    import psutil

    mine, count = f"/torch_{os.getpid()}_", 0
    for child in psutil.Process().children(recursive=True):
        with open(f"/proc/{child.pid}/maps") as maps:
            count += sum(mine in line for line in maps)
    return count


def check_model(model: str, scratch: str) -> dict:
    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.parallel import initialize
    from mcore_rl.rollout.engine import RolloutEngine
    from mcore_rl.testing import unequal
    from mcore_rl.weight_sync import WeightSync

    hf = load_hf_config(model)
    parallel = ParallelConfig()
    initialize(parallel, hf)
    actor = TrainEngine(hf, ModelConfig(dtype="fp32", max_seq_len=256), parallel, None)
    load_hf_weights(actor.model_chunks, model, hf)
    out: dict = {}
    if torch.cuda.is_available():  # the same checks on a GPU (CUDA IPC instead of shared memory), by hand
        where = dict(attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.2,
                     extra_args={"disable_cuda_graph": True})
    else:
        where = dict(device="cpu", max_total_tokens=1024)
    # deterministic=false: the prefix (radix) cache this checks the flushing of is off in SGLang's deterministic
    # mode on CPU (mcore_rl/rollout/cpu_seeded_sampling.py)
    rollout = RolloutEngine(RolloutConfig(dtype="fp32", show_progress=False, log_level="error", deterministic=False,
                                          **where), model)
    weights = rollout.weights
    try:
        s0 = weights.save_parameters()
        try:  # an HF name in the engine layout: refused here, the engine stays up
            with weights.weight_update():
                weights.update_bucket([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))],
                                      layout="engine")
        except ValueError as e:
            out["bad_name_error"] = str(e)
        out["alive_after_bad_name"] = rollout.alive

        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for chunk in actor.model_chunks:
                for p in chunk.parameters():
                    p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.02)

        def weight_sync(layout: str) -> WeightSync:
            return WeightSync(WeightSyncConfig(layout=layout), actor.model_chunks, hf, rollout, scratch_dir=scratch,
                              model_path=model, bucket_bytes=1 << 16)

        engine_sync = weight_sync("engine")
        engine_sync.sync()
        e = weights.save_parameters()
        weights.update_weights_from_disk(model)
        reloaded = weights.save_parameters()
        hf_sync = weight_sync("hf")
        hf_sync.sync()
        h = weights.save_parameters()
        weights.update_weights_from_disk(model)  # engine layout again, as separate tensors (load_format="direct")
        with weights.weight_update():
            for bucket in engine_sync.exporter:
                weights.update_bucket([(n, t.clone()) for n, t in bucket], layout="engine")
        d = weights.save_parameters()
        version = rollout.weight_version

        # Shared layout: the engine holds the actor's own parameters and copies them on each sync.
        weights.update_weights_from_disk(model)
        shared_sync = weight_sync("shared")
        shared_sync.sync()
        s1 = weights.save_parameters()
        token = weights.shared_token
        with torch.no_grad():  # in place, as optimizer steps write: seen without handing anything over again
            for chunk in actor.model_chunks:
                for p in chunk.parameters():
                    p.mul_(1.5)
        shared_sync.sync()
        s2 = weights.save_parameters()
        same_token = weights.shared_token == token
        engine_sync.sync()
        e2 = weights.save_parameters()
        norm = actor.model_chunks[0].decoder.final_layernorm.weight  # moved storage: handed over again
        norm.data = norm.data.clone() + 0.25
        shared_sync.sync()
        s3 = weights.save_parameters()
        engine_sync.sync()
        e3 = weights.save_parameters()
        # The cache flush: a prompt's KV cached under the old weights must not serve generation after a sync.
        # The shared layout flushes within its copy call; a sync without a flush (control) must show the stale
        # cache, or this check could not fail.
        prompt = list(range(3, 43))
        greedy = rollout.default_sampling(temperature=0.0, max_new_tokens=4, ignore_eos=True)

        def first_logprobs() -> list[float]:
            return rollout.generate([prompt], sampling=greedy).samples[0].rollout_logprobs

        def scale_actor(factor: float) -> None:
            with torch.no_grad():
                for chunk in actor.model_chunks:
                    for p in chunk.parameters():
                        p.mul_(factor)

        first_logprobs()  # cached under the current weights
        scale_actor(0.8)
        shared_sync.sync()
        after_sync = first_logprobs()
        rollout.flush_cache()
        fresh = first_logprobs()
        scale_actor(1.1)
        with weights.weight_update(flush_cache=False):
            for bucket in engine_sync.exporter:
                weights.update_bucket(list(bucket), layout="engine")
        stale = first_logprobs()
        rollout.flush_cache()
        fresh2 = first_logprobs()
        weights.update_weights_from_disk(model)  # a reload after the copy plan was compiled: still lands
        shared_sync.sync()
        s4 = weights.save_parameters()
        engine_sync.sync()
        e4 = weights.save_parameters()
        # Closing the shared layout's sync (before the engine's shutdown) has the engine drop its handles: its
        # processes then map none of this process's shared-memory segments.
        mapped_before = mapped_segments()
        shared_sync.close()
        out.update(shared_mapped_before_close=mapped_before, shared_mapped_after_close=mapped_segments(),
                   shared_token_after_close=weights.shared_token)
        out.update(
            shared_after_reload_equals_engine=[n for n in s4 if not torch.equal(s4[n], e4[n])] == [],
            flush_with_shared_sync=after_sync == fresh,
            stale_without_flush=stale != fresh2,
            shared_layout=shared_sync.layout,
            shared_equals_hf=[n for n in s1 if not torch.equal(s1[n], h[n])] == [],
            shared_in_place_equals_engine=[n for n in s2 if not torch.equal(s2[n], e2[n])] == [],
            shared_changed=[n for n in s2 if torch.equal(s2[n], s1[n])],
            shared_same_token=same_token,
            shared_after_move_equals_engine=[n for n in s3 if not torch.equal(s3[n], e3[n])] == [],
            shared_moved_token_changed=weights.shared_token != token,
            shared_norm_moved=not torch.equal(s3["model.norm.weight"], s2["model.norm.weight"]),
        )
        out.update(
            layouts=[engine_sync.layout, hf_sync.layout],
            num_buckets=len(engine_sync.exporter.plan()),
            names=sorted(e),
            same_names=sorted(e) == sorted(h) == sorted(s0),
            engine_unlike_hf=unequal(e, h),
            direct_unlike_hf=unequal(d, h),
            unchanged_by_sync=[n for n in e if torch.equal(e[n], s0[n])],
            reload_unrestored=unequal(s0, reloaded),
            embed_shape=list(e["model.embed_tokens.weight"].shape),
            embed_padding_zero=bool((e["model.embed_tokens.weight"][hf["vocab_size"]:] == 0).all()),
            version=version,
        )
    finally:
        rollout.shutdown()
    return out


if __name__ == "__main__":
    from mcore_rl.parallel import destroy

    out_dir, models = sys.argv[1], sys.argv[2:]
    results = {}
    for m in models:
        results[os.path.basename(m)] = check_model(m, os.path.join(out_dir, "scratch"))
        destroy()
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f, indent=1)
