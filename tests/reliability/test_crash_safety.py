"""Crash safety of a real run (torchrun, 2 workers, real Megatron and SGLang on CPU, the tiny model):

* kill -9 of the torchrun process alone: every process of the run (workers, SGLang's scheduler and
  detokenizer) is gone within 10 s (issue 23's bound), and nothing more is written to the output folder;
* a second run pointed at the output folder of a live run fails at start, naming the folder and the holder,
  and writes nothing there;
* SIGTERM (to torchrun, or to each worker's process group as torchrun forwards it) after a step, mid-rollout,
  mid-update and while the rollout engine starts: one line, status 80, a checkpoint of the step in progress
  (none before step 1), nothing left, and resume=auto finishes the run;
* the rollout engine failing to start on rank 0: every rank exits at once with rank 0's error.

Every wait is bounded so a regression fails instead of hanging CI.
"""

import json
import os
import re
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


def _launch(overrides, log_path: Path | None = None):
    """torchrun with 2 workers in a session of its own; its output (torchrun's and the workers') to log_path."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tools" / "train_ppo.py"), *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if log_path is None:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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


def _cmdline(p: psutil.Process) -> str:
    """A process's command line, "" for one that has exited (a zombie not yet reaped, such as a checkpoint writer
    the save forked and has not joined yet: psutil refuses to read its command line) or is gone."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _run_port(proc) -> str:
    """The MASTER_PORT of a launched run, read from a worker's environment: what every process the run starts
    inherits, and what _of_run finds them by."""
    return _workers(proc)[0].environ()["MASTER_PORT"]


def _of_run(port: str) -> list[int]:
    """Every live process whose environment names the run's MASTER_PORT: its workers and whatever they started,
    re-parented to init or not, including processes started after a snapshot of the tree was taken."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MASTER_PORT") == port and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def _wait_until_gone(pids, bound_s: float) -> None:
    """Until none of `pids` lives or bound_s has passed (the caller asserts which)."""
    deadline = time.monotonic() + bound_s
    while _living(pids) and time.monotonic() < deadline:
        time.sleep(0.2)


def _ended(proc, run_pids, t0: float) -> float:
    """Wait for torchrun to exit, then for every process of the run to be gone (bounded); assert none is left.
    Returns the seconds from t0 to torchrun's exit."""
    proc.wait(timeout=120)
    exit_s = time.monotonic() - t0
    _wait_until_gone(run_pids, EXIT_BOUND_S)
    assert not _living(run_pids)
    return exit_s


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
        assert "received SIGTERM" not in msg  # the refused run's other ranks end at torchrun's signal, quietly
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
        exit_s = _ended(proc, run_pids, t0)
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


ENGINE_DEATH_RUNS = {
    "sync": ("the SGLang scheduler process killed mid-run", []),
    # the producer thread is always mid-batch (long generations) when the scheduler goes: its error reaches the
    # step that takes the batch (trainer/async_rollout.py)
    "one_step_off_policy": ("the SGLang scheduler killed while an asynchronous run generates ahead "
                            "(trainer.rollout_mode=one_step_off_policy)",
                            ["trainer.rollout_mode=one_step_off_policy", "rollout.max_new_tokens=160",
                             "rollout.ignore_eos=true", "model.max_seq_len=512"]),
}


