"""Training throughput: the project's actor update (TrainEngine.train_step with a policy-gradient loss over
packed micro batches) against a raw Megatron-Core loop (GPTModel forward with labels, cross-entropy mean,
backward, Megatron optimizer step) on the same model dims and the same tokens, interleaved in one process so the
ratio holds on a noisy machine. Also packed against padded micro batches on variable-length sequences.

MFU counts (6 N + 12 L h s) FLOPs per token (N = parameters without embeddings' lookups, L layers, h hidden,
s sequence length), against `peak_tflops` (772 TFLOP/s: an H200's dense bf16 matmul rate, the figure the MFU
columns of docs/performance.md use).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from mcore_rl.bench.common import timed

QWEN2_5_0_5B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False, hidden_act="silu")
QWEN2_5_1_5B = dict(QWEN2_5_0_5B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2)
# Larger dims for the weight-sync scaling figures (the random folders of make_random_model.py tie embeddings).
QWEN2_5_3B = dict(QWEN2_5_0_5B, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2)
QWEN2_5_7B = dict(QWEN2_5_0_5B, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
TINY = dict(QWEN2_5_0_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, expert FFN 768, top-8 routing,
# vocabulary 151936) scaled to fit one GPU twice (ours and the raw loop side by side): 8 layers instead of 48, 32
# experts instead of 128. 1.98B parameters, 1.07B active per token (0.45B without the output layer).
QWEN3_MOE_2B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                    intermediate_size=6144, moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False, hidden_act="silu")
TINY_MOE = dict(QWEN3_MOE_2B, hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
MODELS = {"qwen2.5-0.5b": QWEN2_5_0_5B, "qwen2.5-1.5b": QWEN2_5_1_5B, "qwen2.5-3b": QWEN2_5_3B,
          "qwen2.5-7b": QWEN2_5_7B, "tiny": TINY, "qwen3-moe-2b": QWEN3_MOE_2B, "tiny-moe": TINY_MOE}


def flops_per_token(hf: dict, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token passes through (for an MoE: the router and its top-k
    experts only, the active parameters) + attention's 12 L h s."""
    h, L, v = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or h // heads
    attn = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h
    if hf.get("num_experts"):
        mlp = h * hf["num_experts"] + hf["num_experts_per_tok"] * 3 * h * hf["moe_intermediate_size"]
    else:
        mlp = 3 * h * hf["intermediate_size"]
    n = L * (attn + mlp) + h * v  # the LM head matmul counts; the embedding lookup does not
    return 6 * n + 12 * L * (heads * hd) * seq_len


