"""What the trainer sends our SGLang loaders: the name check's message and the packing of a bucket into one buffer
per dtype (the loaders themselves run inside SGLang: tests/weight_sync/test_sync_layout.py)."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.weight_sync.loaders import LOADERS, check_names, pack_flat


def test_loader_names_are_importable_paths():
    import importlib

    for name in LOADERS:  # SGLang imports each by its dotted name inside its scheduler
        module, attr = name.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_check_names_message():
    engine = {"a.qkv_proj.weight": (8, 4), "b.weight": (4,), "c.weight": (2,)}
    check_names({"a.qkv_proj.weight": (8, 4), "b.weight": (4,), "c.weight": (2,)}, engine, "x")
    check_names({"b.weight": (4,)}, engine, "a bucket", complete=False)
    with pytest.raises(ValueError) as e:
        check_names({"a.q_proj.weight": (4, 4), "b.weight": (5,)}, engine, "the export")
    msg = str(e.value)
    assert "the export does not match the engine's parameters" in msg
    assert "not engine parameters: a.q_proj.weight" in msg
    assert "engine parameters not sent: a.qkv_proj.weight, c.weight" in msg
    assert "shape mismatches: b.weight (5,) vs the engine's (4,)" in msg
    assert "Set weight_sync.layout=hf" in msg


def test_pack_flat_sends_each_buffer_once_with_offsets():
    a, b = torch.arange(10.0), torch.arange(6, dtype=torch.int32)
    named = [("x", a[0:6].view(2, 3)), ("y", a[6:10]), ("z", b[2:6].view(2, 2))]
    packed = pack_flat(named)
    assert [json.loads(spec) for spec, _ in packed] == [[["x", 0, [2, 3]], ["y", 6, [4]]], [["z", 2, [2, 2]]]]
    assert packed[0][1] is a and packed[1][1] is b
    assert pack_flat([("x", a.clone())]) is None  # not a view: sent tensor by tensor
    assert pack_flat([("x", a.view(2, 5)[:, :2])]) is None  # a non-contiguous view


def test_check_names_takes_slices_of_stacked_parameters():
    # An MoE layer's stacked experts (SGLang FusedMoE w13_weight [E, 2I, H]) arrive as per-expert slices, maybe
    # over several buckets: each slice is checked against one row of the parameter, and the parameter counts as
    # sent once every slice is.
    engine = {"m.experts.w13_weight": (3, 4, 2), "m.gate.weight": (3, 2)}
    every = {f"m.experts.w13_weight[{e}]": (4, 2) for e in range(3)}
    check_names({**every, "m.gate.weight": (3, 2)}, engine, "x")
    check_names({"m.experts.w13_weight[1]": (4, 2)}, engine, "a bucket", complete=False)
    with pytest.raises(ValueError) as e:
        check_names({"m.experts.w13_weight[0]": (4, 2), "m.experts.w13_weight[3]": (4, 2),
                     "m.gate.weight[0]": (3,)}, engine, "the export")
    msg = str(e.value)
    assert "not engine parameters: m.experts.w13_weight[3]" in msg  # expert 3 of 3
    assert "engine parameters not sent: m.experts.w13_weight (slices [1, 2] of 3)" in msg
    assert "shape mismatches: m.gate.weight[0] (3,) vs the engine's (2,)" in msg


def test_pack_each_addresses_slices_with_their_own_buffer():
    from mcore_rl.weight_sync.loaders import load_flat, pack_each, split_slice

    assert split_slice("a.w13_weight[12]") == ("a.w13_weight", 12) and split_slice("a.weight") == ("a.weight", None)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3, 2, 2), requires_grad=False)
    x = torch.arange(8.0).view(2, 4)
    load_flat(model, pack_each([("w[2]", x[:, :2]), ("w[0]", torch.ones(2, 2))]))  # a non-contiguous one too
    assert torch.equal(model.w[2], x[:, :2]) and torch.equal(model.w[0], torch.ones(2, 2))
    assert not model.w[1].any()