@pytest.mark.parametrize("mode", list(ENGINE_DEATH_RUNS))
def test_engine_death_is_one_line_and_leaves_nothing(tiny_model, arith_data, tmp_path, record, mode):
    """The SGLang scheduler killed mid-run: every rank stops (no rank waits for samples that never come), rank 0
    says once which step failed, why, and where the last checkpoint is; no process of the run is left."""
    case, extra = ENGINE_DEATH_RUNS[mode]
    out = tmp_path / "run"
    log_path = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tools" / "train_ppo.py"),
           *tiny_overrides(tiny_model, arith_data, str(out)), "trainer.total_steps=100000", "trainer.export_hf=false",
           "trainer.save_every=1", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_step(proc, out)
        port = _run_port(proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        run_pids = [c.pid for c in tree]
        scheduler = [c for c in tree if "sglang::scheduler" in _cmdline(c)]
        assert scheduler, [_cmdline(c)[:200] for c in tree]
        scheduler[0].kill()
        t0 = time.monotonic()
        exit_s = _ended(proc, run_pids, t0)
        text = log_path.read_text()
        lines = [line for line in text.splitlines() if "the rollout engine failed in step" in line]
        assert len(lines) == 1, text[-4000:]
        assert "Last checkpoint:" in lines[0] and "trainer.resume=auto" in lines[0]
        orphans = _of_run(port)  # none of the run's processes, the tree's snapshot or not, outlives it
        assert not orphans, [_cmdline(psutil.Process(p))[:200] for p in orphans]
        # nothing half-written: every metrics row whole, the checkpoint `latest` names complete, no partial one
        text = (out / "metrics.jsonl").read_text()
        assert text.endswith("\n") and all(json.loads(row) for row in text.splitlines())
        latest = (out / "checkpoints" / "latest").read_text().strip()
        assert (out / "checkpoints" / latest / "state.json").is_file() and latest in lines[0], (latest, lines[0])
        assert not list((out / "checkpoints").glob("*.tmp"))
        record(case=case, sees="once, from rank 0: 'the rollout engine "
               "failed in step k: ... Last checkpoint: ...; continue with trainer.resume=auto'",
               exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)


# ---- SIGTERM in each phase of a step, and while the engine starts ------------------------------------------------
SLOW_STEP = ["rollout.max_new_tokens=160", "rollout.ignore_eos=true", "actor.ppo_epochs=48"]
"""Rollouts and updates of a second or more each on CPU (0.3 s and 0.2 s with 48 tokens and 4 epochs), so that a
signal can be aimed at either."""


def _workers(proc) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children() if "train_ppo.py" in _cmdline(c)]


def _sigterm_workers(proc) -> list[int]:
    """SIGTERM to each worker's process group, as torchrun forwards it (its workers lead sessions of their own).
    Sent to the workers rather than to torchrun, so that torchrun reports their exit status. Returns every pid
    of the run but torchrun's."""
    tree = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for w in _workers(proc):
        os.killpg(w.pid, signal.SIGTERM)
    return tree


def _phase_bounds(row: dict, phase: str) -> tuple[float, float]:
    """Where `phase` (rollout, or update: the forward passes and the update) lay within the step of metrics row
    `row`, in seconds from the step's start."""
    if phase == "rollout":
        return 0.0, row["timing/rollout_s"]
    return row["timing/prepare_s"], row["timing/prepare_s"] + row["timing/train_s"]


def _sleep_into_step_4(proc, out: Path, phase: str) -> float:
    """Return a third into step 4's rollout or in the middle of its update, aimed from step 2's timings (steps 2
    on take alike; the rollout is the shorter phase, and it varies); the value is step 4's start (monotonic)."""
    lo, hi = _phase_bounds(_wait_for_rows(proc, out, 2)[-1], phase)
    _wait_for_rows(proc, out, 3)
    step_start = time.monotonic()  # step 4 starts as step 3's row is written
    aim = lo + (hi - lo) / (3 if phase == "rollout" else 2)
    time.sleep(max(0.0, aim - (time.monotonic() - step_start)))
    return step_start


def _wait_for_rows(proc, out: Path, num_rows: int) -> list[dict]:
    """Until metrics.jsonl has num_rows rows (polled every 50 ms: the next step starts as a row is written)."""
    deadline = time.monotonic() + START_BOUND_S
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run exited early with {proc.returncode}")
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if len(lines) >= num_rows and lines[num_rows - 1].endswith("}"):
            return [json.loads(line) for line in lines[:num_rows]]
        time.sleep(0.05)
    pytest.fail(f"{num_rows} steps not logged within {START_BOUND_S} s")


def _stopped(proc, run_pids, log_path: Path) -> tuple[float, str]:
    """Wait for a run sent SIGTERM to end; check that both workers exited with status 80 (torchrun's report), one
    stop line and no process left. Returns (seconds to exit, the stop line)."""
    t0 = time.monotonic()
    exit_s = _ended(proc, run_pids, t0)
    text = log_path.read_text()
    assert len(re.findall(r"exitcode\s+:\s*80 \(pid", text)) == 2, text[-4000:]  # each worker, as torchrun reports
    assert not _our_tracebacks(text), text[-4000:]
    lines = [line for line in text.splitlines() if "mcore_rl: stopped by SIGTERM" in line]
    assert len(lines) == 1, text[-4000:]
    return exit_s, lines[0]


def _our_tracebacks(text: str) -> list[str]:
    """Traceback lines through the trainer's code (torchrun's own report of failed workers has one of its own)."""
    return [line for line in text.splitlines() if line.strip().startswith(f'File "{ROOT / "mcore_rl"}')]


def _resume_finishes(common: list[str], out: Path, saved: int) -> None:
    run_train(2, common + [f"trainer.total_steps={saved + 1}", "trainer.resume=auto"], timeout=600)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, saved + 2))


