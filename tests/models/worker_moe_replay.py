"""torchrun worker of test_moe_replay.py: routing replay and router statistics of a tiny MoE model in Megatron.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/worker_moe_replay.py SPEC.json OUT

SPEC names the HF folder, the samples SGLang generated (prompt, response, log-probs, routes: ROLLOUT.pt) and the
layouts. For every layout, each data-parallel rank takes its share of the samples and records:

* own_match: how many (token, layer) expert sets of the trainer's own routing equal SGLang's, of how many;
* replay_gap / own_gap: max |trainer - SGLang| log-prob over response tokens with the rollout routes replayed,
  and with the trainer's own routing;
* used_mismatch: where the routers dispatched other than the replayed routes ([layer, sample, tokens]; empty);
* shifted: the trainer's log-probs with every expert id shifted by one (mod E), for the test to compare with
  transformers forced onto the same routes;
* recompute: loss and grad norm of one replayed training pass with model.recompute=none and =full (activation
  recompute re-runs the routers in backward, which must replay the same routes);
* metrics: engine.moe_metrics() of one training pass over padded micro batches of two samples each with aux and
  z-loss on, the micro batches' sample indices, and Megatron's own aux / z-loss tracker values of that pass;
* router_grads: each router weight's gradient from the aux and z losses alone, over the same padded micro
  batches, this rank's own (before the data-parallel reduction).
Each rank writes OUT/rank<r>.json.
"""

ROUTES = "routed_experts"


def route_sets(routes):
    """Expert ids [..., K] sorted, to compare with a routing map's (nonzero lists them in order)."""
    return routes.long().sort(dim=-1).values


