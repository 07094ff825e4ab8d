"""SGLang as an HTTP server (mode=server) launched by RolloutEngine, with SGLang's tokenizer enabled
(skip_tokenizer_init=false) so that stop strings and response text are covered here; attaching a second client
by URL; the three weight paths over HTTP; and a port that is already taken."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import NUM_NEW, assert_matches_hf, buckets, cpu_config, hf_weights
from mcore_rl.rollout import RolloutEngine, RolloutEngineError
from mcore_rl.weight_sync.distributed import DistributedWeightSender


@pytest.fixture(scope="module")
def server(models):
    eng = RolloutEngine(cpu_config(mode="server", skip_tokenizer_init=False), model_path=models["m0"])
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(hf):
    return {name: ref.stable_prompts(seed=1) for name, ref in hf.items()}


def test_greedy_and_logprobs_equal_hf(server, hf, prompts):
    assert server.url.startswith("http://127.0.0.1:")
    assert_matches_hf(server, hf["m0"], prompts["m0"] * 2)


def test_response_text_and_stop_strings(server, models, prompts):
    tok = AutoTokenizer.from_pretrained(models["m0"])
    prompt, greedy = prompts["m0"][0]
    full = server.generate([prompt], sampling=server.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW,
                                                                        ignore_eos=True)).samples[0]
    assert full.response_ids == greedy and full.response_text == tok.decode(greedy, skip_special_tokens=True)
    # stop at the text of tokens 2..3 of the greedy response: generation ends with the token completing it
    stop = tok.decode(greedy[2:4])
    end = next(k for k in range(1, NUM_NEW + 1) if stop in tok.decode(greedy[:k]))
    sample = server.generate([prompt], sampling=server.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW,
                                                                          stop=(stop,))).samples[0]
    assert sample.finish_reason == "stop" and sample.response_ids == greedy[:end]
    assert len(sample.rollout_logprobs) == end


def test_attach_to_running_server(server, hf, prompts):
    attached = RolloutEngine(cpu_config(mode="server", server_url=server.url))
    assert_matches_hf(attached, hf["m0"], prompts["m0"])
    attached.shutdown()  # detaches; the server keeps running
    assert server.alive
    assert_matches_hf(server, hf["m0"], prompts["m0"][:1])


def test_tensor_sync_over_http(server, models, hf, prompts):
    version = server.weight_version
    with server.weights.weight_update():
        for bucket in buckets(hf_weights(models["m1"]), 3):
            server.weights.update_bucket(bucket)
    assert server.weight_version == version + 1
    assert_matches_hf(server, hf["m1"], prompts["m1"])
    server.weights.update_weights_from_tensors(hf_weights(models["m0"]))
    assert_matches_hf(server, hf["m0"], prompts["m0"])


def test_distributed_sync_with_server(server, models, hf, prompts):
    with DistributedWeightSender(server, backend="gloo") as sender:
        sender.sync(buckets(hf_weights(models["m1"]), 2))
        assert_matches_hf(server, hf["m1"], prompts["m1"])
        sender.sync(buckets(hf_weights(models["m0"]), 2))
    assert_matches_hf(server, hf["m0"], prompts["m0"])


def test_disk_sync_and_memory_calls(server, models, hf, prompts):
    server.weights.update_weights_from_disk(models["m1"])
    assert_matches_hf(server, hf["m1"], prompts["m1"])
    server.weights.update_weights_from_disk(models["m0"])
    server.release_memory()
    server.resume_memory()
    assert_matches_hf(server, hf["m0"], prompts["m0"])


def test_port_in_use_is_reported_before_launching(server, models):
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(RolloutEngineError, match=f"port {port} on 127.0.0.1 is already in use. Set rollout.port"):
        RolloutEngine(cpu_config(mode="server", port=port), model_path=models["m0"])


def test_request_timeout_aborts_and_server_stays_usable(server, hf, prompts):
    sampling = server.default_sampling(temperature=1.0, max_new_tokens=480, ignore_eos=True)
    with pytest.raises(RolloutEngineError, match=r"did not finish within 0.001 s \(rollout.request_timeout_s\)"):
        server.generate([[5, 6, 7]], n=8, sampling=sampling, timeout_s=0.001)
    assert server.alive
    assert_matches_hf(server, hf["m0"], prompts["m0"][:2])


def test_stream_takes_prompts_while_it_runs(server, prompts):
    """RolloutEngine.stream over HTTP (the in-process backend's is covered by tests/agent): a prompt submitted
    from another one's completion, while the stream runs, is generated too; greedy tokens equal HF's."""
    import threading

    items = prompts["m0"][:3]
    done, all_done = {}, threading.Event()
    sampling = server.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW, ignore_eos=True)

    def on_sample(key, sample):
        done[key] = sample
        if key == 0:
            stream.submit(2, items[2][0])  # from the engine's thread, mid-stream
        if len(done) == 3:
            all_done.set()

    stream = server.stream(sampling, on_sample)
    stream.submit(0, items[0][0])
    stream.submit(1, items[1][0])
    assert all_done.wait(300), f"the stream finished {sorted(done)} of 3 prompts (hang guard, not a timing test)"
    stream.close()
    assert stream.failed() is None
    for k, (prompt, greedy) in enumerate(items):
        assert done[k].prompt_ids == list(prompt) and done[k].response_ids == list(greedy), k
        assert len(done[k].rollout_logprobs) == NUM_NEW
