"""torchrun worker of test_moe_parity.py: tiny Qwen3-MoE and Mixtral models at several EP x TP x PP layouts.

    python -m torch.distributed.run --nproc_per_node 2 tests/models/worker_moe.py SPEC.json OUT

For every layout of SPEC (run one after another in this world) and every model: load the HF weights into the
sharded Megatron model, compare its logits with transformers' (saved beside the model), export it back to all
ranks and to the last rank and compare with the safetensors, then train two Adam steps on fixed data (aux loss
and z-loss on) and record losses and gradient norms. Each rank writes its findings to OUT/rank<r>.json; the test
holds the tolerances.
"""


def sequences():
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    # even lengths: at TP 2 with sequence parallelism no micro batch needs padding, which the aux loss would weigh
    # inexactly there (models/moe.RouterHooks.token_mean)
    for n in (12, 8, 16, 6, 14, 10, 20, 4):
        out.append({"input_ids": torch.randint(0, 500, (n,), generator=g),
                    "loss_mask": (torch.arange(n) >= 3).float(),
                    "advantages": torch.randn(n, generator=g) + 1.0})  # a loss far from 0: relative tolerances
    return out


def policy_loss(outputs, mb):
    mask = mb["loss_mask"]
    per_token = -(mb["advantages"] * outputs["logprobs"]) - 0.01 * outputs["entropy"]
    return (per_token * mask).sum(), {"tokens": mask.sum()}


def train(hf, path, parallel, steps=2, aux=(0.01, 0.001)):
    """Losses and grad norms of `steps` Adam steps; every dense data-parallel rank takes its share of the data."""
    from megatron.core import parallel_state as ps

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches
    from mcore_rl.models import build_model

    cfg = ModelConfig(path=path, dtype="fp32", attention="sdpa", max_seq_len=64, moe_aux_loss_coeff=aux[0],
                      moe_z_loss_coeff=aux[1])
    built = build_model(hf, cfg, parallel)
    load_hf_weights(built.chunks, path, hf)
    engine = TrainEngine(hf, cfg, parallel, OptimConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-6), model=built)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [s for i, s in enumerate(sequences()) if i % dp == dp_rank]
    # one sequence a micro batch: the aux loss is per micro batch, so layouts with other data-parallel sizes give
    # every rank other pairs of sequences, and only single-sequence micro batches keep the objective the same
    mbs = make_micro_batches(mine, micro_batch_size=1, packed=False, pad_to_multiple_of=engine.sequence_multiple)
    norm = global_count(mbs, "loss_mask")
    losses, grad_norms = [], []
    for _ in range(steps):
        engine.zero_grad()
        fb = engine.forward_backward(mbs, policy_loss, normalizer=norm, with_entropy=True)
        ok, grad_norm, _ = engine.optimizer_step()
        assert ok
        losses.append(fb.loss)
        grad_norms.append(grad_norm)
    return {"losses": losses, "grad_norms": grad_norms}


def main():
    import json
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from mcore_rl.bridge import HFWeightExporter, load_hf_weights
    from mcore_rl.bridge.maps import expand
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models import build_model, load_hf_config
    from mcore_rl.parallel import initialize
    from tests.bridge.worker_parity import check_export, forward_logits

    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results = []
    for lay in spec["layouts"]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel = ParallelConfig(tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], etp=lay.get("etp"),
                                  sequence_parallel=lay.get("sp", False))
        initialize(parallel)
        rank, world = dist.get_rank(), dist.get_world_size()
        for m in spec["models"]:
            hf = load_hf_config(m["dir"])
            cfg = ModelConfig(path=m["dir"], dtype="fp32", attention="sdpa",
                              moe_token_dispatcher=lay.get("dispatcher", "alltoall"))
            chunks = build_model(hf, cfg, parallel).chunks
            load_hf_weights(chunks, m["dir"], hf)
            case = {"layout": lay["name"], "model": m["key"], "rank": rank,
                    "num_local_experts": len(chunks[0].decoder.layers[0].mlp.local_expert_indices)}
            ref = torch.load(m["ref"])
            logits = forward_logits(chunks, ref["input_ids"], hf["hidden_size"], hf["vocab_size"])
            if logits is not None:
                case["logits_max_abs_diff"] = (logits - ref["logits"]).abs().max().item()
            ref_sd = load_file(str(Path(m["dir"]) / "model.safetensors"))
            order = [n for e in expand(hf) if e.export for n in e.hf]
            case["export_all"] = check_export(
                HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], destination="all"), ref_sd, order)
            case["export_dest"] = check_export(
                HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], destination=world - 1), ref_sd,
                order)
            del chunks
            if lay.get("train", True):
                case["train"] = train(hf, m["dir"], parallel, aux=tuple(lay.get("aux", (0.01, 0.001))))
            results.append(case)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
