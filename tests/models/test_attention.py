"""SDPA core attention (mcore_rl/models/attention.py) against a naive fp64 attention: causal, grouped-query,
sliding window, and packed THD sequences that must not see each other."""

import math
from types import SimpleNamespace

import pytest
import torch

from mcore_rl.parallel import megatron_on_cpu

HEADS, GROUPS, DIM = 4, 2, 8


@pytest.fixture(scope="module")
def attention_cls():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    megatron_on_cpu.apply()  # the RNG tracker forks the CPU generator on a CUDA-less machine
    tracker = get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    from mcore_rl.models.attention import SDPAttention

    return SDPAttention


def make(attention_cls, window=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0)
    tp_one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return attention_cls(config, layer_number=1, attn_mask_type=None, attention_type="self",
                         pg_collection=tp_one, sliding_window=window)


def naive(q, k, v, window=None):
    """q: [s, nh, d], k/v: [s, ng, d] -> [s, nh * d], fp64, explicit mask and softmax."""
    s = q.size(0)
    rep = HEADS // GROUPS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    i = torch.arange(s)
    diff = i[:, None] - i[None, :]
    allowed = diff >= 0 if window is None else (diff >= 0) & (diff < window)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(s, HEADS * DIM)


def qkv(s, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, HEADS, DIM, generator=g, dtype=torch.float64),
            torch.randn(s, GROUPS, DIM, generator=g, dtype=torch.float64),
            torch.randn(s, GROUPS, DIM, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("window", [None, 3])
def test_padded_layout_matches_naive(attention_cls, window):
    attn = make(attention_cls, window)
    q, k, v = qkv(7, 0)
    # Megatron passes [s, b, n, d]
    out = attn(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), attention_mask=None)
    assert out.shape == (7, 1, HEADS * DIM)
    torch.testing.assert_close(out[:, 0], naive(q, k, v, window), rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lengths", [[5, 2, 6], [5, 0, 2, 6], [4, 4]])
def test_packed_sequences_attend_only_to_themselves(attention_cls, window, lengths):
    """Mixed lengths, an empty sequence (a graph's unused slot) and equal lengths (the reshape path)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = make(attention_cls, window)
    parts = [qkv(n, seed) for seed, n in enumerate(lengths) if n]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    total = sum(lengths)
    pad = 3  # trailing padding after the last sequence (not in cu_seqlens) yields zeros
    q, k, v = (torch.cat([t, torch.randn(pad, *t.shape[1:], dtype=t.dtype)]) for t in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    out = attn(q, k, v, attention_mask=None, packed_seq_params=params)
    assert out.shape == (total + pad, HEADS * DIM)
    expected = torch.cat([naive(*p, window) for p in parts])
    torch.testing.assert_close(out[:total], expected, rtol=0, atol=1e-12)
    assert torch.all(out[total:] == 0)


def test_packed_micro_batch_bounds_are_not_read_back(attention_cls, monkeypatch):
    """A micro batch moved by MicroBatch.to carries its host-side sequence bounds, so the packed attention reads
    nothing back from cu_seqlens (on a GPU that read is a sync that stops the host from queueing work ahead):
    no tolist() on any tensor during the layers' calls, and the same output as a layout that reads cu."""
    from mcore_rl.engine.batching import make_micro_batches

    attn = make(attention_cls)
    lengths = [5, 2, 6]
    seqs = [{"input_ids": torch.arange(n)} for n in lengths]
    (mb,) = make_micro_batches(seqs, 64)
    mb.to(torch.device("cpu"))
    params = mb.packed_seq_params
    assert params.mcore_rl_host_bounds[0] is params.cu_seqlens_q and params.mcore_rl_host_bounds[1] == [0, 5, 7, 13]
    q, k, v = qkv(mb.input_ids.size(1), 0)
    with monkeypatch.context() as patched:
        def refuse(self):
            raise AssertionError("a tensor was read back to the host")
        patched.setattr(torch.Tensor, "tolist", refuse)
        out = attn(q, k, v, attention_mask=None, packed_seq_params=params)
        again = attn(q, k, v, attention_mask=None, packed_seq_params=params)  # the next layer: the cached layout
    del params.mcore_rl_host_bounds, params._mcore_rl_layout  # read from cu instead
    expected = attn(q, k, v, attention_mask=None, packed_seq_params=params)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_unknown_packed_impl_is_refused(attention_cls):
    with pytest.raises(ValueError, match=r"model.packed_attention must be one of .*, got 'fast'"):
        attention_cls(None, layer_number=1, attn_mask_type=None, attention_type="self", packed_impl="fast")


def test_attention_bias_is_refused(attention_cls):
    attn = make(attention_cls)
    q, k, v = qkv(2, 0)
    with pytest.raises(ValueError, match="SDPA attention does not take an attention bias"):
        attn(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, attention_bias=torch.zeros(1))
