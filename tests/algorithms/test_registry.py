"""Name registries: lookup errors, routing of one common keyword bundle, registration errors."""

import pytest
import torch

from mcore_rl.algorithms import (
    compute_advantages,
    compute_policy_loss,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    list_advantage_estimators,
    list_policy_losses,
    ppo_policy_loss,
    register_advantage,
    register_policy_loss,
)
from mcore_rl.algorithms import registry

from .helpers import mask_from_lengths

EXPECTED_ESTIMATORS = [
    "dr_grpo", "gae", "grpo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo",
]


def _bundle(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    mask = mask_from_lengths([3, 5, 0, 2], 5)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=dtype)
    return dict(
        response_mask=mask,
        scores=scores,
        group_ids=torch.tensor([0, 0, 1, 1]),
        token_rewards=torch.randn(4, 5, generator=g, dtype=dtype),
        values=torch.randn(4, 5, generator=g, dtype=dtype),
        gamma=0.99,
        lam=0.95,
    )


def test_builtin_names_are_registered():
    assert list_advantage_estimators() == EXPECTED_ESTIMATORS
    assert list_policy_losses() == ["gspo", "pg", "ppo"]
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("ppo") is ppo_policy_loss


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("gpro")
    assert str(err.value) == "unknown advantage estimator 'gpro'; known: " + ", ".join(EXPECTED_ESTIMATORS)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'x'; known: dr_grpo, gae"):
        compute_advantages("x", **_bundle())


def test_unknown_policy_loss_lists_known_names():
    with pytest.raises(ValueError, match=r"^unknown policy loss 'ppo2'; known: gspo, pg, ppo$"):
        get_policy_loss("ppo2")


@pytest.mark.parametrize("name", EXPECTED_ESTIMATORS)
def test_one_bundle_calls_every_estimator(name):
    bundle = _bundle()
    adv, ret = compute_advantages(name, **bundle)
    direct = get_advantage_estimator(name)
    accepted = registry._PARAMS[direct]
    adv_direct, ret_direct = direct(**{k: v for k, v in bundle.items() if k in accepted})
    torch.testing.assert_close(adv, adv_direct, rtol=0, atol=0)
    torch.testing.assert_close(ret, ret_direct, rtol=0, atol=0)
    assert adv.shape == (4, 5) and ret.shape == (4, 5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[bundle["response_mask"] == 0] == 0).all()


def test_typo_in_keyword_is_an_error():
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['lamda'\] for advantage estimator 'gae'"):
        compute_advantages("gae", lamda=0.9, **_bundle())


def test_missing_or_none_required_input_is_an_error():
    bundle = _bundle()
    del bundle["values"]
    with pytest.raises(ValueError, match=r"^advantage estimator 'gae' needs values= \(got None or nothing\)$"):
        compute_advantages("gae", **bundle)
    bundle["values"] = None
    with pytest.raises(ValueError, match=r"needs values="):
        compute_advantages("gae", **bundle)
    with pytest.raises(ValueError, match=r"^policy loss 'ppo' needs old_logprobs=, advantages= "):
        compute_policy_loss("ppo", logprobs=torch.zeros(1, 1), response_mask=torch.ones(1, 1))


def test_policy_loss_routing_drops_arguments_of_other_losses():
    mask = mask_from_lengths([2, 3], 3)
    lp = torch.randn(2, 3, dtype=torch.float64)
    adv = torch.randn(2, 3, dtype=torch.float64)
    kwargs = dict(logprobs=lp, old_logprobs=lp + 0.3, advantages=adv, response_mask=mask, clip_ratio_c=3.0)
    loss, _ = compute_policy_loss("pg", **kwargs)  # pg uses neither clip_ratio_c nor old_logprobs' ratio
    torch.testing.assert_close(loss, -(adv * lp)[mask.bool()].mean(), rtol=1e-12, atol=0)


def test_duplicate_and_variadic_registration_are_errors():
    with pytest.raises(ValueError, match=r"^advantage estimator 'grpo' is already registered \(by grpo_advantages\)"):
        register_advantage("grpo")(lambda *, scores: scores)
    with pytest.raises(ValueError, match=r"^policy loss 'ppo' is already registered"):
        register_policy_loss("ppo")(lambda *, logprobs: logprobs)

    def loose(*, response_mask, **kwargs):
        return response_mask

    with pytest.raises(ValueError, match=r"takes \*kwargs; registered functions must name every argument"):
        register_advantage("loose_test_only")(loose)
    assert "loose_test_only" not in list_advantage_estimators()


def test_user_registered_estimator_is_callable_by_name():
    name = "constant_test_only"

    def constant(*, response_mask, scores):
        adv = response_mask.to(scores.dtype) * 2.0
        return adv, adv

    try:
        register_advantage(name)(constant)
        adv, _ = compute_advantages(name, **_bundle())
        assert adv.sum().item() == 2.0 * 10
    finally:
        registry._ADVANTAGE_ESTIMATORS.pop(name, None)
        registry._PARAMS.pop(constant, None)
