"""A pure-torch stand-in for the `sgl_kernel` CPU helpers that SGLang imports, for CPU machines without CUDA.

What this is: SGLang (0.5.17 and 0.5.23) imports a handful of CPU helpers from `sgl_kernel` at import time when
`SGLANG_USE_CPU_ENGINE=1`. No installable sgl_kernel wheel carries them (the official CPU route is a source build
for AMX Xeons), so without this module `import sglang.srt...` fails on our CPU machines. On a CPU without AMX
every hot op already falls back to native torch inside SGLang; only bookkeeping helpers come from sgl_kernel.
This module provides

  - `assign_req_to_token_pool_cpu`  (writes newly allocated KV slots into the request-to-token table),
  - `copy_all_layer_kv_cache_cpu`   (moves KV rows between slots in every layer's buffer, by raw pointer),

in plain torch, each tested against a naive loop in tests/rollout/test_sgl_kernel_stand_in.py. Speculative-decoding
helpers SGLang imports on CPU (`_SPECULATIVE`) exist as names only, and so does any other attribute: calling one
raises NotImplementedError naming the function, so an unsupported code path fails loudly instead of silently.
There is no AMX backend here: `torch.ops.sgl_kernel` stays empty, so SGLang's AMX checks stay False.

Mixture-of-experts models (Qwen3-MoE, Mixtral) need nothing more: SGLang 0.5.17's own torch-native MoE path runs.
With `cpu_has_amx_support()` False its MultiPlatformOp layers dispatch to `forward_native`, so routing is
`TopK.forward_native` -> `fused_topk_torch_native` (softmax, top-k, renormalise) and the experts are
`UnquantizedFusedMoEMethod.forward_native` (= `forward_cpu` without AMX) -> `moe_forward_native` (a loop over
experts, F.linear + SiluAndMul.forward_native). It is chosen by the platform, not by a server argument
(`moe_runner_backend` only picks among GPU runners). The AMX branch would call `torch.ops.sgl_kernel`'s
`fused_experts_cpu` / `topk_softmax_cpu`, which is one more reason to keep that namespace empty.

When it is active: only when CUDA is unavailable and no real `sgl_kernel` is importable (`needed()`); on GPU
machines the real sglang-kernel is used and nothing here runs.

How it reaches SGLang's child processes: SGLang starts its scheduler and detokenizer with multiprocessing's
"spawn" method, i.e. fresh interpreters that import SGLang (and so `sgl_kernel`) before any of our code could
run. A spawned child starts with the parent's `sys.path` (multiprocessing.spawn.prepare copies it), so `install()`
puts the directory `_sgl_kernel_stub/` (a tiny `sgl_kernel` package whose __init__ loads this module) at
the front of `sys.path` in the parent, and registers the stand-in in `sys.modules` for the parent itself. For an
HTTP server we launch, `child_env()` adds the same directory to PYTHONPATH. A server started by hand on CPU needs
`PYTHONPATH=$(python -m mcore_rl.rollout.sgl_kernel_stand_in)`; nothing has to be written into site-packages.
"""

from __future__ import annotations

import ctypes
import os
import sys
import types

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sgl_kernel_stub")

# sgl_kernel names SGLang imports on CPU only for speculative decoding, which this stand-in does not support.
_SPECULATIVE = (
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)

# SGLang's CPU settings (docs/rollout.md): without SGLANG_USE_CPU_ENGINE it takes a vllm rotary branch and fails.
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len: int) -> None:
    """For each request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end[i]-start[i])
    entries of `out_cache_loc`, which holds the new slots of all requests back to back (in place).

    req_pool_indices, start_offset, end_offset: [B] int; req_to_token: [num_reqs, pool_len] int32;
    out_cache_loc: [sum(end - start)] int64.
    """
    import torch

    del pool_len  # == req_to_token.shape[1]; kept for the sgl_kernel signature
    lens = (end_offset - start_offset).long()
    if lens.numel() == 0 or int(lens.sum()) == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.long(), lens)
    # column of each new token: start[i] + (its position within request i)
    first = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=lens.device) - torch.repeat_interleave(first, lens)
    cols = torch.repeat_interleave(start_offset.long(), lens) + pos
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every buffer b (a host address data_ptrs[b] whose rows are strides[b] bytes long), copy rows
    src_loc -> tgt_loc. All sources are read before any target is written, so overlapping moves are safe.

    data_ptrs: [num_buffers] uint64 addresses of CPU tensors; strides: [num_buffers] int bytes per row;
    tgt_loc, src_loc: [N] int row indices.
    """
    import torch

    if tgt_loc.numel() == 0:
        return
    src, tgt = src_loc.long(), tgt_loc.long()
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _host_bytes(int(ptr), num_rows * int(stride)).view(num_rows, int(stride))
        rows[tgt] = rows[src]  # advanced indexing on the right makes a copy first


def _host_bytes(address: int, num_bytes: int):
    """A uint8 tensor viewing `num_bytes` of host memory at `address` (no copy)."""
    import torch

    return torch.frombuffer((ctypes.c_uint8 * num_bytes).from_address(address), dtype=torch.uint8)


def _not_implemented(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by mcore_rl's CPU stand-in (mcore_rl/rollout/sgl_kernel_stand_in.py), "
            "which covers plain generation only (no speculative decoding, quantisation or AMX kernels). "
            "Run this feature on a GPU, or with a real sgl_kernel CPU build."
        )

    stand_in.__name__ = name
    return stand_in


class _StandInModule(types.ModuleType):
    """Module object registered as `sgl_kernel`: real helpers as attributes, any other name a raising stub."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # keep import machinery and pickling probes working normally
            raise AttributeError(name)
        return _not_implemented(name)