def main():
    import json
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches
    from mcore_rl.engine.batching import unpack
    from mcore_rl.engine.forward_backward import unwrap
    from mcore_rl.models import build_model, load_hf_config
    from mcore_rl.parallel import initialize
    from mcore_rl.testing import capture_routing_maps

    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rollout = torch.load(spec["rollout"])
    hf = load_hf_config(spec["model"])
    num_experts = hf.get("num_experts") or hf["num_local_experts"]
    results = []

    def engine_for(parallel, **model_kw):
        cfg = ModelConfig(path=spec["model"], dtype="fp32", attention="sdpa", max_seq_len=128,
                          moe_routing_replay=True, **model_kw)
        built = build_model(hf, cfg, parallel)
        load_hf_weights(built.chunks, spec["model"], hf)
        return TrainEngine(hf, cfg, parallel, OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6), model=built)

    def sequences(samples, routes=None):
        out = []
        for i, s in enumerate(samples):
            ids = torch.tensor(s["prompt"] + s["response"])
            seq = {"input_ids": ids, "loss_mask": (torch.arange(len(ids)) >= len(s["prompt"])).float()}
            if routes is not None:
                seq[ROUTES] = routes[i]
            out.append(seq)
        return out

    def token_routes(s, shift=0):  # as trainer/batch.token_routes: the last token gets experts 0..k-1
        r = (s["routes"].long() + shift) % num_experts
        return torch.cat([r, torch.arange(r.size(2)).expand(1, *r.shape[1:])])

    def response_logprobs(engine, samples, routes=None):
        # one sample a micro batch, in order: the routers' calls then follow the samples
        mbs = make_micro_batches(sequences(samples, routes), micro_batch_size=1)
        per_seq = unpack([o["logprobs"] for o in engine.compute_logprobs(mbs)], mbs)
        return [lp[len(s["prompt"]):].tolist() for lp, s in zip(per_seq, samples)]

    for lay in spec["layouts"]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel = ParallelConfig(tp=1, pp=lay["pp"], ep=lay["ep"])
        initialize(parallel)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = [i for i in range(len(rollout)) if i % dp == dp_rank]
        samples = [rollout[i] for i in mine]
        case = {"layout": lay["name"], "rank": dist.get_rank(), "samples": mine}
        engine = engine_for(parallel)
        seen = capture_routing_maps(engine.model_chunks)

        def gap(lps):
            return max(max(abs(a - b) for a, b in zip(lp, s["logprobs"])) for lp, s in zip(lps, samples))

        # (a) the trainer's own routing against SGLang's (this pipeline stage's layers)
        case["own_gap"] = gap(response_logprobs(engine, samples))
        match = total = 0
        for layer, maps in seen.items():
            for rmap, s in zip(maps, samples):
                own = rmap[:-1].nonzero()[:, 1].view(rmap.size(0) - 1, -1)  # [P + R - 1, K] sorted ids
                match += int((own == route_sets(s["routes"][:, layer])).all(dim=-1).sum())
                total += own.size(0)
        case["own_match"] = [match, total]
        seen.clear()

        # (b) replayed: log-probs against SGLang's, and the dispatched routes are exactly the replayed ones
        routes = [token_routes(s) for s in samples]
        case["replay_gap"] = gap(response_logprobs(engine, samples, routes))
        case["used_mismatch"] = [  # [layer, sample, tokens dispatched elsewhere than replayed] where any were
            [layer, i, n] for layer, maps in seen.items() for i, (rmap, r) in enumerate(zip(maps, routes))
            if (n := int((rmap.nonzero()[:, 1].view(rmap.size(0), -1) != route_sets(r[:, layer])).any(dim=-1).sum()))]
        case["layers_seen"] = sorted(seen)
        seen.clear()
        case["shifted"] = response_logprobs(engine, samples, [token_routes(s, shift=1) for s in samples])

        # recompute=full re-runs the routers in backward: with replay, the same loss and gradients
        def one_pass(eng, routes):
            mbs = make_micro_batches(sequences(samples, routes), max_tokens=48, min_micro_batches=eng.pp_size)
            norm = global_count(mbs, "loss_mask")
            eng.zero_grad()
            fb = eng.forward_backward(mbs, lambda out, mb: ((out["logprobs"] * mb["loss_mask"]).sum(), {}),
                                      normalizer=norm)
            eng.optimizer.prepare_grads()
            return fb.loss, float(eng.optimizer.get_grad_norm())

        replayed = [token_routes(s, shift=1) for s in samples]
        case["recompute"] = {"none": one_pass(engine, replayed),
                             "full": one_pass(engine_for(parallel, recompute="full"), replayed)}
        engine.moe_metrics()  # forget the statistics of the passes above

        # (c) router statistics of training passes with the router's own routing: packed micro batches of one
        # sample (no padding: Megatron's aux-loss tracker counts the same tokens), then padded ones of two
        aux_engine = engine_for(parallel, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)

        def train_pass(mbs):
            moe_utils.clear_aux_losses_tracker()
            aux_engine.zero_grad()
            aux_engine.forward_backward(mbs, lambda out, mb: ((out["logprobs"] * mb["loss_mask"]).sum(), {}),
                                        normalizer=global_count(mbs, "loss_mask"))
            return aux_engine.moe_metrics()

        case["metrics_packed"] = train_pass(make_micro_batches(sequences(samples), micro_batch_size=1))
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        case["tracker"] = {k: v["values"].tolist() for k, v in tracker.items() if "values" in v}
        mbs = make_micro_batches(sequences(samples), micro_batch_size=2, packed=False)
        case["metrics"] = train_pass(mbs)
        case["groups"] = [[mine[i] for i in mb.indices] for mb in mbs]
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        case["tracker_padded"] = {k: v["values"].tolist() for k, v in tracker.items() if "values" in v}
        case["after_reset"] = aux_engine.moe_metrics()
        # (d) the aux and z losses alone in the gradients (the main loss is 0 x log-probs): each router's gradient,
        # summed over data-parallel ranks, for the test to compare with transformers' autograd of the same losses
        # (read before the data-parallel reduction: the distributed optimizer reduce-scatters, leaving each rank
        # only its shard of the reduced gradients; the test sums the ranks' own)
        routers = [m for c in aux_engine.model_chunks for m in c.modules() if isinstance(m, TopKRouter)]
        config = unwrap(aux_engine.model_chunks[0]).config
        finalize = config.finalize_model_grads_func

        def read_then_finalize(*args, **kwargs):
            case["router_grads"] = {str(m.layer_number): m.weight.main_grad.tolist() for m in routers}
            return finalize(*args, **kwargs)

        config.finalize_model_grads_func = read_then_finalize
        aux_engine.zero_grad()
        aux_engine.forward_backward(mbs, lambda out, mb: ((out["logprobs"] * 0.0).sum(), {}))
        config.finalize_model_grads_func = finalize
        results.append(case)
        del engine, aux_engine

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
