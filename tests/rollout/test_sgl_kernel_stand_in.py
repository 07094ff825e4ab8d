"""The sgl_kernel CPU stand-in: each helper against a naive loop, the raising stubs, and that the stand-in
reaches processes spawned the way SGLang spawns its scheduler (multiprocessing "spawn") and the server
subprocess (child_env)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys

import pytest
import torch

from mcore_rl.rollout import sgl_kernel_stand_in

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in is for machines without CUDA")


def naive_assign(req_pool_indices, req_to_token, start, end, out_cache_loc):
    offset = 0
    for i in range(len(req_pool_indices)):
        for col in range(int(start[i]), int(end[i])):
            req_to_token[int(req_pool_indices[i]), col] = out_cache_loc[offset]
            offset += 1


@pytest.mark.parametrize("seed", range(5))
def test_assign_req_to_token_pool_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    num_reqs, pool_len, batch = 8, 32, 5
    req_pool_indices = torch.randperm(num_reqs, generator=g)[:batch]
    start = torch.randint(0, 16, (batch,), generator=g)
    end = start + torch.randint(0, 16, (batch,), generator=g)  # includes empty requests
    total = int((end - start).sum())
    out_cache_loc = torch.randint(0, 10_000, (total,), generator=g, dtype=torch.int64)
    table = torch.randint(-5, 0, (num_reqs, pool_len), generator=g, dtype=torch.int32)
    expected = table.clone()
    naive_assign(req_pool_indices, expected, start, end, out_cache_loc)
    sgl_kernel_stand_in.assign_req_to_token_pool_cpu(req_pool_indices, table, start, end, out_cache_loc, pool_len)
    assert torch.equal(table, expected)


def test_assign_req_to_token_pool_empty_batch():
    table = torch.zeros(2, 4, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int64)
    sgl_kernel_stand_in.assign_req_to_token_pool_cpu(empty, table, empty, empty, empty, 4)
    assert not table.any()


@pytest.mark.parametrize("overlap", [False, True])
def test_copy_all_layer_kv_cache_matches_loop(overlap):
    g = torch.Generator().manual_seed(int(overlap))
    # layers of different dtypes and row sizes, as K, V and scale buffers are
    buffers = [torch.randn(20, 2, 8, generator=g), torch.randn(20, 3, dtype=torch.float64, generator=g),
               torch.randint(0, 100, (20, 5), generator=g, dtype=torch.int16)]
    if overlap:  # a permutation: every target row is also a source row, so reads must precede writes
        src = torch.tensor([1, 2, 3, 4])
        tgt = torch.tensor([2, 3, 4, 1])
    else:
        src = torch.tensor([0, 5, 7])
        tgt = torch.tensor([10, 19, 3])
    expected = [b.clone() for b in buffers]
    for b in expected:
        rows = [b[int(s)].clone() for s in src]
        for t, row in zip(tgt, rows):
            b[int(t)] = row
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers])
    sgl_kernel_stand_in.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)


def test_other_names_raise_not_implemented_when_called():
    mod = sgl_kernel_stand_in.stand_in_module()
    for name in ("verify_tree_greedy_cpu", "some_future_kernel"):
        fn = getattr(mod, name)
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} is not provided by mcore_rl's CPU stand-in"):
            fn(torch.zeros(1))
    with pytest.raises(AttributeError):
        mod.__wrapped__  # dunder probes must not look like kernels


def test_install_registers_module_and_path():
    assert sgl_kernel_stand_in.needed()
    assert sgl_kernel_stand_in.install()
    import sgl_kernel

    assert sgl_kernel is sgl_kernel_stand_in.stand_in_module()
    assert sgl_kernel_stand_in.STUB_DIR in sys.path
    import os

    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"


def _child_reports(queue):
    import sgl_kernel

    queue.put((type(sgl_kernel).__name__, sgl_kernel.assign_req_to_token_pool_cpu.__module__))


def test_stand_in_reaches_spawned_children():
    """SGLang starts its scheduler with the spawn method: a fresh interpreter that only inherits sys.path."""
    sgl_kernel_stand_in.install()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reports, args=(queue,))
    proc.start()
    report = queue.get(timeout=120)
    proc.join(timeout=60)
    assert report == ("_StandInModule", "mcore_rl.rollout.sgl_kernel_stand_in")


def test_child_env_reaches_subprocesses():
    code = ("import sgl_kernel, os; "
            "print(sgl_kernel.copy_all_layer_kv_cache_cpu.__module__, os.environ['SGLANG_USE_CPU_ENGINE'])")
    out = subprocess.run([sys.executable, "-c", code], env=sgl_kernel_stand_in.child_env(), capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["mcore_rl.rollout.sgl_kernel_stand_in", "1"]


def test_sglang_takes_its_torch_native_moe_path():
    """MoE needs no stand-in op: with no AMX backend (torch.ops.sgl_kernel stays empty, so SGLang's
    cpu_has_amx_support() is False even on an AMX Xeon) SGLang's MultiPlatformOp layers dispatch to forward_native:
    TopK -> fused_topk_torch_native, UnquantizedFusedMoEMethod -> moe_forward_native (pure torch). Were the
    stand-in to register AMX ops, MoE would call sgl_kernel's fused_experts_cpu / topk_softmax_cpu, which it lacks.
    Parity with HF is tested end to end in test_moe_rollout.py."""
    code = (
        "import torch\n"
        "from sglang.srt.utils.common import cpu_has_amx_support, is_cpu\n"
        "from sglang.srt.layers.moe.topk import TopK\n"
        "from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as U\n"
        "t, u = TopK(top_k=2, renormalize=True), U()\n"
        "print(is_cpu(), cpu_has_amx_support(), t._forward_method.__func__ is TopK.forward_native,\n"
        "      u._forward_method.__func__ is U.forward_native, U.forward_native is U.forward_cpu)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=sgl_kernel_stand_in.child_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-5:] == ["True", "False", "True", "True", "True"]
