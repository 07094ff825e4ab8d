"""bf16 training on CPU, master weights, offload, the forward-only engine and error messages
(engine_api_worker.py, one 1-process launch)."""

import json

import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_models, torchrun):
    out = tmp_path_factory.mktemp("engine_api")
    torchrun("engine_api_worker.py", 1, out, tiny_models)
    return json.loads((out / "engine_api.json").read_text())


def test_bf16_step_reduces_loss_on_a_repeated_batch(report):
    losses = report["bf16_losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert report["bf16_grad_norm"] > 0


def test_bf16_weights_with_fp32_master_weights(report):
    # every parameter, norms included (torch.nn.RMSNorm ignores params_dtype; the builder casts it): the HF model
    # and the engine keep norms in the model dtype, and torch's fused RMSNorm needs matching dtypes
    assert report["param_dtypes"] == ["torch.bfloat16"]
    assert report["master_dtypes"] == ["torch.float32"] and report["num_masters"] > 0
    assert not report["masters_unlike_reload"], report["masters_unlike_reload"]  # master index -> max |diff|
    # model weights are the fp32 masters rounded to bf16: within half a bf16 ulp of weights of size <= ~1.5
    assert report["bf16_master_vs_model"] <= 2.0 ** -8


def test_offload_onload_changes_nothing(report):
    assert not report["offload_unequal"], report["offload_unequal"]  # parameter -> max |diff|


def test_forward_only_engine(report):
    assert not report["ref_unequal"], report["ref_unequal"]  # sequence -> max |log-prob diff|
    assert not report["ref_requires_grad"]


@pytest.mark.parametrize("name, message", [
    ("backward_without_optimizer", "this engine was built without an optimizer (optim=None): use forward_only=True"),
    ("logprobs_of_critic", "compute_logprobs needs a language model; this engine is a critic (compute_values)"),
    ("values_of_actor", "compute_values needs a critic (build the engine with value_head=True)"),
    ("backward_without_loss_fn", "a backward pass needs a loss_fn"),
    ("bad_normalizer", "normalizer must be positive, got 0.0"),
    ("no_micro_batches", "forward_backward needs at least one micro batch on every rank"),
])
def test_error_messages(report, name, message):
    assert report["errors"][name] == message
