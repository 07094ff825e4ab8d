"""Faster optimizer paths for Megatron-Core when neither Transformer Engine nor apex is installed.

Without them Megatron falls back to torch's AdamW and to pure-Python stand-ins for apex's multi-tensor kernels
(megatron.core.utils.local_multi_tensor_*), which cost a bf16 step on a GPU a lot of time that is not math:

* `local_multi_tensor_l2_norm` (grad norm, every step) takes one `torch.norm` per gradient tensor and then builds
  a host tensor from the list of device norms: one device-to-host sync per parameter tensor (about 290 at
  Qwen2.5-0.5B dims), each leaving the GPU idle while Python issues the next tiny kernel.
* `local_multi_tensor_scale` (master -> model weight copies in the non-distributed optimizer, gradient clipping)
  runs `dst.copy_(src * scale)` per tensor: two kernels, an allocation and Python overhead per tensor.
* torch's AdamW defaults to its multi-tensor (`foreach`) implementation, several passes over the moments; the
  fused kernel makes one.

`foreach_fallbacks()` swaps in single-call `torch._foreach_*` versions (same math: the grad norm is the 2-norm
of the per-tensor 2-norms, computed on the device without a sync; scaling multiplies in the tensors' dtype, as
the fallback does) for the duration of a `with` block, and only where Megatron is using its local fallbacks.
It is scoped rather than installed at import so that code in the same process that wants Megatron as shipped
(the raw side of tools/bench_throughput.py) keeps it. `use_fused_adam()` switches an already built torch
AdamW to the fused kernel before its first step (state is created on the parameters' device).

Both are selected by OptimConfig.fast_optimizer (auto = on CUDA); tests/engine/test_fast_optim.py checks them
against the shipped paths.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

_SITES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm (per_tensor=False): ([1] fp32 total 2-norm, None), no host sync."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for amp_C.multi_tensor_scale: dst_i = src_i * scale (in place when src and dst are the same)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        if scale != 1.0:
            torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _local_fallbacks_in_use() -> list:
    """(module, attribute, replacement) for every site where Megatron uses a local fallback now."""
    from megatron.core import utils

    replace = {utils.local_multi_tensor_l2_norm: foreach_l2_norm, utils.local_multi_tensor_scale: foreach_scale}
    sites = []
    for name in _SITES:
        module = importlib.import_module(name)
        for attr in ("l2_norm_impl", "multi_tensor_scale_impl"):
            current = getattr(module, attr, None)
            if current in replace:
                sites.append((module, attr, replace[current]))
    return sites


@contextlib.contextmanager
def foreach_fallbacks(enabled: bool = True):
    """Within the block, Megatron's optimizer uses the foreach versions of its local multi-tensor fallbacks."""
    sites = _local_fallbacks_in_use() if enabled else []
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in sites]
    try:
        for module, attr, fn in sites:
            setattr(module, attr, fn)
        yield
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)


def use_fused_adam(torch_optimizers) -> int:
    """Make torch Adam / AdamW optimizers use the fused kernel; returns how many were switched. Call before the
    first step (a `step` state created by the foreach path lives on the host, where the fused kernel cannot
    read it; loading a checkpoint puts it on the device for fused optimizers, so resuming works)."""
    switched = 0
    for opt in torch_optimizers:
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or any(opt.state.values()):
            continue
        for group in [opt.defaults, *opt.param_groups]:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched
