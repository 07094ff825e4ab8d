"""The mixture-of-experts stand-ins of mcore_rl.parallel.megatron_on_cpu (FUNCTION_SITES), each on its own; the MoE
modules' `torch` proxies are covered by test_megatron_on_cpu.test_patched_modules_see_the_proxy, and everything
together by tests/models/test_moe_parity.py."""

import importlib
import json

import numpy as np
import pytest
import torch

from mcore_rl.parallel import megatron_on_cpu
from tests.parallel.launcher import REPO, run_torchrun

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inactive with CUDA")


@pytest.fixture(scope="module", autouse=True)
def applied():
    assert megatron_on_cpu.apply() is True


@pytest.mark.parametrize("site", megatron_on_cpu.FUNCTION_SITES, ids=lambda s: f"{s[0]}.{s[1]}")
def test_every_function_site_is_replaced_once(site):
    module, attr, make = site
    fn = getattr(importlib.import_module(module), attr)
    assert fn._mcore_rl_cpu and make(fn) is fn  # applying again does not stack


def test_split_sizes_become_numpy_on_cpu():
    from megatron.core.transformer.moe import token_dispatcher

    splits = torch.tensor([19, 29])
    moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(moved, np.ndarray) and moved.tolist() == [19, 29]
    splits[0] = 0
    assert moved.tolist() == [19, 29]  # a copy, as the GPU path's host copy is
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits  # without as_numpy: unchanged


def test_uneven_gather_and_reduce_scatter_on_gloo(tmp_path):
    out = tmp_path / "uneven.json"
    run_torchrun(REPO / "tests" / "parallel" / "worker_uneven.py", 2, out, timeout=300)
    assert json.loads(out.read_text()) == {"gather_ok": True, "reduce_scatter_ok": True}
