"""OptimConfig.fast_optimizer: fused AdamW and foreach multi-tensor fallbacks (engine/fast_optim.py).

Unit checks of the foreach replacements against independent formulas, then fast_optim_worker.py (one 2-process
launch, DP=2) against Megatron's optimizer as shipped. Tolerances: the fused Adam kernel and the foreach path
evaluate the same fp32 formula in another order (~1 ulp per update), so after three steps of size ~lr = 1e-3
the weights (fp32) and the fp32 master weights (bf16 run) agree to 1e-6 absolute; the bf16 weights to one
bf16 rounding step of each tensor's scale (a 1-ulp master-weight difference can flip a rounding); losses of
the first step are equal (same weights), later ones within 1e-5 relative; a skipped or wrong update would move
weights by ~1e-3.
"""

import json

import pytest
import torch
from megatron.core import utils as mcore_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer

from mcore_rl.config.optim import OptimConfig
from mcore_rl.engine import fast_optim


def test_l2_norm_is_the_norm_of_all_tensors():
    torch.manual_seed(0)
    tensors = [torch.randn(5, 7), torch.randn(3), torch.randn(2, 2, 2) * 100]
    total, per_tensor = fast_optim.foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [tensors], False)
    expected = torch.cat([t.double().flatten() for t in tensors]).norm()
    assert total.shape == (1,) and total.dtype == torch.float32 and per_tensor is None
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    empty, _ = fast_optim.foreach_l2_norm(2048, torch.zeros(1, dtype=torch.int), [[]], False)
    assert empty.tolist() == [0.0]


def test_scale_copies_casts_and_scales_like_the_fallback():
    torch.manual_seed(0)
    src = [torch.randn(4, 3), torch.randn(6)]
    dst = [torch.empty(4, 3, dtype=torch.bfloat16), torch.empty(6, dtype=torch.bfloat16)]
    fast_optim.foreach_scale(2048, None, [src, dst], 1.0)
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dst, src))
    ref = [torch.empty_like(d) for d in dst]
    mcore_utils.local_multi_tensor_scale(2048, None, [src, ref], 0.3)
    fast_optim.foreach_scale(2048, None, [src, dst], 0.3)
    assert all(torch.equal(d, r) for d, r in zip(dst, ref))
    inplace = [s.clone() for s in src]
    fast_optim.foreach_scale(2048, None, [inplace, inplace], 0.25)  # gradient clipping scales in place
    assert all(torch.equal(a, s * 0.25) for a, s in zip(inplace, src))


def test_fallbacks_are_swapped_only_inside_the_block():
    shipped = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl)
    assert shipped == (mcore_utils.local_multi_tensor_l2_norm, mcore_utils.local_multi_tensor_scale,
                       mcore_utils.local_multi_tensor_scale)  # no TE / apex here: Megatron's local fallbacks
    with pytest.raises(RuntimeError):
        with fast_optim.foreach_fallbacks():
            assert clip_grads.l2_norm_impl is fast_optim.foreach_l2_norm
            assert clip_grads.multi_tensor_scale_impl is fast_optim.foreach_scale
            assert mcore_optimizer.multi_tensor_scale_impl is fast_optim.foreach_scale
            raise RuntimeError("restored even when the block fails")
    assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
            mcore_optimizer.multi_tensor_scale_impl) == shipped
    with fast_optim.foreach_fallbacks(enabled=False):
        assert clip_grads.l2_norm_impl is shipped[0]


def test_use_fused_adam_only_before_the_first_step():
    p = torch.nn.Parameter(torch.randn(3))
    fresh = torch.optim.AdamW([p])
    assert fast_optim.use_fused_adam([fresh, torch.optim.SGD([p], lr=0.1)]) == 1
    assert fresh.param_groups[0]["fused"] and not fresh.param_groups[0]["foreach"]
    used = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    used.step()
    assert fast_optim.use_fused_adam([used]) == 0


def test_config_value_is_checked():
    with pytest.raises(ValueError, match="optim.fast_optimizer must be one of"):
        OptimConfig(fast_optimizer="yes")


@pytest.fixture(scope="module")
def result(tmp_path_factory, tiny_models, torchrun):
    out = tmp_path_factory.mktemp("fast_optim")
    torchrun("fast_optim_worker.py", 2, out, tiny_models)
    return [json.loads((out / "fast_optim" / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("tag", ["fp32_dist", "bf16_local"])
def test_fast_optimizer_matches_the_shipped_one(result, tag):
    for r in result:
        case = r[tag]
        assert case["fused_on"] and all(case["fused_on"]) and not any(case["fused_off"])
        assert case["step_devices_on"] == ["cpu"]  # fused keeps `step` on the parameters' device
        assert case["calls_off"] == {"l2": 0, "scale": 0}
        assert case["calls_on"]["l2"] >= 3 and case["calls_on"]["scale"] >= 3  # norm and clip of every step
        # the steps changed the weights (fp32: by ~3 lr), so agreement is not trivial
        assert case["moved"]["abs"] > 1e-3 and case["moved"]["rel"] > 2 ** -7
        if tag == "fp32_dist":
            assert case["diff"]["abs"] <= 1e-6, case["diff"]
        else:  # fp32 master weights as fp32; bf16 weights within one bf16 rounding step of each tensor's scale
            assert case["master_diff"] is not None and case["master_diff"] <= 1e-6, case["master_diff"]
            assert case["diff"]["rel"] <= 2 ** -7, case["diff"]
        (loss_on0, gn_on0), (loss_off0, gn_off0) = case["log_on"][0], case["log_off"][0]
        assert loss_on0 == loss_off0 and gn_on0 == pytest.approx(gn_off0, rel=1e-6)
        for (loss_on, gn_on), (loss_off, gn_off) in zip(case["log_on"], case["log_off"]):
            assert loss_on == pytest.approx(loss_off, rel=1e-5) and gn_on == pytest.approx(gn_off, rel=1e-5)


def test_resume_with_the_fused_optimizer(result):
    for r in result:
        assert r["resume"]["equal"], r["resume"]["diff"]
        assert r["resume"]["log_bc"] == r["resume"]["log_a"]


def test_fused_swiglu_matches_unfused(tmp_path, tiny_models, torchrun):
    """Megatron's compiled SwiGLU (ModelConfig.fused_swiglu, on by default on GPUs) against the eager one, fp32:
    log-probs within 1e-5 and gradients within 1e-5 of each tensor's scale (the compiled kernel rounds once
    where eager silu then mul rounds twice)."""
    torchrun("fused_swiglu_worker.py", 1, tmp_path, tiny_models)
    r = json.loads((tmp_path / "fused_swiglu.json").read_text())
    assert r["fusion"] == [False, True]
    assert r["logprob_diff"] <= 1e-5
    assert r["grad_diff"]["rel"] <= 1e-5, r["grad_diff"]
