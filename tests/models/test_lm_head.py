"""models/lm_head.py's pure parts: which positions get logits, and putting their results back. The engine-level
parity (log-probs, entropies and gradients of lm_head=loss_tokens against lm_head=all and against plain autograd)
is in tests/engine/test_parity.py::test_reference_engine_equals_plain_autograd."""

import pytest
import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.models import lm_head


def test_positions_are_those_predicting_a_loss_token():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1],
                         [0, 1, 1, 0, 0, 0]], dtype=torch.float32)
    (rows, cols), empty = lm_head.positions(mask)
    assert not empty
    # position p predicts token p + 1; the last column predicts nothing
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 1), (0, 2), (0, 4), (1, 0), (1, 1)]


def test_no_loss_token_keeps_one_position_and_scatters_zeros():
    mask = torch.zeros(1, 5)
    mask[0, 0] = 1  # token 0 is never predicted
    rows, empty = lm_head.positions(mask)
    assert empty and [r.tolist() for r in rows] == [[0], [0]]
    values = torch.tensor([3.0], requires_grad=True)
    out = lm_head.scatter(values, rows, (1, 5), empty)
    assert out.abs().sum() == 0
    out.sum().backward()  # still part of the graph (the output layer ran), with a zero gradient
    assert values.grad.tolist() == [0.0]


def test_scatter_places_values_and_passes_gradients():
    rows = (torch.tensor([0, 1]), torch.tensor([2, 0]))
    values = torch.tensor([1.5, -2.0], requires_grad=True)
    out = lm_head.scatter(values, rows, (2, 3))
    assert out.tolist() == [[0.0, 0.0, 1.5], [-2.0, 0.0, 0.0]]
    (out * torch.tensor([[0.0, 0.0, 2.0], [3.0, 0.0, 0.0]])).sum().backward()
    assert values.grad.tolist() == [2.0, 3.0]


def test_lm_head_setting_is_checked():
    assert ModelConfig().lm_head == "loss_tokens"
    with pytest.raises(ValueError, match=r"model.lm_head must be one of \('loss_tokens', 'all'\), got 'prompt'"):
        ModelConfig(lm_head="prompt")
