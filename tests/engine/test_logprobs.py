"""Vocab-parallel log-probs / entropy on one process (group=None) against torch's full-vocabulary formulas.

The tensor-parallel version (two vocabulary slices, all-reduces over gloo) is checked in test_parity.py.
"""

import pytest
import torch

from mcore_rl.engine.logprobs import align_to_tokens, next_token_targets, vocab_parallel_logprobs


def reference(logits, target, vocab_size, temperature):
    logp = torch.log_softmax(logits[..., :vocab_size] / temperature, dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("padded", [0, 3])
def test_matches_log_softmax_and_gradients(temperature, padded):
    g = torch.Generator().manual_seed(0)
    vocab = 11
    logits = (3 * torch.randn(2, 5, vocab + padded, generator=g, dtype=torch.float64)).requires_grad_()
    if padded:  # padding columns hold large values: they must not count
        with torch.no_grad():
            logits[..., vocab:] = 50.0
    target = torch.randint(0, vocab, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g,
                                                                                    dtype=torch.float64)
    lp, ent = vocab_parallel_logprobs(logits, target, vocab, temperature=temperature, with_entropy=True)
    (lp * w_lp + ent * w_ent).sum().backward()
    grad = logits.grad.clone()

    logits2 = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = reference(logits2, target, vocab, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    # fp64 end to end: agreement to rounding
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, logits2.grad, rtol=0, atol=1e-12)
    if padded:
        assert torch.all(grad[..., vocab:] == 0)


def test_directional_derivative_matches_finite_differences():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64)
    target = torch.randint(0, 6, (3,), generator=g)
    w_lp, w_ent = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    direction = torch.randn(3, 7, generator=g, dtype=torch.float64)

    def objective(x):
        lp, ent = vocab_parallel_logprobs(x, target, 6, temperature=0.9, with_entropy=True)
        return (lp * w_lp + ent * w_ent).sum()

    x = logits.clone().requires_grad_()
    objective(x).backward()
    eps = 1e-6
    numeric = (objective(logits + eps * direction) - objective(logits - eps * direction)) / (2 * eps)
    assert (x.grad * direction).sum().item() == pytest.approx(numeric.item(), rel=1e-7, abs=1e-9)


def test_a_second_backward_is_refused():
    # backward reuses the saved softmax in place: running it twice must fail loudly, not silently
    x = torch.randn(2, 5, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(x, torch.tensor([1, 3]), 5, with_entropy=True)
    (lp.sum() + ent.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + ent.sum()).backward()


def test_fp32_and_bf16_inputs_compute_in_fp32():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=g)
    target = torch.randint(0, 9, (4,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, 9)
    assert lp.dtype == torch.float32 and ent is None
    ref_lp, _ = reference(logits.double(), target, 9, 1.0)
    # fp32: a few ulps of values of size ~3
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
    lp16, _ = vocab_parallel_logprobs(logits.bfloat16(), target, 9)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16.double(), reference(logits.bfloat16().double(), target, 9, 1.0)[0],
                               rtol=0, atol=2e-6)


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 6)
    before = logits.clone()
    vocab_parallel_logprobs(logits, torch.tensor([1, 2]), 4, with_entropy=True)
    assert torch.equal(logits, before)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        vocab_parallel_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), 3, temperature=0)


def test_alignment_padded_rows():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert next_token_targets(ids)[0, :3].tolist() == [6, 7, 0]
    per_position = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    # entry i belongs to token i and comes from position i - 1; first token and padding are 0
    assert align_to_tokens(per_position, valid).tolist() == [[0.0, 1.0, 2.0, 0.0], [0.0, 5.0, 0.0, 0.0]]


def test_alignment_packed_row_restarts_per_sequence():
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    per_position = torch.arange(1.0, 7.0).unsqueeze(0)
    # sequences at [0, 3) and [3, 5), one padding token
    assert align_to_tokens(per_position, valid, [0, 3]).tolist() == [[0.0, 1.0, 2.0, 0.0, 4.0, 0.0]]
