"""torchrun worker for layout parity: `reference` (world of 1, TP=1) or `layout` with one or more layouts.

    python -m torch.distributed.run --nproc_per_node 1 tests/engine/parity_worker.py reference OUT MODELS
    python -m torch.distributed.run --nproc_per_node 2 tests/engine/parity_worker.py layout OUT MODELS \
        2,1,0,recompute 1,2,0 1,1,0 1,2,2          # TP,PP,VPP[,recompute]; DP is what is left of the world

The reference run builds each tiny model at TP=1 (fp32), saves its initial weights as Megatron dist
checkpoints, trains two Adam steps on fixed data with padded micro batches and records log-probs, entropies,
losses, grad norms, the step-1 gradients and the final weights (as dist checkpoints, so any layout can load them
resharded). It also checks, at TP=1 only, that padded and packed micro batches agree and that the engine's
micro-batched, normalised gradients equal plain autograd of the full-batch loss.

Each layout loads the initial weights resharded, uses packed micro batches (dynamic batching, each DP rank its
share of the sequences) and writes, per rank, the largest differences from the reference to OUT/<tag>/rank<r>.json.
The test (test_parity.py) holds the tolerances.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main():
    from megatron.core import parallel_state

    import engine_cases as C
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.parallel import destroy, initialize

    mode = sys.argv[1]
    C.make_models(Path(sys.argv[3]))
    # reference: TP=1 on a world of one. layout: one or more "TP,PP,VPP[,recompute]" run one after another in
    # this world (the Megatron parallel state is rebuilt for each).
    layouts = [(1, 1, 0, "")] if mode == "reference" else [
        tuple(int(x) for x in spec.split(",")[:3]) + (",".join(spec.split(",")[3:]),) for spec in sys.argv[4:]]
    for tp, pp, vpp, flags in layouts:
        parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp or None)
        initialize(parallel)
        run_layout(parallel, flags)
        parallel_state.destroy_model_parallel()
    destroy()


def run_layout(parallel, flags):
    import torch.distributed as dist
    from megatron.core import parallel_state

    import engine_cases as C
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.engine import TrainEngine, global_count, make_micro_batches, unpack
    from mcore_rl.engine import checkpoint as ckpt
    from mcore_rl.models import load_hf_config

    mode, out, paths = sys.argv[1], Path(sys.argv[2]), C.make_models(Path(sys.argv[3]))
    ref = out / "ref"
    tp, pp, vpp = parallel.tp, parallel.pp, parallel.vpp
    rank = dist.get_rank()
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    all_seqs = C.sequences()
    my_index = [i for i in range(len(all_seqs)) if i % dp == dp_rank]
    my_seqs = [all_seqs[i] for i in my_index]
    optim = OptimConfig(lr=C.LR, clip_grad=1.0, weight_decay=0.01, adam_eps=C.ADAM_EPS)

    def batches(engine, seqs, packed):
        if packed:
            return make_micro_batches(seqs, max_tokens=32, packed=True, multiple_of=engine.micro_batch_multiple)
        return make_micro_batches(seqs, micro_batch_size=2, packed=False)

    def per_seq(outputs, mbs, key):
        return unpack([o[key] for o in outputs], mbs)

    report = {}
    for arch, path in paths.items():
        hf = load_hf_config(path)
        cfg = C.model_cfg(path)
        res = {}
        engine = TrainEngine(hf, cfg, parallel, optim)
        if mode == "reference":
            ckpt.save(ref / arch / "init", engine.model_chunks)
        else:
            ckpt.load(ref / arch / "init", engine.model_chunks)
        mbs = batches(engine, my_seqs, packed=mode != "reference")
        norm = global_count(mbs, "loss_mask")
        assert norm == C.num_loss_tokens(all_seqs), (norm, C.num_loss_tokens(all_seqs))

        outs = engine.compute_logprobs(mbs, with_entropy=True)
        outs_t = engine.compute_logprobs(mbs, temperature=0.7)
        seq_out = {"logprobs": per_seq(outs, mbs, "logprobs"), "entropy": per_seq(outs, mbs, "entropy"),
                   "logprobs_t07": per_seq(outs_t, mbs, "logprobs")}

        losses, grad_norms, metrics = [], [], []
        for step in range(C.STEPS):
            engine.zero_grad()
            fb = engine.forward_backward(mbs, C.policy_loss, normalizer=norm, with_entropy=True)
            if step == 0:
                grads1 = C.grads_by_name(engine)
            ok, grad_norm, _ = engine.optimizer_step()
            assert ok
            losses.append(fb.loss)
            metrics.append(fb.metrics)
            grad_norms.append(grad_norm)
        params2 = C.params_by_name(engine.model_chunks)

        # The critic: same backbone, value head; values and step-1 gradients of a squared-error loss.
        critic = TrainEngine(hf, C.model_cfg(path, critic=True), parallel, optim, value_head=True)
        if mode == "reference":
            ckpt.save(ref / arch / "critic_init", critic.model_chunks)
        else:
            ckpt.load(ref / arch / "critic_init", critic.model_chunks)
        cmbs = batches(critic, my_seqs, packed=mode != "reference")
        seq_out["values"] = per_seq(critic.compute_values(cmbs), cmbs, "values")
        critic.zero_grad()
        cfb = critic.forward_backward(cmbs, C.value_loss, normalizer=norm)
        critic_grads1 = C.grads_by_name(critic)

        if mode == "reference":
            C.save_tensors_as_model(grads1, hf, cfg, parallel, ref / arch / "grads1")
            C.save_tensors_as_model(params2, hf, cfg, parallel, ref / arch / "params2")
            C.save_tensors_as_model(critic_grads1, hf, C.model_cfg(path, critic=True), parallel,
                                    ref / arch / "critic_grads1", critic=True)
            torch.save({k: [t.clone() for t in v] for k, v in seq_out.items()}, ref / arch / "per_seq.pt")
            res.update(losses=losses, grad_norms=grad_norms, metrics=metrics, critic_loss=cfb.loss)

            # TP=1 only: packed == padded, and the engine's micro-batched gradient == plain autograd.
            pmbs = batches(engine, my_seqs, packed=True)
            check = TrainEngine(hf, cfg, parallel, optim)
            ckpt.load(ref / arch / "init", check.model_chunks)
            packed_out = check.compute_logprobs(pmbs, with_entropy=True)
            res["packed_vs_padded_logprobs"] = max(
                (a - b).abs().max().item()
                for a, b in zip(per_seq(packed_out, pmbs, "logprobs"), seq_out["logprobs"]))
            res["packed_vs_padded_entropy"] = max(
                (a - b).abs().max().item()
                for a, b in zip(per_seq(packed_out, pmbs, "entropy"), seq_out["entropy"]))
            check.zero_grad()
            pfb = check.forward_backward(pmbs, C.policy_loss, normalizer=norm, with_entropy=True)
            res["packed_loss"] = pfb.loss
            res["packed_vs_padded_grads"] = C.max_diff(C.grads_by_name(check), grads1)

            # Plain autograd over one padded batch of all sequences, full-vocabulary log_softmax.
            from mcore_rl.models import build_model

            plain = build_model(hf, cfg, parallel).chunks  # no lm_head row selection: a plain GPTModel forward
            ckpt.load(ref / arch / "init", plain)
            model = plain[0]
            everything = make_micro_batches(all_seqs, micro_batch_size=len(all_seqs), packed=False)[0]
            logits = model(everything.input_ids, everything.position_ids, None).float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            lp = logp.gather(-1, everything.input_ids[:, 1:, None]).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
            lp = torch.nn.functional.pad(lp, (1, 0))
            ent = torch.nn.functional.pad(ent, (1, 0))
            valid = everything.valid_mask.float()
            lp, ent = lp * valid, ent * valid
            mask, adv = everything["loss_mask"], everything["advantages"]
            loss = ((-(adv * lp) - 0.01 * ent) * mask).sum() / mask.sum()
            names = [n for n, _ in model.named_parameters()]
            grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
            plain_grads = {f"0.{n}": g for n, g in zip(names, grads)}
            res["plain_vs_engine_grads"] = C.max_diff(grads1, plain_grads)
            res["plain_vs_engine_loss"] = abs(loss.item() - losses[0])
            plain_lp = [lp[j, :n] for j, n in enumerate(C.LENGTHS)]
            plain_ent = [ent[j, :n] for j, n in enumerate(C.LENGTHS)]
            masks = [s["loss_mask"] for s in all_seqs]

            def masked_gap(a, b, keep):
                return max(((x - y) * m).abs().max().item() for x, y, m in zip(a, b, keep))

            # lm_head=loss_tokens (the default): log-probs / entropies at the loss mask's tokens, 0 elsewhere
            res["plain_vs_engine_logprobs"] = masked_gap(plain_lp, seq_out["logprobs"], masks)
            res["plain_vs_engine_entropy"] = masked_gap(plain_ent, seq_out["entropy"], masks)
            res["engine_outside_loss_mask"] = max((x * (1 - m)).abs().max().item()
                                                  for key in ("logprobs", "entropy", "logprobs_t07")
                                                  for x, m in zip(seq_out[key], masks))
            logp_t = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1)
            lp_t = torch.nn.functional.pad(logp_t.gather(-1, everything.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
            res["plain_vs_engine_logprobs_t07"] = masked_gap([lp_t[j, :n] for j, n in enumerate(C.LENGTHS)],
                                                             seq_out["logprobs_t07"], masks)
            # lm_head=all: every position (entry 0 of a sequence has no prediction), and the same gradients
            full = TrainEngine(hf, C.model_cfg(path, lm_head="all"), parallel, optim)
            ckpt.load(ref / arch / "init", full.model_chunks)
            full_out = full.compute_logprobs(mbs, with_entropy=True)
            after_first = [torch.arange(n) > 0 for n in C.LENGTHS]
            res["plain_vs_lm_head_all_logprobs"] = masked_gap(plain_lp, per_seq(full_out, mbs, "logprobs"), after_first)
            res["plain_vs_lm_head_all_entropy"] = masked_gap(plain_ent, per_seq(full_out, mbs, "entropy"), after_first)
            res["lm_head_all_prompt_logprobs"] = min(x[1:C.PROMPT_LEN].abs().min().item()
                                                     for x in per_seq(full_out, mbs, "logprobs"))
            full.zero_grad()
            ffb = full.forward_backward(mbs, C.policy_loss, normalizer=norm, with_entropy=True)
            res["lm_head_all_loss"] = ffb.loss
            res["lm_head_all_vs_loss_tokens_grads"] = C.max_diff(C.grads_by_name(full), grads1)
        else:
            reference = torch.load(ref / arch / "per_seq.pt")
            for key, mine in seq_out.items():
                res[f"{key}_diff"] = max((m - reference[key][i]).abs().max().item() for m, i in zip(mine, my_index))
            ref_grads = C.load_model_tensors(hf, cfg, parallel, ref / arch / "grads1")
            res["grads1"] = C.max_diff(grads1, ref_grads)
            res["params2"] = C.max_diff(params2, C.load_model_tensors(hf, cfg, parallel, ref / arch / "params2"))
            ccfg = C.model_cfg(path, critic=True)
            res["critic_grads1"] = C.max_diff(
                critic_grads1, C.load_model_tensors(hf, ccfg, parallel, ref / arch / "critic_grads1", critic=True))
            res.update(losses=losses, grad_norms=grad_norms, metrics=metrics, critic_loss=cfb.loss)
            if "recompute" in flags:
                for recompute in ("selective", "full"):
                    rc = TrainEngine(hf, C.model_cfg(path, recompute=recompute), parallel, optim)
                    ckpt.load(ref / arch / "init", rc.model_chunks)
                    rc.zero_grad()
                    rfb = rc.forward_backward(mbs, C.policy_loss, normalizer=norm, with_entropy=True)
                    res[f"recompute_{recompute}_grads1"] = C.max_diff(C.grads_by_name(rc), ref_grads)
                    res[f"recompute_{recompute}_vs_none"] = C.max_diff(C.grads_by_name(rc), grads1)
                    res[f"recompute_{recompute}_loss"] = rfb.loss
        report[arch] = res

    if tp > 1:
        report["vocab_parallel_fn"] = check_vocab_parallel_function()
    tag = "ref" if mode == "reference" else f"tp{tp}_pp{pp}_vpp{vpp or 0}_dp{dp}"
    (out / tag).mkdir(parents=True, exist_ok=True)
    C.write_json(out / tag / f"rank{rank}.json", report)


def check_vocab_parallel_function() -> dict:
    """vocab_parallel_logprobs over this rank's vocabulary slice (TP group) vs log_softmax of the full logits,
    with vocabulary padding at the end of the last slice, a temperature and entropy; values and gradients."""
    from megatron.core import parallel_state

    from mcore_rl.engine.logprobs import vocab_parallel_logprobs

    group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(7)
    padded, vocab, temperature = 8 * tp, 8 * tp - 3, 0.8
    full = 4 * torch.randn(3, 5, padded, generator=g)
    full[..., vocab:] = 100.0  # padding with huge logits must still get probability 0
    target = torch.randint(0, vocab, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    width = padded // tp
    local = full[..., tp_rank * width:(tp_rank + 1) * width].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(local, target, vocab, temperature=temperature, with_entropy=True, group=group)
    (lp * w_lp + ent * w_ent).sum().backward()

    ref_in = full.clone().requires_grad_()
    logp = torch.log_softmax(ref_in[..., :vocab] / temperature, dim=-1)
    ref_lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    ref_grad = ref_in.grad[..., tp_rank * width:(tp_rank + 1) * width]
    return {"logprobs": (lp - ref_lp).abs().max().item(), "entropy": (ent - ref_ent).abs().max().item(),
            "grad": (local.grad - ref_grad).abs().max().item(), "grad_scale": ref_grad.abs().max().item(),
            "padding_grad": local.grad[..., vocab - tp_rank * width:].abs().max().item() if tp_rank == tp - 1 else 0.0}


if __name__ == "__main__":
    main()
