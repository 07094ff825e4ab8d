"""In-process SGLang engine (mode=engine) on CPU, fp32: generation against HF transformers, sampling options,
and the three weight paths (tensor buckets, gloo broadcast, disk), each checked by generating with the new
weights. One engine serves the whole module; every weight test leaves it holding m0 again."""

from __future__ import annotations

import pytest
import torch

from conftest import LOGPROB_TOL, NUM_NEW, assert_matches_hf, buckets, cpu_config, hf_weights
from mcore_rl.rollout import RolloutEngine, RolloutEngineError
from mcore_rl.weight_sync.distributed import DistributedWeightSender


@pytest.fixture(scope="module")
def engine(models):
    eng = RolloutEngine(cpu_config(mode="engine"), model_path=models["m0"])
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(hf):
    return {name: ref.stable_prompts() for name, ref in hf.items()}


def test_greedy_equals_hf_generate(engine, hf, prompts):
    # 4 prompts in requests of 4 samples, plus duplicates so that several requests run concurrently
    assert_matches_hf(engine, hf["m0"], prompts["m0"] * 3)


def test_sampled_logprobs_equal_hf_log_softmax(engine, hf):
    prompt = [11, 42, 7, 300, 5]
    batch = engine.generate([prompt], n=6, sampling=engine.default_sampling(temperature=1.0, max_new_tokens=12,
                                                                            ignore_eos=True))
    assert len({tuple(s.response_ids) for s in batch.samples}) > 1  # really sampled
    for s in batch.samples:
        assert len(s.rollout_logprobs) == len(s.response_ids) == 12 and s.finish_reason == "length"
        ref = hf["m0"].logprobs(prompt, s.response_ids)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), ref, atol=LOGPROB_TOL, rtol=0)


def test_n_samples_share_group_ids_and_carry_meta(engine):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    metas = [{"answer": "a"}, {"answer": "b"}, {"answer": "c"}]
    batch = engine.generate(prompts, n=3, first_group_id=100, metas=metas, prompt_texts=["p0", "p1", "p2"],
                            sampling=engine.default_sampling(max_new_tokens=4), show_progress=True)
    assert len(batch) == 9 and batch.weight_version == engine.weight_version
    for k, s in enumerate(batch.samples):
        i = k // 3
        assert s.group_id == 100 + i and s.prompt_ids == prompts[i] and s.prompt_text == f"p{i}"
        assert s.meta == metas[i] and s.meta is not metas[i]
        assert 1 <= len(s.response_ids) <= 4 and s.finish_reason in ("stop", "length")


def test_stop_token_ids_end_the_response(engine, prompts):
    prompt, greedy = prompts["m0"][0]
    stop_at = 3
    stop_token = greedy[stop_at]
    first = greedy.index(stop_token)  # generation stops at the first occurrence
    sampling = engine.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW, stop_token_ids=[stop_token])
    sample = engine.generate([prompt], sampling=sampling).samples[0]
    assert sample.response_ids == greedy[:first + 1]  # the stop token is kept, as EOS would be
    assert sample.finish_reason == "stop" and len(sample.rollout_logprobs) == first + 1


def test_stop_strings_need_the_tokenizer(engine):
    with pytest.raises(ValueError, match="need SGLang's tokenizer"):
        engine.generate([[1, 2]], sampling=engine.default_sampling(stop=("x",)))


def test_tensor_sync_in_buckets_switches_to_the_new_model(engine, models, hf, prompts):
    version = engine.weight_version
    with engine.weights.weight_update():
        for bucket in buckets(hf_weights(models["m1"]), 3):
            engine.weights.update_bucket(bucket)
    assert engine.weight_version == version + 1
    assert_matches_hf(engine, hf["m1"], prompts["m1"])
    assert engine.weights.update_weights_from_tensors(hf_weights(models["m0"])) == version + 2
    assert_matches_hf(engine, hf["m0"], prompts["m0"])


def test_distributed_sync_over_gloo(engine, models, hf, prompts):
    version = engine.weight_version
    with DistributedWeightSender(engine, backend="gloo") as sender:
        assert sender.sync(buckets(hf_weights(models["m1"]), 4)) == version + 1
        assert_matches_hf(engine, hf["m1"], prompts["m1"])
        assert sender.sync(iter(buckets(hf_weights(models["m0"]), 2))) == version + 2
    assert_matches_hf(engine, hf["m0"], prompts["m0"])


def test_disk_sync(engine, models, hf, prompts):
    version = engine.weight_version
    assert engine.weights.update_weights_from_disk(models["m1"]) == version + 1
    assert_matches_hf(engine, hf["m1"], prompts["m1"])
    engine.weights.update_weights_from_disk(models["m0"])
    assert_matches_hf(engine, hf["m0"], prompts["m0"])


def test_failed_sync_blocks_generation_until_a_complete_one(engine, models, hf, prompts):
    version = engine.weight_version
    good = hf_weights(models["m1"])
    with pytest.raises(OSError, match="bridge lost a shard"):  # e.g. the trainer fails while building buckets
        with engine.weights.weight_update():
            engine.weights.update_bucket(good[:5])
            raise OSError("bridge lost a shard")
    assert engine.weight_version == version
    with pytest.raises(RolloutEngineError, match="holds a mix of old and new weights"):
        engine.generate([[1, 2, 3]])
    engine.weights.update_weights_from_tensors(hf_weights(models["m0"]))
    assert_matches_hf(engine, hf["m0"], prompts["m0"])
    # the same through the explicit calls a multi-rank trainer makes
    engine.weights.begin_update()
    engine.weights.update_bucket(good[:5])
    engine.weights.abort_update("export failed on another rank")
    assert not engine.weights.sync_open and engine.weight_version == version + 1
    with pytest.raises(RolloutEngineError, match=r"failed part-way \(export failed on another rank\)"):
        engine.generate([[1, 2, 3]])
    engine.weights.update_weights_from_tensors(hf_weights(models["m0"]))
    assert_matches_hf(engine, hf["m0"], prompts["m0"])


def test_sync_misuse_is_reported(engine):
    with pytest.raises(RuntimeError, match="needs an open weight sync"):
        engine.weights.update_bucket([])
    engine.weights.begin_update()
    with pytest.raises(RuntimeError, match="weight sync is open"):
        engine.generate([[1, 2]])
    with pytest.raises(RuntimeError, match="already open"):
        engine.weights.begin_update()
    engine.weights.end_update()


def test_release_and_resume_memory(engine, hf, prompts):
    engine.release_memory()
    with pytest.raises(RuntimeError, match="memory is released"):
        engine.generate([[1, 2]])
    engine.resume_memory(["kv_cache"])
    engine.resume_memory(["weights"])
    assert_matches_hf(engine, hf["m0"], prompts["m0"])  # CPU frees nothing, so the weights are still there
    with pytest.raises(ValueError, match="memory tags must be among"):
        engine.release_memory(["optimizer"])


def test_request_timeout_aborts_and_engine_stays_usable(engine, hf, prompts):
    sampling = engine.default_sampling(temperature=1.0, max_new_tokens=480, ignore_eos=True)
    with pytest.raises(RolloutEngineError, match=r"did not finish within 0.001 s \(rollout.request_timeout_s\)"):
        engine.generate([[5, 6, 7]], n=8, sampling=sampling, timeout_s=0.001)
    assert engine.alive
    assert_matches_hf(engine, hf["m0"], prompts["m0"])
