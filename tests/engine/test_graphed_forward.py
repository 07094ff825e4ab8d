"""model.forward_cuda_graphs: the fixed-shape layout of engine/graphed_forward.py.

Capture itself needs a GPU (tests/gpu); here the same layout runs eagerly (forward_cuda_graphs=static) against the
eager path at TP1 and TP2, and the shape rules are checked by hand.
"""

import json

import pytest

from mcore_rl.engine.graphed_forward import Shape, bucket, static_bounds, static_shape


def test_buckets_are_four_per_octave():
    assert [bucket(n) for n in (1, 256, 257, 320, 321, 1000, 1024, 1025, 16000)] == \
        [256, 256, 320, 320, 384, 1024, 1024, 1280, 16384]
    assert bucket(10, minimum=64) == 64


def test_shape_fits_the_pack_and_bounds_cover_the_padding():
    shape = static_shape([100, 3], 110, 90)
    # tokens: 110 -> the smallest bucket, 256; max_len: 100 -> 128; pieces: 2 sequences + 2 of padding (153
    # tokens); slots: at least 16; rows: 90 -> 96 (buckets of 16 in 64..128)
    assert shape == Shape(tokens=256, slots=16, max_len=128, rows=96)
    assert static_shape([11, 7, 9], 27, 20) == Shape(tokens=256, slots=16, max_len=64, rows=64)
    bounds = static_bounds([100, 3], shape)
    assert bounds[:4] == [0, 100, 103, 231] and bounds[4] == 256 and len(bounds) == shape.slots + 1
    assert all(b - a <= shape.max_len for a, b in zip(bounds[:-1], bounds[1:]))
    assert bounds[-1] == shape.tokens and bounds == sorted(bounds)


def test_length_bound_never_equals_the_pack():
    # RoPE would read frequencies as long as the pack as per-token ones (models/rope.py)
    shape = static_shape([200, 30], 230, 200)
    assert shape.tokens == 256 and shape.max_len == 257
    assert static_bounds([200, 30], shape)[:4] == [0, 200, 230, 256]


def test_too_many_pieces_is_an_invariant_error():
    shape = Shape(tokens=256, slots=2, max_len=64, rows=64)
    with pytest.raises(AssertionError, match="do not fit 2 slots"):
        static_bounds([10], shape)


@pytest.mark.parametrize("nproc", [1, 2], ids=["tp1", "tp2"])
def test_static_layout_equals_the_eager_path(tmp_path, tiny_models, torchrun, nproc):
    torchrun("graphed_forward_worker.py", nproc, str(tmp_path), str(tiny_models))
    res = json.loads((tmp_path / f"graphed_tp{nproc}.json").read_text())
    diffs = {k: v for k, v in res.items() if k.endswith("/max_diff")}
    assert len(diffs) == 2 * 2 * 4 * 3  # arch x lm_head x case x (logprobs, entropy at t=1; logprobs at t=0.7)
    # fp32; the packs' shapes differ (padding, row order of the output layer), so sums round differently
    assert max(diffs.values()) < 2e-5, {k: v for k, v in diffs.items() if v >= 2e-5}
    assert not any(v for k, v in res.items() if k.endswith("/zeros_differ"))
    assert all(v for k, v in res.items() if k.endswith("/shapes_equal"))
    assert all(v > 20 for k, v in res.items() if k.endswith("/nonzero"))
    for arch in ("llama", "qwen2"):  # static: used; off: not asked; on without CUDA: eager, and it says why
        assert res[f"{arch}/off_reason"] == [None, None, "no CUDA device"]
    for arch in ("llama", "qwen2"):  # capture on: shapes met once run eagerly, in one call, and nothing is captured
        n = res[f"{arch}/num_micro_batches"]
        assert n > 1 and res[f"{arch}/first_sight_eager_calls"] == [n]
        assert res[f"{arch}/first_sight_captures"] == 0 and sum(res[f"{arch}/first_sight_seen"]) == n
        assert res[f"{arch}/first_sight_max_diff"] == 0.0


def test_unknown_setting_is_refused(tmp_path):
    from mcore_rl.config.model import ModelConfig

    with pytest.raises(ValueError, match=r"model.forward_cuda_graphs must be one of \('off', 'on', 'static'\)"):
        ModelConfig(path=str(tmp_path), forward_cuda_graphs="yes")
