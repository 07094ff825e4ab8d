"""Crash safety of a real run (torchrun, 2 workers, real Megatron and SGLang on CPU, the tiny model):

* kill -9 of the torchrun process alone: every process of the run (workers, SGLang's scheduler and
  detokenizer) is gone within 10 s (issue 23's bound), and nothing more is written to the output folder;
* a second run pointed at the output folder of a live run fails at start, naming the folder and the holder,
  and writes nothing there.

Every wait is bounded so a regression fails instead of hanging CI.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mcore_rl.net import free_port
from tests.trainer.conftest import ROOT, run_train, tiny_overrides

pytestmark = pytest.mark.slow

EXIT_BOUND_S = 10.0
START_BOUND_S = 420.0


def _launch(overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tools" / "train_ppo.py"), *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_for_step(proc, out: Path) -> None:
    """Until the run has logged a step (its engine is up and it trains), or fail."""
    deadline = time.monotonic() + START_BOUND_S
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run exited early with {proc.returncode}")
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(1.0)
    pytest.fail(f"no step logged within {START_BOUND_S} s")


def _living(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_until_gone(pids, bound_s: float) -> None:
    """Until none of `pids` lives or bound_s has passed (the caller asserts which)."""
    deadline = time.monotonic() + bound_s
    while _living(pids) and time.monotonic() < deadline:
        time.sleep(0.2)


def _stop(proc) -> None:
    """Tear a launched run down whatever state it is in (test cleanup)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [proc.pid, *(c.pid for c in tree)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def test_workers_die_with_their_launcher(tiny_model, arith_data, tmp_path, record):
    out = tmp_path / "run"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=100000",
                                                                       "trainer.export_hf=false"])
    try:
        _wait_for_step(proc, out)
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(run_pids) >= 4, run_pids  # 2 workers, each with SGLang processes on rank 0 at least
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait_until_gone(run_pids, 3 * EXIT_BOUND_S)
        waited = time.monotonic() - killed
        left = _living(run_pids)
        assert not left, f"{len(left)} processes of the run still alive {waited:.1f} s after kill -9 of torchrun"
        assert waited <= EXIT_BOUND_S, f"the run's processes took {waited:.1f} s to exit (bound {EXIT_BOUND_S} s)"
        record(case="kill -9 of the torchrun process", sees="each worker: 'the launcher (pid N) is gone; stopping "
               "worker ...', exit status 75", exit_s=round(waited, 1), left=len(left))
        rows = len((out / "metrics.jsonl").read_text().splitlines())
        time.sleep(2.0)
        assert len((out / "metrics.jsonl").read_text().splitlines()) == rows  # nothing writes any more
    finally:
        _stop(proc)


def test_second_run_on_a_live_output_folder_is_refused(tiny_model, arith_data, tmp_path, record):
    out = tmp_path / "run"
    first = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=100000",
                                                                        "trainer.export_hf=false"])
    try:
        _wait_for_step(first, out)
        before = (out / "metrics.jsonl").read_text()
        holder = json.loads((out / ".lock").read_text())
        t0 = time.monotonic()
        with pytest.raises(AssertionError) as e:
            run_train(2, tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=1"], timeout=300)
        msg = str(e.value)
        assert f"{out} is in use by another training run" in msg, msg[-3000:]
        assert f"pid {holder['pid']}" in msg and "trainer.output_dir" in msg
        assert time.monotonic() - t0 < 300
        record(case="a second run on the output folder of a live run",
               sees="'<folder> is in use by another training run (host, pid, started ...)', exit status 2; the first "
               "run goes on", exit_s=round(time.monotonic() - t0, 1), left=0)
        assert first.poll() is None  # the first run goes on
        assert (out / "metrics.jsonl").read_text().startswith(before)
    finally:
        _stop(first)


def test_sigterm_saves_and_resume_continues(tiny_model, arith_data, tmp_path, record):
    """SIGTERM to torchrun (what a scheduler sends before it kills): the run finishes its step, saves, exits with
    status 80 (reported by torchrun for its workers), leaves no process behind; resume=auto continues from the
    saved step. save_every=0, so without the stop signal nothing would be saved before the end."""
    out = tmp_path / "run"
    common = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.export_hf=false", "trainer.save_every=0"]
    proc = _launch(common + ["trainer.total_steps=100000"])
    try:
        _wait_for_step(proc, out)
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, signal.SIGTERM)  # torchrun passes it on to every worker's process group
        t0 = time.monotonic()
        proc.wait(timeout=120)
        exit_s = time.monotonic() - t0
        _wait_until_gone(run_pids, EXIT_BOUND_S)
        assert not _living(run_pids)
        latest = (out / "checkpoints" / "latest").read_text().strip()
        saved = int(latest.split("_")[1])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert saved >= 1 and rows[-1]["step"] == saved  # the checkpoint is of the last logged step
        assert not list((out / "checkpoints").glob("*.tmp"))
        record(case="SIGTERM to torchrun (preemption)", sees="'received SIGTERM: the run stops at the end of this "
               "step ...', then 'stopped by SIGTERM after step k; checkpoint ...'; status 80; resume=auto continues",
               exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)
    run_train(2, common + [f"trainer.total_steps={saved + 1}", "trainer.resume=auto"], timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, saved + 2))


def test_engine_death_is_one_line_and_leaves_nothing(tiny_model, arith_data, tmp_path, record):
    """The SGLang scheduler killed mid-run: every rank stops (no rank waits for samples that never come), rank 0
    says once which step failed, why, and where the last checkpoint is; no process of the run is left."""
    out = tmp_path / "run"
    log_path = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tools" / "train_ppo.py"),
           *tiny_overrides(tiny_model, arith_data, str(out)), "trainer.total_steps=100000", "trainer.export_hf=false",
           "trainer.save_every=1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_step(proc, out)
        tree = psutil.Process(proc.pid).children(recursive=True)
        run_pids = [c.pid for c in tree]
        scheduler = [c for c in tree if "sglang::scheduler" in " ".join(c.cmdline())]
        assert scheduler, [c.cmdline()[:2] for c in tree]
        scheduler[0].kill()
        t0 = time.monotonic()
        proc.wait(timeout=120)
        exit_s = time.monotonic() - t0
        _wait_until_gone(run_pids, EXIT_BOUND_S)
        assert not _living(run_pids)
        text = log_path.read_text()
        lines = [line for line in text.splitlines() if "the rollout engine failed in step" in line]
        assert len(lines) == 1, text[-4000:]
        assert "Last checkpoint:" in lines[0] and "trainer.resume=auto" in lines[0]
        record(case="the SGLang scheduler process killed mid-run", sees="once, from rank 0: 'the rollout engine "
               "failed in step k: ... Last checkpoint: ...; continue with trainer.resume=auto'",
               exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)