_MODULE: _StandInModule | None = None


def stand_in_module() -> types.ModuleType:
    """The `sgl_kernel` stand-in (one instance per process)."""
    global _MODULE
    if _MODULE is None:
        mod = _StandInModule("sgl_kernel",
                             "mcore_rl CPU stand-in for sgl_kernel (see mcore_rl.rollout.sgl_kernel_stand_in)")
        mod.__file__ = __file__
        mod.__version__ = "0.0.0+mcore_rl_cpu_stand_in"
        mod.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
        mod.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu
        for name in _SPECULATIVE:
            setattr(mod, name, _not_implemented(name))
        _MODULE = mod
        _unpin_host_caches()
        from mcore_rl.rollout import cpu_seeded_sampling

        cpu_seeded_sampling.install()  # SGLang's seeded (deterministic) sampling on CPU: see that module
    return _MODULE


_HOST_CACHE_MODULE = "sglang.srt.state_capturer.base"


def _unpinned_host_caches(module) -> None:
    """SGLang's state-capturer module, patched so that its host buffers are made without pin_memory. SGLang 0.5.17
    allocates the routed-experts host cache (enable_return_routed_experts, routing replay) with pin_memory=True,
    which torch refuses without an accelerator ("pin_memory=True requires a CUDA or other accelerator backend");
    on a CPU nothing is gained by pinning anyway."""
    torch = module.torch
    original = module.BaseHostCache.__init__

    def init(self, *args, **kwargs):
        zeros = torch.zeros
        try:
            torch.zeros = lambda *a, pin_memory=False, **k: zeros(*a, **k)
            original(self, *args, **kwargs)
        finally:
            torch.zeros = zeros

    module.BaseHostCache.__init__ = init


def _unpin_host_caches() -> None:
    from mcore_rl.rollout.after_import import patch_after_import

    patch_after_import(_HOST_CACHE_MODULE, _unpinned_host_caches)


def needed() -> bool:
    """True when SGLang must run on CPU with the stand-in: no CUDA and no real sgl_kernel installed."""
    import importlib.util

    import torch

    if torch.cuda.is_available():
        return False
    mod = sys.modules.get("sgl_kernel")
    if mod is not None:
        return mod is _MODULE
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is None or (spec.origin or "").startswith(STUB_DIR)


def install() -> bool:
    """Make SGLang importable on this CPU machine, here and in processes it spawns; return True if active.

    Sets SGLANG_USE_CPU_ENGINE=1, registers the stand-in as `sgl_kernel` in this process and puts STUB_DIR on
    sys.path so spawned children load it too. Idempotent; a no-op (returns False) where `needed()` is False.
    Call before the first `import sglang` of the process: SGLang reads these at import time.
    """
    if not needed():
        return False
    os.environ.update(CPU_ENV)
    sys.modules["sgl_kernel"] = stand_in_module()
    if STUB_DIR not in sys.path:
        sys.path.insert(0, STUB_DIR)
    return True


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) for a subprocess that will import SGLang, e.g.
    `python -m sglang.launch_server`: with the stand-in on PYTHONPATH when `needed()`."""
    env = dict(os.environ if env is None else env)
    if needed():
        env.update(CPU_ENV)
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != STUB_DIR]
        env["PYTHONPATH"] = os.pathsep.join([STUB_DIR, *parts])
    return env


if __name__ == "__main__":  # prints the PYTHONPATH entry a hand-started CPU server needs
    print(STUB_DIR)
