"""torchrun worker of test_parity.py: for every layout and every tiny model, load HF weights into the sharded
Megatron model, compare its logits with transformers', export it back (to all ranks, and to one destination rank),
and reload a dist checkpoint saved at the first layout. Each rank writes its findings to OUT/rank<r>.json.

    python -m torch.distributed.run --nproc_per_node 4 tests/bridge/worker_parity.py SPEC.json OUT
"""


def forward_logits(chunks, input_ids, hidden: int, vocab: int):
    """Full-vocab logits [b, s, vocab] on the last stage (None elsewhere); stages pass activations by send/recv."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = chunks[0]
    model.eval()
    group = ps.get_pipeline_model_parallel_group()
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        if stage > 0:
            h = torch.empty(s, b, hidden)
            dist.recv(h, src=dist.get_global_rank(group, stage - 1))
            model.set_input_tensor(h)
        out = model(input_ids, position_ids, attention_mask=None)
        if stage < pp - 1:
            dist.send(out.contiguous(), dst=dist.get_global_rank(group, stage + 1))
            return None
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)[..., :vocab]


def check_export(exporter, ref: dict, order: list[str]) -> dict:
    """Iterate twice; compare with the HF state dict exactly; report bucket sizes (receivers only)."""
    import torch

    runs = []
    for _ in range(2):
        got, sizes, nones = [], [], 0
        for bucket in exporter:
            if bucket is None:
                nones += 1
                continue
            sizes.append(bucket.nbytes)
            got.extend((name, t.clone()) for name, t in bucket)
        runs.append((got, sizes, nones))
    (got, sizes, nones), (got2, _, _) = runs
    plan = exporter.plan()
    result = {
        "received": bool(got),
        "nones": nones,
        "num_buckets": len(plan),
        "bucket_bytes": sizes,
        "plan": [(b.nbytes, len(b.items)) for b in plan],
        "stable_order": [n for n, _ in got] == [n for n, _ in got2],
    }
    if got:
        names = [n for n, _ in got]
        result["names_equal"] = sorted(names) == sorted(ref) and len(names) == len(set(names))
        result["hf_order"] = names == order
        bad = [n for n, t in got if n not in ref or t.dtype != ref[n].dtype or t.shape != ref[n].shape
               or not torch.equal(t, ref[n])]
        result["mismatched"] = bad
    return result


def check_critic(actor_chunks, hf, hf_dir, parallel) -> dict:
    """A critic (value head) takes every HF weight but the output layer; exporting it is refused."""
    from mcore_rl.bridge import HFWeightExporter, load_hf_weights
    from mcore_rl.bridge.bind import bind
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.models import build_model
    from mcore_rl.testing import unequal

    built = build_model(hf, ModelConfig(path=hf_dir, dtype="fp32", attention="sdpa"), parallel, value_head=True)
    critic = built.chunks
    load_hf_weights(critic, hf_dir, hf, critic=built.info.is_critic)
    actor = dict(actor_chunks[0].named_parameters())
    shared = {n: p for n, p in critic[0].named_parameters() if not n.startswith("output_layer.")}
    result = {"unlike_actor": unequal(shared, actor), "num_shared": len(shared)}
    # callers holding only the chunks (critic=None): read from the modules, the same binding
    result["bind_reads_critic"] = ([b.name for b in bind(critic, hf)]
                                   == [b.name for b in bind(critic, hf, critic=True)])
    try:
        HFWeightExporter(critic, hf, critic=built.info.is_critic)
        result["export_refused"] = ""
    except ValueError as err:
        result["export_refused"] = str(err)
    return result


def main():
    import json
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from mcore_rl.bridge import (HFWeightExporter, load_hf_weights, load_mcore_checkpoint,
                                 measure_export_seconds_per_gb, save_mcore_checkpoint)
    from mcore_rl.bridge.maps import expand
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models import build_model, load_hf_config
    from mcore_rl.parallel import initialize

    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results = []
    saved = False
    for tp, pp, vpp in spec["layouts"]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp)
        initialize(parallel)
        rank, world = dist.get_rank(), dist.get_world_size()
        layout = f"tp{tp}_pp{pp}" + (f"_vpp{vpp}" if vpp else "")
        for m in spec["models"]:
            hf = load_hf_config(m["dir"])
            chunks = build_model(hf, ModelConfig(path=m["dir"], dtype="fp32", attention="sdpa"), parallel).chunks
            load_hf_weights(chunks, m["dir"], hf)
            case = {"layout": layout, "model": m["key"], "rank": rank}
            if vpp is None:  # the hand-written forward below has no interleaved schedule
                ref = torch.load(m["ref"])
                logits = forward_logits(chunks, ref["input_ids"], hf["hidden_size"], hf["vocab_size"])
                if logits is not None:
                    case["logits_max_abs_diff"] = (logits - ref["logits"]).abs().max().item()
                    case["logits_max_abs"] = ref["logits"].abs().max().item()
            ref_sd = load_file(str(Path(m["dir"]) / "model.safetensors"))
            order = [n for e in expand(hf) if e.export for n in e.hf]
            case["export_all"] = check_export(
                HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], destination="all"), ref_sd, order)
            case["export_dest"] = check_export(
                HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], destination=world - 1), ref_sd,
                order)
            if m["key"] == spec["models"][0]["key"]:  # export dtype differs from the model's: cast per tensor
                case["export_bf16"] = check_export(
                    HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], dtype=torch.bfloat16),
                    {n: t.to(torch.bfloat16) for n, t in ref_sd.items()}, order)
                case["measure"] = measure_export_seconds_per_gb(
                    HFWeightExporter(chunks, hf, bucket_bytes=spec["bucket_bytes"], destination=0))
                case["hf_bytes"] = sum(t.numel() * t.element_size() for t in ref_sd.values())
                case["critic"] = check_critic(chunks, hf, m["dir"], parallel)
            if m["key"] == spec["ckpt_model"]:
                ckpt = Path(spec["ckpt_dir"])
                if not saved:  # first layout: save
                    if rank == 0:
                        ckpt.mkdir(parents=True, exist_ok=True)
                    dist.barrier()
                    save_mcore_checkpoint(chunks, ckpt)
                    saved = True
                    case["ckpt_saved"] = True
                else:  # later layouts: a fresh (randomly initialised) model from the checkpoint
                    fresh = build_model(hf, ModelConfig(path=m["dir"], dtype="fp32", attention="sdpa"),
                                        parallel).chunks
                    load_mcore_checkpoint(fresh, ckpt)
                    case["ckpt_export"] = check_export(
                        HFWeightExporter(fresh, hf, bucket_bytes=spec["bucket_bytes"]), ref_sd, order)
            results.append(case)
            del chunks
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