def _seqs(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        mask = torch.ones(n)
        mask[: n // 4] = 0  # a "prompt" quarter without loss
        seqs.append({"input_ids": ids, "loss_mask": mask, "advantages": torch.randn(n, generator=g).sign()})
    return seqs


def _pg_loss(normalizer):
    def loss_fn(out, mb):
        m = mb["loss_mask"]
        return -(out["logprobs"] * mb["advantages"] * m).sum() / normalizer, {}

    return loss_fn


def _chunks(ids: torch.Tensor, micro_batch_rows: int | None):
    """(ids, positions, next-token labels) of each micro batch of `micro_batch_rows` rows (default: one)."""
    rows = ids.size(0) if micro_batch_rows is None else max(1, micro_batch_rows)
    for chunk in ids.split(rows):
        yield chunk, torch.arange(chunk.size(1), device=chunk.device).expand_as(chunk), torch.roll(chunk, -1, dims=1)


class RawMegatron:
    """The raw baseline: GPTModel (same builder, same dims) forward with labels -> Megatron's vocab-parallel
    cross entropy, mean, backward, Megatron's distributed optimizer step. No packing, no log-prob gathering."""

    def __init__(self, hf: dict, model_cfg, parallel):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from mcore_rl.config.optim import OptimConfig
        from mcore_rl.engine.optimizer import wrap_ddp
        from mcore_rl.models.builder import build_model

        chunks = build_model(hf, model_cfg, parallel).chunks  # the raw baseline: no lm_head row selection
        self.ddp = wrap_ddp(chunks, OptimConfig(lr=1e-6))
        chunks[0].config.calculate_per_token_loss = False
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-6, bf16=model_cfg.dtype == "bf16",
                               params_dtype=chunks[0].config.params_dtype, use_distributed_optimizer=True,
                               clip_grad=1.0)
        self.opt = get_megatron_optimizer(ocfg, self.ddp)
        self.device = next(chunks[0].parameters()).device

    def step(self, ids: torch.Tensor, micro_batch_rows: int | None = None) -> None:
        """One update on ids [b, s] (next-token labels), in micro batches of `micro_batch_rows` rows (gradients
        accumulate; default: one micro batch)."""
        self.ddp[0].zero_grad_buffer()
        self.opt.zero_grad()
        for chunk, pos, labels in _chunks(ids, micro_batch_rows):
            loss = self.ddp[0](chunk, pos, None, labels=labels).float().sum() / ids.numel()
            loss.backward()
        self.ddp[0].finish_grad_sync()
        self.opt.step()

    @torch.no_grad()
    def forward_only(self, ids: torch.Tensor, micro_batch_rows: int | None = None) -> None:
        """The raw counterpart of a forward-only pass (a reference model's or the old policy's log-probs): forward
        with labels, Megatron's per-token cross entropy (minus the log-probs), no backward."""
        for chunk, pos, labels in _chunks(ids, micro_batch_rows):
            self.ddp[0](chunk, pos, None, labels=labels)


def _module_kinds(engine, names) -> str:
    """Which of these module classes the engine's model holds (what a layer spec or setting resolved to)."""
    found = {type(m).__name__ for c in engine.model_chunks for m in c.modules()}
    return ",".join(n for n in names if n in found)


def run(model: str = "qwen2.5-0.5b", seq_len: int = 2048, tokens_per_step: int = 16384, iters: int = 6,
        warmup: int = 2, dtype: str = "bf16", peak_tflops: float = 772.0, variable: bool = True,
        recompute: str = "none", fast_optimizer: str = "auto", fused_swiglu: str = "auto",
        lm_head: str = "all", packed_rope: bool = True, compile_rope: str = "off", attention: str = "sdpa") -> dict:
    """Benchmark in this process (parallel state must be initialised with TP=PP=DP=1).

    lm_head: our update's ModelConfig.lm_head. all (default) does the raw loop's work, logits at every position;
    loss_tokens (the trainer's default) skips the positions the loss does not read (a quarter here), and the MFU
    then counts the output layer's FLOPs only where it ran. fused_swiglu, packed_rope, compile_rope: the
    ModelConfig options of both sides (RoPE is process-wide: models/rope.py). attention: ModelConfig.attention of
    both sides (sdpa: the local layer spec with torch SDPA; te: Transformer Engine's layer spec)."""
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.optim import OptimConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.engine.batching import make_micro_batches
    from mcore_rl.models.lm_head import positions as logit_positions

    hf = MODELS[model]
    model_cfg = ModelConfig(dtype=dtype, attention=attention, max_seq_len=seq_len, recompute=recompute,
                            fused_swiglu=fused_swiglu, lm_head=lm_head, packed_rope=packed_rope,
                            compile_rope=compile_rope)
    parallel = ParallelConfig()
    n_seq = tokens_per_step // seq_len
    fixed = _seqs([seq_len] * n_seq, hf["vocab_size"], 0)

    # ---- ours: TrainEngine, packed micro batches (one micro batch of the step's tokens) ----------------------
    ours = TrainEngine(hf, model_cfg, parallel, OptimConfig(lr=1e-6, clip_grad=1.0, fast_optimizer=fast_optimizer))
    mbs = make_micro_batches(fixed, tokens_per_step)
    n_tok = sum(mb["loss_mask"].sum().item() for mb in mbs)

    def our_step():
        ours.train_step(mbs, _pg_loss(n_tok))

    # ---- raw Megatron: forward with labels -> vocab-parallel cross entropy, backward, optimizer step ------------
    raw = RawMegatron(hf, dataclasses.replace(model_cfg, lm_head="all"), parallel)
    ids = torch.stack([s["input_ids"] for s in fixed]).to(raw.device)

    def raw_step():
        raw.step(ids)

    for _ in range(warmup):
        our_step(), raw_step()
    t_ours, t_raw = [], []
    for _ in range(iters):  # interleaved
        t_ours.append(timed(our_step)[0])
        t_raw.append(timed(raw_step)[0])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    med_ours, med_raw = statistics.median(t_ours), statistics.median(t_raw)
    fpt = flops_per_token(hf, seq_len)
    our_fpt = fpt
    if lm_head == "loss_tokens":  # the output layer ran only at the positions predicting a loss token
        ran = sum(logit_positions(mb["loss_mask"])[0][0].numel() for mb in mbs) / (n_seq * seq_len)
        our_fpt = fpt - (1 - ran) * 6 * hf["hidden_size"] * hf["vocab_size"]
    result = {
        "model": model, "dtype": dtype, "recompute": recompute, "seq_len": seq_len, "tokens_per_step": n_seq * seq_len,
        "train.fast_optimizer": ours.fast_optimizer, "train.fused_swiglu": fused_swiglu, "train.lm_head": lm_head,
        "train.packed_rope": packed_rope, "train.compile_rope": compile_rope, "train.attention": attention,
        "train.core_attention": _module_kinds(ours, ("SDPAttention", "TEDotProductAttention", "DotProductAttention")),
        "train.experts": _module_kinds(ours, ("TEGroupedMLP", "SequentialMLP", "GroupedMLP")) or "dense",
        "train.step_s": med_ours, "train.raw_step_s": med_raw,
        "train.tokens_per_s": n_seq * seq_len / med_ours, "train.raw_tokens_per_s": n_seq * seq_len / med_raw,
        "train.ratio_vs_raw": med_raw / med_ours,
    }
    if torch.cuda.is_available():
        result["train.mfu"] = result["train.tokens_per_s"] * our_fpt / (peak_tflops * 1e12)
        result["train.raw_mfu"] = result["train.raw_tokens_per_s"] * fpt / (peak_tflops * 1e12)
    del raw

    if variable:  # packed vs padded on variable lengths with the same token total
        g = torch.Generator().manual_seed(1)
        lengths, total = [], 0
        while total < tokens_per_step:
            n = int(torch.randint(seq_len // 8, seq_len + 1, (1,), generator=g))
            n = min(n, tokens_per_step - total)
            lengths.append(n)
            total += n
        var = _seqs(lengths, hf["vocab_size"], 2)
        packed = make_micro_batches(var, tokens_per_step)
        padded = make_micro_batches(var, micro_batch_size=max(1, tokens_per_step // seq_len), packed=False)
        vt = sum(s["loss_mask"].sum().item() for s in var)
        try:
            for _ in range(warmup):
                ours.train_step(packed, _pg_loss(vt)), ours.train_step(padded, _pg_loss(vt))
            tp, tq = [], []
            for _ in range(iters):
                tp.append(timed(lambda: ours.train_step(packed, _pg_loss(vt)))[0])
                tq.append(timed(lambda: ours.train_step(padded, _pg_loss(vt)))[0])
        except torch.OutOfMemoryError as e:  # keep the fixed-length figures above (seen with TE's unfused attention)
            result["train.var_error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
        else:
            result.update({"train.var_num_seqs": len(lengths),
                           "train.packed_tokens_per_s": total / statistics.median(tp),
                           "train.padded_tokens_per_s": total / statistics.median(tq),
                           "train.packed_vs_padded": statistics.median(tq) / statistics.median(tp)})
    if torch.cuda.is_available():
        result["train.peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result
