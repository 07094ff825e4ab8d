"""SGLang's deterministic inference (per-request `sampling_seed`) on CPU machines, where SGLang refuses or breaks it.

SGLang 0.5.17 honours a request's sampling_seed only with the server argument enable_deterministic_inference,
and on a CPU that argument fails three ways, each patched here in every SGLang process (the `sgl_kernel`
stand-in installs this module, so it runs only without CUDA; see sgl_kernel_stand_in.py for how it reaches the
spawned scheduler):

  - server_args accepts deterministic inference only with GPU attention backends (fa3, fa4, flashinfer, triton)
    and raises for torch_native: torch_native is added through SGLang's own extension hook
    (add_deterministic_attention_backend_choices). It is not added to the radix-cache-capable list, so SGLang
    turns the radix cache off, as for any backend not known to keep cached prefixes bit-identical.
  - the seeded sampler's hash (sglang.kernels.ops.sampling.murmur_hash) is a triton kernel, and
    multinomial_with_seed is wrapped in torch.compile: replaced by `multinomial_with_seed` below, the same
    MurmurHash3 and Gumbel-max in eager torch on int64 (tested against a scalar MurmurHash3 in
    tests/rollout/test_seeds.py), so a seed picks the same token on CPU as SGLang's kernel would on GPU.
  - ModelRunner.maybe_enable_batch_invariant_mode registers triton matmul kernels for the accelerator's dispatch
    key and raises on CPU: skipped. On CPU the forward is what torch's CPU kernels make it; a request's logits
    then depend on its batch only if those kernels' reduction order does (the exact-resume tests check it).
"""

from __future__ import annotations

_MASK32 = 0xFFFFFFFF


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix(h, k):
    k = (k * 0xCC9E2D51) & _MASK32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK32
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def murmur_hash32(seed, positions, col_indices):
    """MurmurHash3 (x86, 32-bit, hash seed 0) of the 16 bytes (seed low word, seed high word, position, column)
    for every row's (seed, position) and every column: [n] int, [n] int, [m] int -> [n, m] int64 in [0, 2**32).
    SGLang's triton kernel in torch: uint32 arithmetic as int64 masked to 32 bits (a product of two 32-bit
    values wraps in int64, but its low 32 bits, all that is kept, are exact)."""
    import torch

    seed = seed.to(torch.int64)
    h = torch.zeros((), dtype=torch.int64, device=seed.device)
    h = _mix(h, seed & _MASK32)
    h = _mix(h, (seed >> 32) & _MASK32)
    h = _mix(h, positions.to(torch.int64) & _MASK32)
    h = _mix(h.view(-1, 1), col_indices.to(torch.int64).view(1, -1) & _MASK32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def multinomial_with_seed(logprobs, seed, positions):
    """SGLang's sampler.multinomial_with_seed without triton or torch.compile: for row i, the argmax over columns
    of logprobs[i] + Gumbel noise drawn from hash(seed[i], positions[i], column). [n, m], [n], [n] -> [n, 1]."""
    import torch

    n, m = logprobs.shape
    hashed = murmur_hash32(seed, positions, torch.arange(m, device=logprobs.device))
    x = hashed.to(torch.float64) / float(_MASK32)
    x.log_().clamp_(min=torch.finfo(x.dtype).min).neg_()
    x.log_().neg_()
    x.add_(logprobs.to(torch.float64))
    return torch.argmax(x, dim=1, keepdim=True)


def _patch_server_args(module) -> None:
    if "torch_native" not in module.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        module.add_deterministic_attention_backend_choices(["torch_native"])


def _patch_sampler(module) -> None:
    module.multinomial_with_seed = multinomial_with_seed


def _patch_model_runner(module) -> None:
    module.ModelRunner.maybe_enable_batch_invariant_mode = lambda self: None


PATCHES = {
    "sglang.srt.server_args": _patch_server_args,
    "sglang.srt.layers.sampler": _patch_sampler,
    "sglang.srt.model_executor.model_runner": _patch_model_runner,
}


def install() -> None:
    """Patch the modules of PATCHES, now where imported and on import elsewhere. Idempotent."""
    from mcore_rl.rollout.after_import import patch_after_import

    for name, patch in PATCHES.items():
        patch_after_import(name, patch)
