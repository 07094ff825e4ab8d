"""torchrun worker: train the Megatron actor one step, sync it into SGLang by one path, then check parity.

    python -m torch.distributed.run --nproc_per_node N tests/weight_sync/sync_worker.py MODEL OUT MODE TP

MODE: tensor | distributed | disk (weight_sync.transport). Rank 0 owns the engine. Checks (rank 0), written to OUT/result.json:
  * SGLang's log-probs of its own sampled tokens vs the actor's recomputed ones (max abs diff);
  * SGLang's greedy tokens after the sync vs HF transformers' greedy generate on the actor's exported weights,
    on prompts whose greedy path has no near-tie (top-2 gap > 1e-3 at every step).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if __name__ == "__main__":
    import torch.distributed as dist

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches, unpack
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.trainer.export import export_final
    from mcore_rl.weight_sync import WeightSync

    model, out, mode, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    hf = load_hf_config(model)
    parallel = ParallelConfig(tp=tp)
    initialize(parallel, hf)
    actor = TrainEngine(hf, ModelConfig(dtype="fp32", max_seq_len=256), parallel, OptimConfig(lr=5e-3))
    load_hf_weights(actor.model_chunks, model, hf)
    actor.reload_master_weights()
    rank0 = dist.get_rank() == 0
    rollout = None
    if rank0:
        from mcore_rl.rollout.engine import RolloutEngine

        rollout = RolloutEngine(RolloutConfig(device="cpu", dtype="fp32", max_total_tokens=4096,
                                              show_progress=False), model)

    # one training step on a fixed batch, so the synced weights differ from the checkpoint the engine loaded
    g = torch.Generator().manual_seed(0)
    seqs = [{"input_ids": torch.randint(5, 400, (n,), generator=g), "loss_mask": torch.ones(n)} for n in (9, 14, 6)]
    mbs = make_micro_batches(seqs, 64)
    res = actor.train_step(mbs, lambda o, mb: (-(o["logprobs"] * mb["loss_mask"]).sum() / 26.0, {}))
    sync = WeightSync(WeightSyncConfig(transport=mode), actor.model_chunks, hf, rollout,
                      scratch_dir=os.path.join(out, "scratch"), model_path=model, bucket_bytes=1 << 16)
    version = sync.sync()

    prompts = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in (5, 8, 11, 4, 7, 9)]
    samples = None
    if rank0:
        batch = rollout.generate(prompts, n=2, sampling=rollout.default_sampling(max_new_tokens=10, temperature=1.0))
        greedy = rollout.generate(prompts, n=1, sampling=rollout.default_sampling(max_new_tokens=10, temperature=0.0,
                                                                            ignore_eos=True))
        samples = [[s.prompt_ids, s.response_ids, s.rollout_logprobs] for s in batch.samples]
        greedy_ids = [s.response_ids for s in greedy.samples]
    box = [samples]
    dist.broadcast_object_list(box, src=0)
    samples = box[0]
    seqs = []
    for p, r, _ in samples:
        m = torch.zeros(len(p) + len(r))
        m[len(p):] = 1
        seqs.append({"input_ids": torch.tensor(p + r), "loss_mask": m})
    mbs = make_micro_batches(seqs, 256)
    lps = unpack([o["logprobs"] for o in actor.compute_logprobs(mbs)], mbs)
    diff = max(float((lp[len(p):] - torch.tensor(rl)).abs().max()) for lp, (p, r, rl) in zip(lps, samples))
    hf_out = os.path.join(out, "hf")
    export_final(actor.model_chunks, hf, model, hf_out)
    if rank0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
        compared = equal = 0
        with torch.no_grad():
            for p, ids in zip(prompts, greedy_ids):
                # plain argmax decoding: no logits processors (HF's min_new_tokens would mask EOS, SGLang's
                # ignore_eos does not)
                seq, gaps = list(p), []
                for _ in range(10):
                    top = ref(torch.tensor([seq])).logits[0, -1].float().topk(2)
                    gaps.append(float(top.values[0] - top.values[1]))
                    seq.append(int(top.indices[0]))
                if min(gaps) <= 1e-3:
                    continue  # a near-tie: either engine may fairly pick either token
                compared += 1
                equal += seq[len(p):] == ids
        json.dump({"version": version, "logprob_max_diff": diff, "greedy_compared": compared,
                   "greedy_equal": equal, "grad_norm": res.grad_norm, "mode": mode, "tp": tp},
                  open(os.path.join(out, "result.json"), "w"))
        sync.close()
        rollout.shutdown()
    destroy()
