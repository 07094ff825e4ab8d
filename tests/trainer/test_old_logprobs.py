"""actor.old_logprobs: which source of log pi_old a step uses (pure rule), the config's errors, and one real step
per source (tests/trainer/old_logprobs_worker.py: Megatron actor + reference, fp32, gloo, DP=2).

Parity tolerance, recompute vs current (auto's shortcut): the weights must match within 1e-3 of the update's
size and the metrics within 1e-6 relative. On CPU fp32 the forward-only pass and the training forward run the
same kernels on the same micro batches, so the recomputed log-probs equal the update's bit for bit, the ratio
is exactly 1 on both paths and the weights come out identical (observed: difference 0.0); what remains is
float reordering in metrics that moved from prepare's whole-batch means into the loss's per-micro-batch sums
(observed ~1e-7 relative). The first Adam step moves a weight by about lr * sign(grad), so one flipped sign
would show as 2 x lr: 1e-3 of the update's size leaves no room for one. The rollout run, whose old log-probs
differ from the actor's by up to 0.1, is the negative control: its gradient and weights must differ far
beyond the tolerance.
"""

import json

import pytest

from mcore_rl.config.rl import ActorConfig
from mcore_rl.trainer.rl_step import old_logprob_source
from tests.parallel import launcher
from tests.trainer.conftest import ROOT

METRIC_RTOL = 1e-6
WEIGHT_RTOL = 1e-3  # of the update's max abs size
GAP_ATOL = 2e-6  # rollout log-probs were written as fp32 (log pi - gap), |log pi| ~ 6: ulp ~ 5e-7


@pytest.mark.parametrize("kw,expected", [
    (dict(ppo_epochs=1, num_mini_batches=1, kl_in_reward=False), "current"),
    (dict(ppo_epochs=2, num_mini_batches=1, kl_in_reward=False), "recompute"),
    (dict(ppo_epochs=1, num_mini_batches=4, kl_in_reward=False), "recompute"),
    (dict(ppo_epochs=1, num_mini_batches=1, kl_in_reward=True), "recompute"),
])
def test_auto_skips_only_the_single_on_policy_update(kw, expected):
    assert old_logprob_source("auto", **kw) == expected
    assert old_logprob_source("recompute", **kw) == "recompute"
    assert old_logprob_source("rollout", **kw) == "rollout"


def test_config_errors():
    with pytest.raises(ValueError, match=r"actor.old_logprobs='skip' is not one of auto, recompute, rollout"):
        ActorConfig(old_logprobs="skip")
    with pytest.raises(ValueError, match=r"actor.tis_cap \(2.0\) reweights by pi_old / pi_rollout, which is 1 with "
                                         r"actor.old_logprobs=rollout: set actor.tis_cap=null"):
        ActorConfig(old_logprobs="rollout", tis_cap=2.0)
    assert ActorConfig().old_logprobs == "auto"
    with pytest.raises(ValueError, match="actor.old_logprobs must be auto, recompute or rollout"):
        old_logprob_source("skip", ppo_epochs=1, num_mini_batches=1, kl_in_reward=False)


def test_forward_pass_budget():
    # the forward-only passes (old / reference log-probs, values) default to twice the update's token budget
    assert ActorConfig(max_tokens_per_micro_batch=3000).forward_tokens_per_micro_batch == 6000
    cfg = ActorConfig(max_tokens_per_micro_batch=3000, forward_max_tokens_per_micro_batch=5000)
    assert cfg.forward_tokens_per_micro_batch == 5000
    with pytest.raises(ValueError, match=r"actor.forward_max_tokens_per_micro_batch must be >= 0 \(0 = twice "
                                         r"max_tokens_per_micro_batch\), got -1"):
        ActorConfig(forward_max_tokens_per_micro_batch=-1)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("old_logprobs")
    launcher.run_torchrun(ROOT / "tests" / "trainer" / "old_logprobs_worker.py", 2, out)
    return json.loads((out / "result.json").read_text())


def _diagnostics(m):
    return {k: v for k, v in m.items() if not k.startswith("timing/") and k != "actor/old_logprobs_recomputed"}


@pytest.mark.slow
def test_shortcut_matches_recompute(steps):
    rec, cur = steps["runs"]["recompute"], steps["runs"]["current"]
    assert rec["actor/old_logprobs_recomputed"] == 1.0 and cur["actor/old_logprobs_recomputed"] == 0.0
    # the same keys (rollout/*, kl now come from the loss), the same values
    assert _diagnostics(cur) == pytest.approx(_diagnostics(rec), rel=METRIC_RTOL, abs=1e-12)
    assert steps["update_size"] > 0
    assert steps["diff_current"] <= WEIGHT_RTOL * steps["update_size"], steps
    # the metrics are not trivially equal: the gap, KL and TIS are exercised
    assert rec["rollout/logprob_diff"] > 0.01 and rec["kl"] != 0 and rec["actor/kl_loss"] > 0


@pytest.mark.slow
def test_rollout_source_feeds_the_loss(steps):
    rol, rec, exp = steps["runs"]["rollout"], steps["runs"]["recompute"], steps["expected_rollout"]
    assert rol["actor/old_logprobs_recomputed"] == 0.0
    # ratio = exp(log pi - rollout) = exp(gap) per token; ppo_kl = mean(rollout - log pi) = -mean(gap)
    assert rol["actor/ratio_mean"] == pytest.approx(exp["ratio_mean"], abs=GAP_ATOL)
    assert rol["actor/ppo_kl"] == pytest.approx(exp["ppo_kl"], abs=GAP_ATOL)
    assert rol["actor/approx_kl"] == pytest.approx(exp["kl_k3"], abs=GAP_ATOL)
    assert rol["rollout/logprob_diff"] == pytest.approx(exp["logprob_diff"], abs=GAP_ATOL)
    assert rol["rollout/logprob_diff_max"] == pytest.approx(exp["logprob_diff_max"], abs=GAP_ATOL)
    assert rol["rollout/kl"] == pytest.approx(exp["kl_k3"], abs=GAP_ATOL)
    # negative control for the parity test: other old log-probs change the gradient and the weights
    assert abs(rol["actor/grad_norm"] / rec["actor/grad_norm"] - 1) > 1000 * METRIC_RTOL
    assert abs(rol["actor/pg_loss"] / rec["actor/pg_loss"] - 1) > 1000 * METRIC_RTOL
    assert steps["diff_rollout"] > 100 * WEIGHT_RTOL * steps["update_size"], steps
