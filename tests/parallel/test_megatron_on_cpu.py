"""Each workaround of mcore_rl.parallel.megatron_on_cpu, in this (CUDA-less) process.

The workarounds are exercised end to end by the multi-process tests in tests/engine (TP / PP / DP / interleaved
pipelines, DDP, the distributed optimizer, dist checkpointing); here each one is checked on its own.
"""

import importlib
import sys
import types

import pytest
import torch

from mcore_rl.parallel import megatron_on_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inactive with CUDA")


@pytest.fixture(scope="module", autouse=True)
def applied():
    assert megatron_on_cpu.apply() is True
    assert megatron_on_cpu.apply() is True  # idempotent


def test_patched_modules_see_the_proxy():
    seen = 0
    for name in megatron_on_cpu.PATCHED_MODULES:
        mod = importlib.import_module(name)
        assert mod.torch is megatron_on_cpu.TORCH_PROXY, name
        seen += 1
    assert seen == len(megatron_on_cpu.PATCHED_MODULES)


def test_modules_outside_the_list_see_the_real_torch():
    from megatron.core.transformer import transformer_block, transformer_layer

    from mcore_rl.engine import logprobs
    from mcore_rl.models import attention

    for mod in (transformer_layer, transformer_block, logprobs, attention):
        assert mod.torch is torch
    assert torch.cuda is not megatron_on_cpu.CPU_CUDA
    assert torch.zeros is not megatron_on_cpu.TORCH_PROXY.zeros


def test_proxy_forwards_everything_else():
    assert megatron_on_cpu.TORCH_PROXY.float32 is torch.float32
    assert megatron_on_cpu.TORCH_PROXY.nn is torch.nn
    assert megatron_on_cpu.TORCH_PROXY.cat is torch.cat


def test_cuda_stand_ins():
    cuda = megatron_on_cpu.CPU_CUDA
    assert cuda.is_available() is False and cuda.device_count() == 0
    assert cuda.current_device() == "cpu"
    assert cuda.synchronize() is None and cuda.set_device(0) is None and cuda.empty_cache() is None
    stream = cuda.current_stream()
    stream.wait_stream(cuda.default_stream())
    event = cuda.Event()
    event.record(stream)
    stream.wait_event(event)
    assert stream.query() and event.elapsed_time(event) == 0.0
    with cuda.stream(stream), cuda.nvtx.range("x"):
        pass
    cuda.nvtx.range_push("x")
    cuda.nvtx.range_pop()
    assert cuda.memory_allocated() == cuda.max_memory_allocated() == cuda.memory_reserved() == 0
    assert cuda.is_current_stream_capturing() is False
    # anything not stood in for is the real torch.cuda: an unexpected CUDA call still fails loudly
    assert cuda.get_device_capability is torch.cuda.get_device_capability


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda"), torch.device("cuda", 1)])
@pytest.mark.parametrize("factory", ["zeros", "ones", "empty"])
def test_factories_map_cuda_to_cpu(factory, device):
    t = getattr(megatron_on_cpu.TORCH_PROXY, factory)(2, 3, device=device)
    assert t.device == torch.device("cpu") and t.shape == (2, 3)


def test_other_factories_and_devices():
    p = megatron_on_cpu.TORCH_PROXY
    assert p.tensor([1, 2], device="cuda").device.type == "cpu"
    assert p.full((2,), 3.0, device=torch.device("cuda")).tolist() == [3.0, 3.0]
    assert p.arange(3, device="cuda").tolist() == [0, 1, 2]
    assert p.zeros_like(torch.ones(2), device="cuda").device.type == "cpu"
    assert p.zeros(2, device="cpu").device.type == "cpu" and p.zeros(2).device.type == "cpu"
    assert p.empty(2, device="meta").device.type == "meta"  # non-CUDA devices pass through


def test_rng_routes_to_the_cpu_generator():
    cuda = megatron_on_cpu.CPU_CUDA
    cuda.manual_seed(5)
    a = torch.rand(3)
    cuda.manual_seed(5)
    assert torch.equal(torch.rand(3), a)
    state = cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    b = torch.rand(3)
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3), b)


def test_megatron_private_rng_helpers_use_the_cpu_generator():
    from megatron.core.tensor_parallel import random as rnd

    state = rnd._get_cuda_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    assert rnd._get_cuda_rng_state(clone=True) is not torch.get_rng_state()
    x = torch.rand(2)
    rnd._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(2), x)


def test_rng_tracker_forks_and_restores_the_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    outside = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # default stream untouched
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(4)
    assert not torch.equal(first, second)  # the forked stream advanced
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), first)  # and it is the CPU generator seeded with 123


def test_type_names_inside_the_listed_functions_only():
    with megatron_on_cpu._cuda_type_names(megatron_on_cpu.CUDA_TYPE_NAMES):
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
        assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions untouched
    assert torch.zeros(1).type() == "torch.FloatTensor"


@pytest.mark.parametrize("site", megatron_on_cpu.TYPE_CHECK_SITES + megatron_on_cpu.TENSOR_CUDA_SITES,
                         ids=lambda s: f"{s[1] or s[0].rsplit('.', 1)[1]}.{s[2]}")
def test_every_listed_site_is_wrapped(site):
    module, owner, attr = site
    obj = importlib.import_module(module)
    if owner:
        obj = getattr(obj, owner)
    assert getattr(getattr(obj, attr), "_mcore_rl_cpu", False), site


def test_wrapping_keeps_classmethods_and_does_not_stack():
    class Owner:
        @classmethod
        def make(cls, x):
            return cls, x.type()

        def plain(self):
            return torch.zeros(1).type()

    mod = types.ModuleType("mcore_rl_test_sites")
    mod.Owner = Owner
    sys.modules[mod.__name__] = mod
    try:
        sites = ((mod.__name__, "Owner", "make"), (mod.__name__, "Owner", "plain"))
        context = lambda: megatron_on_cpu._cuda_type_names(megatron_on_cpu.CUDA_TYPE_NAMES)  # noqa: E731
        megatron_on_cpu._wrap_sites(sites, context)
        first = Owner.__dict__["plain"]
        megatron_on_cpu._wrap_sites(sites, context)
        assert Owner.__dict__["plain"] is first  # applying twice does not wrap twice
        assert isinstance(Owner.__dict__["make"], classmethod)
        assert Owner.make(torch.zeros(1)) == (Owner, "torch.cuda.FloatTensor")
        assert Owner().plain() == "torch.cuda.FloatTensor"
    finally:
        del sys.modules[mod.__name__]


def test_clip_grads_accepts_cpu_fp32_grads():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), rtol=1e-5)


def test_tensor_cuda_is_identity_inside_the_listed_functions_only():
    t = torch.zeros(2)
    with megatron_on_cpu._tensor_cuda_is_identity():
        assert t.cuda() is t
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()


def test_apply_is_a_no_op_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_on_cpu.apply() is False
