"""End-to-end runs of tools/train_ppo.py under torchrun with real Megatron-Core (gloo) and real SGLang on CPU.

Parity checked on every run: after each weight sync the SGLang engine's log-probs of its own samples equal the
Megatron actor's (`rollout/logprob_diff_max`), in fp32 within 1e-4 (observed ~3e-5: the two use different
matmul and softmax kernels, nothing else differs).
"""

import pytest

from tests.trainer.conftest import read_metrics, run_train, tiny_overrides

REQUIRED = ["step", "reward/mean", "response_length/mean", "kl", "actor/pg_loss", "actor/grad_norm",
            "rollout/logprob_diff", "timing/rollout_s", "timing/train_s", "timing/weight_sync_s",
            "throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"]
LOGPROB_TOL = 1e-4

pytestmark = pytest.mark.slow


def _check_run(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        missing = [k for k in REQUIRED if r.get(k) is None]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["rollout/logprob_diff_max"] < LOGPROB_TOL, r
        assert r["actor/grad_norm"] > 0
    assert [r["rollout/weight_version"] for r in rows] == [float(s) for s in range(1, steps + 1)]
    # trainer.rollout_mode=sync (the default): every batch from the weights it trains, no asynchronous machinery
    assert [r["rollout/sample_weight_version"] for r in rows] == [float(s) for s in range(steps)]
    assert not [k for r in rows for k in r if k.startswith("async/")]


def test_grpo_dp2_trains_syncs_checkpoints_and_exports(tiny_model, arith_data, tmp_path):
    out = tmp_path / "run"
    run_train(2, tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=2", "trainer.save_every=1",
                                                                       "trainer.keep_last=1"])
    _check_run(read_metrics(out), 2)
    # retention kept one complete checkpoint and the marker points at it
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_0000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_0000002"
    # the exported actor loads in transformers and differs from the initial weights (it trained)
    import transformers

    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)
    deltas = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters())]
    assert max(deltas) > 1e-6
    assert list(dict(trained.named_parameters())) == list(dict(initial.named_parameters()))
    assert (out / "tensorboard").is_dir()


def test_ppo_with_critic_and_kl_in_reward(tiny_model, arith_data, tmp_path):
    out = tmp_path / "ppo"
    run_train(1, tiny_overrides(tiny_model, arith_data, str(out)) + [
        "experiment=ppo_critic", "trainer.total_steps=2", "trainer.prompts_per_step=4", "trainer.export_hf=false",
        "algorithm.kl_coef=0.05", "critic.lr=1e-4"])
    rows = read_metrics(out)
    _check_run(rows, 2)
    for r in rows:
        assert r["critic/value_loss"] is not None and r["critic/grad_norm"] > 0
        assert r["kl_coef"] == pytest.approx(0.05)
    # step 1 starts from the reference weights: KL exactly 0; step 2 after an update: KL > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["kl"] > 0


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_grpo_tp2_matches_rollout_logprobs(tiny_model, arith_data, tmp_path, sequence_parallel):
    """TP 2, with and without sequence parallelism (micro batches padded to a multiple of TP; the local spec's
    norms sum their gradients over TP). Also runs the colocated memory release (rollout.release_while_training,
    which frees nothing on CPU but makes the same calls): the engine releases its weights after each rollout and
    resumes them before the sync, and step 2's rollout log-probs, from the weights that sync wrote, still match the
    trainer's (_check_run)."""
    out = tmp_path / "tp2"
    run_train(2, tiny_overrides(tiny_model, arith_data, str(out)) + [
        "parallel.tp=2", "trainer.total_steps=2", "trainer.export_hf=false", "actor.kl_loss_coef=0.01",
        "rollout.release_while_training=true", f"parallel.sequence_parallel={str(sequence_parallel).lower()}"])
    rows = read_metrics(out)
    _check_run(rows, 2)
    assert rows[1]["actor/kl_loss"] is not None
    assert all(r["timing/engine_release_s"] > 0 and r["timing/engine_resume_s"] > 0 for r in rows)


def test_two_node_launch_through_hostfile(tiny_model, arith_data, tmp_path):
    """Two launchers of tools/launch_multinode.sh on this machine (loopback), one process each: DP=2 over two
    "nodes", torchrun's static rendezvous. Both must finish and the run must log its two steps."""
    import os
    import subprocess
    import sys

    from mcore_rl.net import free_port
    from tests.trainer.conftest import ROOT

    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "mn"
    env = dict(os.environ, HOSTFILE=str(hostfile), GPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
               PYTHONUNBUFFERED="1", PYTHON=sys.executable)  # the venv need not be activated
    args = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=1", "trainer.export_hf=false"]
    procs = [subprocess.Popen(["bash", "tools/launch_multinode.sh", *args], cwd=ROOT,
                              env=dict(env, NODE_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-5000:]
    assert "node 1 of 2" in outputs[1]
    rows = read_metrics(out)
    _check_run(rows, 1)
