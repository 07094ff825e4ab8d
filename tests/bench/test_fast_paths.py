"""The training fast paths against their reference paths on CPU: packed attention in one batched SDPA call
("padded") against one call per sequence ("loop"), forward and gradients; the fused Triton log-prob kernels
(run by Triton's interpreter, in a subprocess since TRITON_INTERPRET is read at import) against the torch path.
On a GPU, `python -m mcore_rl.bench.profile_train` checks the CUDA kernels (varlen flash attention, compiled
Triton) the same way."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.parallel import megatron_on_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def attention():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    megatron_on_cpu.apply()
    tracker = get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    from mcore_rl.models import attention as att

    return att


@pytest.mark.parametrize(("lengths", "pad"), [([5, 5, 5], 0), ([3, 1, 7, 2], 2), ([4, 4], 3)])
def test_padded_packed_attention_matches_loop(attention, lengths, pad):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                            attention_dropout=0.0)
    tp_one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    t = sum(lengths) + pad
    cu = torch.tensor([0, *attention._cumsum(lengths)], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    grad_out = torch.randn(t, 32, generator=g, dtype=torch.float64)
    results = {}
    for impl in ("loop", "padded"):
        attn = attention.SDPAttention(cfg, 1, None, "self", pg_collection=tp_one, packed_impl=impl)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_kv=max(lengths))
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = attn(q, k, v, None, packed_seq_params=params)
        out.backward(grad_out)
        results[impl] = (out, q.grad, k.grad, v.grad)
    for a, b in zip(results["loop"], results["padded"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.all(results["padded"][0][sum(lengths):] == 0)


_FUSED_CHECK = r"""
import torch
from mcore_rl.engine import logprobs as L
L._BLOCK = 64  # several blocks per row
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    for T in (1.0, 0.7):
        for ent in (False, True):
            V, vocab = 300, 290  # 10 padded vocabulary entries
            x = (torch.randn(2, 5, V) * 3).to(dtype)
            tgt = torch.randint(0, vocab, (2, 5))
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            lp1, e1 = L._VocabParallelLogprobs.apply(a, tgt, 0, vocab, T, ent, None)
            lp2, e2 = L._FusedVocabParallelLogprobs.apply(b, tgt, 0, vocab, T, ent, None)
            g, ge = torch.randn(2, 5), torch.randn(2, 5)
            ((lp1 * g).sum() + ((e1 * ge).sum() if ent else 0)).backward()
            ((lp2 * g).sum() + ((e2 * ge).sum() if ent else 0)).backward()
            assert b.grad.dtype == dtype and torch.all(b.grad[..., vocab:] == 0)
            torch.testing.assert_close(lp1, lp2, rtol=0, atol=1e-5)
            if ent:
                torch.testing.assert_close(e1, e2, rtol=0, atol=1e-5)
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 gradients: one or two roundings apart
            torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0, atol=tol)
print("FUSED_OK")
"""


def test_fused_logprobs_match_torch_path_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert "FUSED_OK" in proc.stdout, proc.stderr[-3000:]
