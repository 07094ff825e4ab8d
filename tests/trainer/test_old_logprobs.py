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
    return {k: v for k, v in m.items()
            if not k.startswith("timing/") and k not in ("actor/old_logprobs_recomputed", "actor/ref_in_update")}


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


@pytest.mark.slow
def test_rollout_gap_is_the_first_updates(steps):
    """With several updates a step, the engine/trainer gap comes from the first update only: the second epoch
    differentiates moved weights, whose gap would add the policy's drift."""
    two, exp = steps["runs"]["rollout_2epochs"], steps["expected_rollout"]
    assert two["rollout/logprob_diff"] == pytest.approx(exp["logprob_diff"], abs=GAP_ATOL)
    assert two["rollout/logprob_diff_max"] == pytest.approx(exp["logprob_diff_max"], abs=GAP_ATOL)
    assert two["rollout/kl"] == pytest.approx(exp["kl_k3"], abs=GAP_ATOL)
    # the control: the loss's own statistics, a mean over both epochs, do see the drift
    assert abs(two["actor/ppo_kl"] - exp["ppo_kl"]) > 10 * GAP_ATOL, (two["actor/ppo_kl"], exp["ppo_kl"])


@pytest.mark.slow
def test_off_policy_corrections_measure_the_known_gap(steps):
    """actor.off_policy_correction and tis_cap in a real step: rho = pi_old / pi_rollout = exp(gap) per token, gap
    drawn in [0, 0.1); the off_policy/* metrics equal the gap's statistics (GAP_ATOL), and masking the tokens with
    rho > 1.05 changes the update against TIS at 1.05 (same old log-probs, other weights)."""
    exp = steps["expected_correction"]
    over = exp["over_1.05"]
    assert 0.2 < over < 0.8  # both sides of the threshold are exercised
    for label, truncated, masked in (("recompute", over, 0.0), ("current", over, 0.0), ("masked", 0.0, over)):
        m = steps["runs"][label]
        assert m["off_policy/ratio_mean"] == pytest.approx(exp["ratio_mean"], abs=GAP_ATOL), label
        assert m["off_policy/ratio_max"] == pytest.approx(exp["ratio_max"], abs=GAP_ATOL), label
        assert m["off_policy/mismatch_kl"] == pytest.approx(exp["mismatch_kl"], abs=GAP_ATOL), label
        # a token exactly at the threshold could flip with a 1-ulp change of its gap: allow one token of the 60
        assert m["off_policy/truncated_frac"] == pytest.approx(truncated, abs=1 / 60), label
        assert m["off_policy/masked_frac"] == pytest.approx(masked, abs=1 / 60), label
    assert "off_policy/ratio_mean" not in steps["runs"]["rollout"]
    assert steps["diff_masked"] > 100 * WEIGHT_RTOL * steps["update_size"], steps


def test_off_policy_correction_config_errors():
    assert ActorConfig(off_policy_correction={"name": "seq_mask", "high": 1.5}).correction() == \
        ("seq_mask", {"high": 1.5})
    assert ActorConfig(tis_cap=2.0).correction() == ("token_tis", {"cap": 2.0})
    assert ActorConfig().correction() is None
    for spec, message in [
        ({"name": "clip"}, r"actor.off_policy_correction.name='clip' is not one of seq_mask, seq_tis, token_mask, "
                           r"token_tis"),
        ({"high": 2.0}, r"must be a dict with a name"),
        ({"name": "seq_mask", "cap": 2.0}, r"seq_mask takes low, high, seq_ratio; unknown: cap"),
        ({"name": "seq_mask", "low": 1.5}, r"actor.off_policy_correction \(seq_mask\): the band must satisfy"),
        ({"name": "seq_tis", "seq_ratio": "mean"}, r"seq_ratio must be 'geometric'"),
    ]:
        with pytest.raises(ValueError, match=message):
            ActorConfig(off_policy_correction=spec)
    with pytest.raises(ValueError, match=r"actor.tis_cap \(2.0\) and actor.off_policy_correction \(token_mask\) both"):
        ActorConfig(tis_cap=2.0, off_policy_correction={"name": "token_mask"})
    with pytest.raises(ValueError, match=r"which is 1 with actor.old_logprobs=rollout"):
        ActorConfig(old_logprobs="rollout", off_policy_correction={"name": "seq_tis"})


@pytest.mark.slow
def test_reference_in_the_update_matches_the_forward_pass(steps):
    """ref.compute_at=update: the reference's log-probs computed on the update's micro batches, just before it,
    instead of in prepare's forward passes. The forward budget equals the update's here, so the eager reference
    sees the same micro batches either way: the same metrics (METRIC_RTOL) and weights (WEIGHT_RTOL). Through the
    graphs' static layout (what auto picks) the log-probs differ from the eager ones by < 2e-5 (fp32, other
    shapes; tests/engine/test_graphed_forward.py), so the metrics agree within 1e-4 relative and the weights
    within 1e-2 of the update's size."""
    cur, upd, static = (steps["runs"][k] for k in ("current", "ref_in_update", "ref_in_update_static"))
    assert cur["actor/ref_in_update"] == 0.0 and upd["actor/ref_in_update"] == 1.0
    assert static["actor/ref_in_update"] == 1.0 and steps["auto_with_eager_ref"] is False
    assert _diagnostics(upd) == pytest.approx(_diagnostics(cur), rel=METRIC_RTOL, abs=1e-12)
    assert steps["diff_ref_in_update"] <= WEIGHT_RTOL * steps["update_size"], steps
    assert _diagnostics(static) == pytest.approx(_diagnostics(cur), rel=1e-4, abs=1e-9)
    # Adam normalises each entry's step, so a tiny gradient moved by the KL's 1e-5 shifts moves by more than the
    # METRIC's share (observed 3e-3 of the update's size); a flipped sign would show as 2x the update's size
    assert steps["diff_ref_in_update_static"] <= 1e-2 * steps["update_size"], steps
    assert cur["actor/kl_loss"] > 0 and cur["kl"] != 0  # the reference does reach the loss


def test_reference_in_the_update_rule():
    from types import SimpleNamespace

    from mcore_rl.config.rl import RefConfig
    from mcore_rl.trainer.rl_step import ref_in_update

    graphed, eager = SimpleNamespace(graphed=object()), SimpleNamespace(graphed=None)  # what the rule reads
    kw = dict(old_source="current", kl_in_reward=False)
    assert ref_in_update("auto", graphed, **kw) and not ref_in_update("auto", eager, **kw)
    assert ref_in_update("update", eager, **kw) and not ref_in_update("forward", graphed, **kw)
    assert not ref_in_update("update", None, **kw)  # no reference
    for source, kl_in_reward in (("recompute", False), ("rollout", False), ("current", True)):
        assert not ref_in_update("auto", graphed, old_source=source, kl_in_reward=kl_in_reward)
        with pytest.raises(ValueError, match=r"ref.compute_at=update needs the reference to feed the KL loss alone"):
            ref_in_update("update", graphed, old_source=source, kl_in_reward=kl_in_reward)
    assert RefConfig().compute_at == "auto"
    with pytest.raises(ValueError, match=r"ref.compute_at='later' is not one of auto, forward, update"):
        RefConfig(compute_at="later")