@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_sigterm_mid_phase_saves_the_step_and_resume_continues(phase, tiny_model, arith_data, tmp_path, record):
    """The signal is aimed at a third into step 4's rollout or the middle of its update, from step 2's timings
    (steps 2 on take alike), and step 4's own timings confirm where it landed. The run finishes that step, saves
    it, exits 80."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    common = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.export_hf=false", "trainer.save_every=0",
                                                                 *SLOW_STEP]
    proc = _launch(common + ["trainer.total_steps=100000"], log_path)
    try:
        step_start = _sleep_into_step_4(proc, out, phase)
        run_pids = _sigterm_workers(proc)
        sent_at = time.monotonic() - step_start
        exit_s, line = _stopped(proc, run_pids, log_path)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        lo4, hi4 = _phase_bounds(rows[-1], phase)
        assert rows[-1]["step"] == 4 and lo4 < sent_at < hi4, (sent_at, lo4, hi4, rows[-1])
        saved = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
        assert saved == 4 and "stopped by SIGTERM after step 4; checkpoint" in line and "resume=auto" in line, line
        assert not list((out / "checkpoints").glob("*.tmp"))
        record(case=f"SIGTERM to the workers mid-{phase} (as torchrun forwards it)",
               sees="'stopped by SIGTERM after step k; checkpoint ...' once; the step in progress is finished and "
               "saved; status 80; resume=auto continues", exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)
    _resume_finishes(common, out, saved)


def _wait_for_engine_start(proc, out: Path) -> None:
    """Until rank 0's SGLang scheduler process exists and no step has been logged: the engine is starting."""
    deadline = time.monotonic() + START_BOUND_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run exited early with {proc.returncode}")
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
            if any("sglang::scheduler" in _cmdline(c) for c in tree):
                assert not (out / "metrics.jsonl").exists()
                return
        except psutil.NoSuchProcess:  # a process of the tree came or went while we looked
            pass
        time.sleep(0.1)
    pytest.fail(f"the rollout engine did not start within {START_BOUND_S} s")


def test_sigterm_while_the_engine_starts_is_one_line(tiny_model, arith_data, tmp_path, record):
    """SIGTERM while rank 0's SGLang engine is still starting (before step 1): the start-up ends, every rank exits
    80 with one line saying there is no checkpoint yet; nothing is left, nothing was saved."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=100000",
                                                                       "trainer.export_hf=false"], log_path)
    try:
        _wait_for_engine_start(proc, out)
        run_pids = _sigterm_workers(proc)
        exit_s, line = _stopped(proc, run_pids, log_path)
        assert ("stopped by SIGTERM while the rollout engine was starting, before step 1; no checkpoint exists (the "
                "first is saved after step 1): start the run again") in line, line
        assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
        assert exit_s <= EXIT_BOUND_S, f"{exit_s:.1f} s to exit (bound {EXIT_BOUND_S} s)"
        record(case="SIGTERM to the workers while the rollout engine starts (before step 1)",
               sees="'stopped by SIGTERM while the rollout engine was starting, before step 1; no checkpoint exists "
               "...'; status 80", exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)


def test_engine_that_fails_to_start_stops_every_rank(tiny_model, arith_data, tmp_path, record):
    """rank 0's engine cannot start (a context length SGLang refuses for the model): rank 1, which waits for it,
    exits as promptly, with rank 0's error; one line from rank 0, no traceback, nothing left. Time to exit: from
    the line to torchrun's exit."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=3",
                                                                       "rollout.context_length=100000"], log_path)
    try:
        deadline = time.monotonic() + START_BOUND_S
        while "the rollout engine failed to start" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        exit_s = _ended(proc, run_pids, t0)
        text = log_path.read_text()
        assert len(re.findall(r"exitcode\s+:\s*1 \(pid", text)) == 2 and not _our_tracebacks(text), text[-4000:]
        lines = [line for line in text.splitlines() if "mcore_rl: the rollout engine failed to start" in line]
        assert len(lines) == 1, text[-4000:]
        assert "SGLang engine failed to start" in lines[0] and "context_length (100000)" in lines[0], lines[0]
        assert exit_s <= EXIT_BOUND_S, f"{exit_s:.1f} s to exit (bound {EXIT_BOUND_S} s)"
        record(case="the rollout engine fails to start on rank 0", sees="once, from rank 0: 'the rollout engine "
               "failed to start: SGLang engine failed to start ...: <SGLang's reason>'; every rank exits, status 1",
               exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)
