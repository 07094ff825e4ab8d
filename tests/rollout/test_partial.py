"""Partial rollouts (mcore_rl/rollout/partial.py): a generate call stopped by an Interrupt and continued from each
sample's prefix gives, with unchanged weights, greedy or seeded, exactly the tokens and (within fp32 noise) the
log-probs of an uninterrupted call; the versions say which part came after the interrupt. Real SGLang on
CPU, in-process and as a server (the two backends abort differently)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import cpu_config
from mcore_rl.rollout import RolloutEngine
from mcore_rl.rollout.backend import Interrupt
from mcore_rl.rollout.partial import continue_samples, num_segments, stamp, unfinished

NEW = 160  # about 4 s of decoding on the CI machines: the interrupt, 0.5 s in, lands mid-generation
# fp32 SGLang recomputing a prefix gives the same logits up to summation order: log-probs agree to ~1e-6
# (FACTS); 1e-4 is far below what a wrong token or a shifted position would give (> 1e-2 on this model).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=["engine", "server"])
def engine(models, request):
    eng = RolloutEngine(cpu_config(mode=request.param), model_path=models["m0"])
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interrupted_samples_continue_to_the_uninterrupted_result(engine, temperature):
    """Greedy, and sampled with the per-sample seeds (rollout.deterministic, on for CPU): SGLang draws a seed's
    noise per absolute position, so the continuation with the sample's own seed draws what it would have."""
    prompts = [[11, 42, 7, 300, 5], [9, 8, 7], [100, 200, 300, 400]]
    sampling = engine.default_sampling(temperature=temperature, max_new_tokens=NEW, ignore_eos=True)
    reference = engine.generate(prompts, n=2, sampling=sampling).samples

    interrupt = Interrupt()
    timer = threading.Timer(0.5, interrupt.fire)
    timer.start()
    try:
        batch = engine.generate(prompts, n=2, sampling=sampling, interrupt=interrupt)
    finally:
        timer.cancel()
    samples = batch.samples
    stamp(samples, 0)
    cut = [len(s.response_ids) for s in samples]
    assert all(s.finish_reason == "abort" for s in samples), [s.finish_reason for s in samples]
    assert all(c < NEW for c in cut), cut
    engine.wait_idle()  # the aborted requests have left the scheduler

    assert continue_samples(engine, samples, sampling, 1) == len(samples)
    assert not unfinished(samples)
    for s, ref, c in zip(samples, reference, cut):
        assert s.response_ids == ref.response_ids, (c, s.response_ids, ref.response_ids)
        assert s.finish_reason == "length" and len(s.rollout_logprobs) == NEW
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(ref.rollout_logprobs),
                                   atol=LOGPROB_TOL, rtol=0)
        assert s.versions == [0] * c + [1] * (NEW - c)
        # a sample the interrupt stopped before its first token (or before it was sent) is all version 1
        assert s.policy_version == (0 if c else 1) and num_segments(s) == (2 if c else 1)


def test_a_continuation_is_cut_at_each_samples_own_budget(engine):
    sampling = engine.default_sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    reference = engine.generate([[11, 42, 7]], n=1, sampling=sampling).samples[0]
    # Two samples stopped after 3 and 9 tokens (made by cutting the reference): one continuation call of 9 new
    # tokens, each sample cut at 12 in all.
    a, b = (reference.__class__(prompt_ids=[11, 42, 7], response_ids=reference.response_ids[:k],
                                rollout_logprobs=reference.rollout_logprobs[:k], finish_reason="abort",
                                group_id=g, versions=[0] * k) for k, g in ((3, 0), (9, 1)))
    assert continue_samples(engine, [a, b], sampling, 5) == 2
    for s, k in ((a, 3), (b, 9)):
        assert s.response_ids == reference.response_ids and s.finish_reason == "length"
        assert s.versions == [0] * k + [5] * (12 - k)


def test_an_interrupt_fired_before_the_call_sends_nothing(engine):
    interrupt = Interrupt()
    interrupt.fire()
    batch = engine.generate([[1, 2, 3]], n=3, interrupt=interrupt,
                            sampling=engine.default_sampling(temperature=0.0, max_new_tokens=8))
    assert [(s.finish_reason, s.response_ids) for s in batch.samples] == [("abort", [])] * 3
