"""Rollout throughput: generated tokens per second through RolloutEngine.generate against the raw
sglang.Engine.generate on the same engine object (the one the RolloutEngine holds, so both sides share the
engine's scheduler processes, weights and KV cache), with the same prompts as token ids and the same sampling
parameters (ignore_eos, so every sample has exactly max_new_tokens tokens; return_logprob=True on both sides).
Repeats alternate between the two sides; the ratio is of medians.

What the ratio measures: our request splitting (rollout.request_batch_size, max_concurrent_requests), the
per-request bookkeeping and the conversion of outputs into Samples, against one call with every sample.
"""

from __future__ import annotations

from mcore_rl.bench.common import median, raw_sglang, timed


def run(engine, prompts: list[list[int]], n: int, max_new_tokens: int, repeats: int = 3, warmup: int = 1,
        temperature: float = 1.0) -> dict:
    sampling = engine.default_sampling(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True)
    raw = raw_sglang(engine)
    raw_ids = [list(p) for p in prompts for _ in range(n)]
    raw_params = sampling.to_sglang()

    def ours() -> int:
        batch = engine.generate(prompts, n=n, sampling=sampling)
        return sum(len(s.response_ids) for s in batch.samples)

    def theirs() -> int:
        outs = raw.generate(input_ids=raw_ids, sampling_params=raw_params, return_logprob=True)
        return sum(len(o["output_ids"]) for o in outs)

    for _ in range(warmup):
        ours(), theirs()
    t_ours, t_raw, tok_ours, tok_raw = [], [], 0, 0
    for _ in range(repeats):  # interleaved
        t, tok_ours = timed(ours)
        t_ours.append(t)
        t, tok_raw = timed(theirs)
        t_raw.append(t)
    if tok_ours != tok_raw:
        raise RuntimeError(f"the two sides generated different token counts ({tok_ours} vs {tok_raw}) "
                           "despite ignore_eos: the comparison would be unfair")
    med_ours, med_raw = median(t_ours), median(t_raw)
    return {
        "rollout.num_samples": len(raw_ids), "rollout.new_tokens": tok_ours,
        "rollout.seconds": med_ours, "rollout.raw_seconds": med_raw,
        "rollout.tokens_per_s": tok_ours / med_ours, "rollout.raw_tokens_per_s": tok_raw / med_raw,
        "rollout.ratio_vs_raw": med_raw / med_ours,
    }
