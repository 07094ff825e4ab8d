"""algorithms/masking.py: the stacked masked means equal masked_mean one by one; device scalars."""

import pytest
import torch

from mcore_rl.algorithms.masking import device_scalar, masked_mean, masked_means


def test_masked_means_equal_masked_mean_each():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    flags = x > 0.3
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[2] = False  # an empty row
    x_pad = x.masked_fill(~mask, float("nan"))  # padding may hold anything
    got = masked_means({"x": x_pad, "flags": flags}, mask.float())
    assert set(got) == {"x", "flags"} and got["x"].shape == ()
    # one reduction over the stack, so the order of the additions may differ from masked_mean's: fp32 rounding
    assert torch.allclose(got["x"], masked_mean(x_pad, mask), rtol=1e-6, atol=1e-7)
    assert torch.allclose(got["flags"], masked_mean(flags.float(), mask), rtol=1e-6, atol=1e-7)
    assert float(got["flags"]) == pytest.approx(float((flags & mask).sum()) / float(mask.sum()))


def test_masked_means_of_nothing_selected_are_zero():
    got = masked_means({"a": torch.ones(2, 3)}, torch.zeros(2, 3), dtype=torch.float64)
    assert got["a"].dtype == torch.float64 and float(got["a"]) == 0.0
    assert masked_means({}, torch.ones(2, 3)) == {}


def test_device_scalar_from_a_number_or_a_tensor():
    like = torch.zeros(3, dtype=torch.float64)
    assert device_scalar(2, like).dtype == torch.float64 and float(device_scalar(2, like)) == 2.0
    assert float(device_scalar(0, like, min=1.0)) == 1.0
    t = torch.tensor(0.5, dtype=torch.float32)
    out = device_scalar(t, like, min=1.0)
    assert out.dtype == torch.float64 and float(out) == 1.0
    assert float(device_scalar(t, like)) == 0.5
