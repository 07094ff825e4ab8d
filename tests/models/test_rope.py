"""models/rope.py: packed RoPE in one call equals Megatron's per-sequence THD path bit for bit."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention

from mcore_rl.models import rope


class _Config:
    apply_rope_fusion = False
    rotary_interleaved = False
    multi_latent_attention = False


class _OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


def _case(lengths, dtype, rot_dim=16, head_dim=16, max_len=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    t = torch.randn(total, 3, head_dim, generator=g).to(dtype)
    max_len = max_len or max(lengths)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    ang = torch.outer(torch.arange(max_len).float(), inv)
    freqs = torch.cat([ang, ang], dim=-1)[:, None, None, :]  # [max_len, 1, 1, rot_dim]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return t, freqs, cu


def test_packed_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert rope.packed_positions(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths,head_dim", [([5, 1, 9, 3], 16), ([7], 16), ([4, 4, 4], 24)])
def test_equals_megatron_thd(lengths, head_dim, dtype):
    t, freqs, cu = _case(lengths, dtype, head_dim=head_dim)  # head_dim 24 > rot_dim 16: partial rotary
    expected = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
    got = rope.apply_rotary_pos_emb(t, freqs, _Config(), cu_seqlens=cu, cp_group=_OneRank())
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    # a longer frequency table (max_position_embeddings) gives the same result: positions restart per sequence
    t2, long_freqs, _ = _case(lengths, dtype, head_dim=head_dim, max_len=64)
    got_long = rope.apply_rotary_pos_emb(t, long_freqs, _Config(), cu_seqlens=cu, cp_group=_OneRank())
    assert torch.equal(got_long, expected)


class _InterleavedConfig(_Config):
    rotary_interleaved = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_equals_megatron_thd(dtype):
    t, freqs, cu = _case([5, 1, 9, 3], dtype, head_dim=24)
    expected = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=True, cp_group=_OneRank())
    got = rope.apply_rotary_pos_emb(t, freqs, _InterleavedConfig(), cu_seqlens=cu, cp_group=_OneRank())
    assert torch.equal(got, expected)


def test_cos_sin_computed_once_per_micro_batch():
    """Every layer's queries and keys of one micro batch reuse the first call's cos / sin (the bounds tensor is the
    key, by identity); a new micro batch's bounds compute them anew."""
    t, freqs, cu = _case([5, 1, 9, 3], torch.float32)
    rope.clear_cache()
    first = rope._packed_cos_sin(freqs, cu, t.size(0), t.dtype, 1.0, False)
    assert rope._packed_cos_sin(freqs, cu, t.size(0), t.dtype, 1.0, False) is first
    assert first[0].shape == (t.size(0), 1, freqs.size(-1))  # broadcasts over [t, heads, d] as it is
    other = rope._packed_cos_sin(freqs, cu.clone(), t.size(0), t.dtype, 1.0, False)
    assert other is not first and torch.equal(other[0], first[0])


def test_gradients_equal_megatron_thd():
    t, freqs, cu = _case([6, 2, 5], torch.float32, seed=1)
    a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
    w = torch.randn_like(t)
    (rope_utils._apply_rotary_pos_emb_thd(a, cu, freqs, cp_group=_OneRank()) * w).sum().backward()
    (rope.apply_rotary_pos_emb(b, freqs, _Config(), cu_seqlens=cu, cp_group=_OneRank()) * w).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_other_cases_go_to_megatron():
    t, freqs, _ = _case([6], torch.float32)
    bshd = t[:, None]  # [s, b=1, h, d]
    assert torch.equal(rope.apply_rotary_pos_emb(bshd, freqs, _Config(), cu_seqlens=None, cp_group=_OneRank()),
                       rope_utils._apply_rotary_pos_emb_bshd(bshd, freqs))


def test_install_points_megatron_attention_here():
    try:
        rope.install(packed=False)  # ModelConfig.packed_rope=false: Megatron's per-sequence path
        assert attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
        rope.install(compile="on")
        assert attention.apply_rotary_pos_emb.keywords == {"compile": "on"}
        with pytest.raises(ValueError, match="model.compile_rope must be one of"):
            rope.install(compile="yes")
    finally:
        rope.install()
    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
def test_compiled_rotation_matches_megatron(dtype, tol):
    """What GPUs run (torch.compile'd rotation), compiled here on the CPU: fp32 equal to Megatron's THD path up
    to fp32 rounding; bf16 within a bf16 rounding step of the values' scale (the fused kernel rounds once)."""
    t, freqs, cu = _case([5, 2, 9], dtype, head_dim=24, seed=2)
    a, b = t.clone().float().to(dtype).requires_grad_(), t.clone().requires_grad_()
    w = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    expected = rope_utils._apply_rotary_pos_emb_thd(a, cu, freqs, cp_group=_OneRank())
    got = rope.apply_rotary_pos_emb(b, freqs, _Config(), cu_seqlens=cu, cp_group=_OneRank(), compile="on")
    (expected * w).sum().backward()
    (got * w).sum().backward()
    scale = expected.detach().abs().max().item()
    assert (got.detach().float() - expected.detach().float()).abs().max().item() <= tol * scale
    assert (b.grad.float() - a.grad.float()).abs().max().item() <= tol * a.grad.abs().max().item()
