"""Faults in the middle of a real run (torchrun, 2 workers, real Megatron and SGLang on CPU, the tiny model):

* a non-finite loss (a reward whose group sum overflows float32, so GRPO's advantages are nan):
  trainer.on_nonfinite=stop ends the run naming the step, the loss and the gradient norm, the last checkpoint
  untouched; skip leaves the weights alone, counts the skipped updates and goes on;
* a collective that never completes (one worker stopped with SIGSTOP): the other stops itself after
  parallel.watchdog_s, naming its rank, the phase and the step; torchrun ends the stopped one;
* kill -9 of every process of the run while a checkpoint is being written: resume=auto loads the last complete
  checkpoint and removes the partial one;
* Ctrl-C (SIGINT to the launch's process group, as a terminal sends it) mid-rollout and mid-update: one line,
  the engine, the process group and the logger closed, no process left, nothing half-written.

Each case bounds every wait, so a regression fails instead of hanging, and records its row of
docs/reliability.md (conftest.record).
"""

import json
import os
import re
import signal
import time
import warnings
from pathlib import Path

import psutil
import pytest

from tests.reliability.test_crash_safety import (EXIT_BOUND_S, SLOW_STEP, START_BOUND_S, _ended, _launch, _living,
                                                 _of_run, _our_tracebacks, _run_port, _sleep_into_step_4, _stop,
                                                 _wait_for_step, _wait_until_gone, _workers)
from tests.trainer.conftest import run_train, tiny_overrides

pytestmark = pytest.mark.slow

STOP_BOUND_S = 30.0
"""From the line of a run that stops on an error or Ctrl-C to torchrun's exit: every worker closes its engine,
reward workers, logger and process groups, then Python exits (with SGLang loaded, seconds). The bound is
torchrun's --shutdown-timeout (30 s), after which torchrun would SIGKILL a worker instead of letting it finish its
own shutdown. Measured: 3-9 s on the idle 2-core machine, 11-21 s at a load average of 30 (other test runs)."""

OVERFLOW = ["reward.function_path=tests.reliability.overflow_reward:overflowing"]


def _wait_for_line(proc, log_path: Path, pattern: str, bound_s: float = START_BOUND_S) -> str:
    """The first line of the run's log matching `pattern` (a regex), waiting for it at most bound_s."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if re.search(pattern, line):
                return line
        assert proc.poll() is None, f"the run exited ({proc.returncode}) without {pattern!r}:\n" + \
            log_path.read_text()[-4000:]
        time.sleep(0.1)
    pytest.fail(f"no {pattern!r} within {bound_s} s:\n" + log_path.read_text()[-4000:])


def _whole_lines(out: Path) -> list[dict]:
    """metrics.jsonl's rows, checking that it ends with a whole line (nothing half-written)."""
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n"), text[-300:]
    return [json.loads(line) for line in text.splitlines()]


def _latest(out: Path) -> Path:
    path = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (path / "state.json").is_file(), path
    return path


# ---- a non-finite loss ------------------------------------------------------------------------------------------

def test_nonfinite_loss_stops_naming_the_step(tiny_model, arith_data, tmp_path, record):
    """Two steps train and save; the resumed run's rewards overflow in step 3: the run stops on every rank with
    one line from rank 0 naming step 3, the actor's loss and gradient norm, and the checkpoint of step 2, which is
    still `latest`, complete and what resume=auto would load."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    common = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.export_hf=false", "trainer.save_every=1"]
    run_train(2, common + ["trainer.total_steps=2"], timeout=600)
    before = (out / "metrics.jsonl").read_text()
    proc = _launch(common + ["trainer.total_steps=4", "trainer.resume=auto", *OVERFLOW], log_path)
    try:
        line = _wait_for_line(proc, log_path, r"mcore_rl: step \d+: the actor's")
        t0 = time.monotonic()
        port = _run_port(proc)
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        exit_s = _ended(proc, run_pids, t0)
        assert proc.returncode != 0 and not _of_run(port)
        text = log_path.read_text()
        assert len(re.findall(r"exitcode\s+:\s*1 \(pid", text)) == 2 and not _our_tracebacks(text), text[-4000:]
        assert len([la for la in text.splitlines() if "the actor's" in la and "not finite (loss" in la]) == 1, text
        assert ("step 3: the actor's loss and gradient norm are not finite (loss nan, gradient norm nan)" in line
                and "trainer.on_nonfinite=skip" in line and "actor.lr" in line), line
        assert line.endswith(f"Last checkpoint: {out / 'checkpoints' / 'step_0000002'} (trainer.resume=auto "
                             "continues from it)"), line
        assert exit_s <= STOP_BOUND_S, f"{exit_s:.1f} s to exit (bound {STOP_BOUND_S} s)"
        assert _latest(out).name == "step_0000002"
        assert not list((out / "checkpoints").glob("*.tmp"))
        assert (out / "metrics.jsonl").read_text() == before  # step 3 logged nothing
        record(case="a non-finite loss or gradient norm (trainer.on_nonfinite=stop, the default)",
               sees="once, from rank 0: 'step k: the actor's loss and gradient norm are not finite (loss nan, "
               "gradient norm nan); updates skipped, not applied: n of this step's. Lower actor.lr, ... or set "
               "trainer.on_nonfinite=skip ... Last checkpoint: ...'; status 1; the checkpoint is untouched",
               exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)


def test_nonfinite_updates_skipped_leave_the_weights(tiny_model, arith_data, tmp_path, record):
    """trainer.on_nonfinite=skip with rewards that overflow in every step: every update is skipped and counted,
    the run finishes, and the exported actor is the initial model, bit for bit (fp32 weights, nothing applied)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    t0 = time.monotonic()
    run_train(2, tiny_overrides(tiny_model, arith_data, str(out)) + [
        "trainer.total_steps=2", "trainer.on_nonfinite=skip", "actor.ppo_epochs=2", *OVERFLOW], timeout=600)
    took = time.monotonic() - t0
    rows = _whole_lines(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/nonfinite_updates"] == 2.0, r  # 2 epochs x 1 mini-batch, each skipped
        assert r["actor/nonfinite_loss"] is None and r["actor/nonfinite_grad_norm"] is None, r  # nan, as null
        assert "actor/grad_norm" not in r, r
    exported = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    initial = {}
    for f in sorted(Path(tiny_model).glob("*.safetensors")):
        initial.update(load_file(f))
    common = sorted(set(exported) & set(initial))
    assert len(common) >= len(initial) - 1, (sorted(initial), sorted(exported))  # a tied lm_head may be left out
    changed = [k for k in common if not (exported[k].float() == initial[k].float()).all()]
    assert not changed, f"skipped updates changed {changed}"
    record(case="a non-finite loss or gradient norm with trainer.on_nonfinite=skip",
           sees="the update is not applied; actor/nonfinite_updates counts it (actor/nonfinite_loss, "
           "actor/nonfinite_grad_norm: null); the run goes on", exit_s=f"none (the run finished in {took:.0f} s)",
           left=0)


# ---- a collective that never completes --------------------------------------------------------------------------

WATCHDOG_S = 30.0
"""Several times the longest phase of the tiny run on a loaded 2-core machine (a few seconds)."""


def _rank_of(p: psutil.Process) -> int:
    return int(p.environ()["RANK"])


def test_stopped_worker_ends_the_run_through_the_watchdog(tiny_model, arith_data, tmp_path, record):
    """Rank 1 stopped with SIGSTOP after a step: rank 0 waits in the next collective, and its watchdog stops it
    within parallel.watchdog_s (+ the poll and the children's grace) with a line naming rank 0, the phase and
    the step; rank 0's SGLang processes go with it; torchrun then ends the stopped rank (SIGKILL after its 30 s
    grace, since a stopped process cannot act on SIGTERM). Nothing is left."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + [
        "trainer.total_steps=100000", "trainer.export_hf=false", f"parallel.watchdog_s={WATCHDOG_S}"], log_path)
    stopped = None
    try:
        _wait_for_step(proc, out)
        port = _run_port(proc)
        workers = sorted(_workers(proc), key=_rank_of)
        rank0, stopped = workers
        rank0_tree = [rank0.pid, *(c.pid for c in rank0.children(recursive=True))]
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(stopped.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        bound = WATCHDOG_S + EXIT_BOUND_S
        _wait_until_gone(rank0_tree, bound + 30)
        exit_s = time.monotonic() - t0
        assert not _living(rank0_tree), f"rank 0 still alive {exit_s:.0f} s after rank 1 stopped"
        assert exit_s <= bound, f"rank 0 took {exit_s:.1f} s to stop (bound {bound} s)"
        line = _wait_for_line(proc, log_path, r"mcore_rl: rank 0: the .* phase", bound_s=1)
        assert re.search(r"rank 0: the (rollout|forward|update|weight sync|checkpoint|step end) phase of step \d+ "
                         r"has not finished after \d+ s \(parallel\.watchdog_s=30\)", line), line
        assert "Stopping worker" in line and "trainer.resume=auto" in line, line
        proc.wait(timeout=60)  # torchrun: SIGTERM to the workers, SIGKILL after 30 s to the stopped one
        _wait_until_gone(run_pids, EXIT_BOUND_S)
        assert proc.returncode != 0
        left = _living(run_pids) + [p for p in _of_run(port) if p not in run_pids]
        assert not left, left
        _whole_lines(out)
        record(case="a collective that never completes (one worker stopped with SIGSTOP)",
               sees="the rank left waiting, after parallel.watchdog_s: 'rank r: the <phase> phase of step k has not "
               "finished after N s (parallel.watchdog_s=...): a collective is waiting for a rank that does not "
               "answer ... Last checkpoint: ...'; status 1; torchrun ends the stopped rank 30 s later",
               exit_s=round(exit_s, 1), left=len(left))
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped.pid, sig)
                except ProcessLookupError:
                    pass
        _stop(proc)


# ---- kill -9 while a checkpoint is written ----------------------------------------------------------------------

def test_kill_during_checkpoint_save_resumes_from_the_last_complete(tiny_model, arith_data, tmp_path, record):
    """Every process of the run gets SIGKILL the moment a `step_N.tmp` folder appears (a save in progress, after
    one complete checkpoint): `latest` still names a complete checkpoint; resume=auto loads it, removes the partial
    folder and finishes the run with each step logged once."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    common = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.export_hf=false", "trainer.save_every=1"]
    proc = _launch(common + ["trainer.total_steps=100000"], log_path)
    ckpts = out / "checkpoints"
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not (ckpts / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.05)
        # the process tree is complete by now (workers and engines started before the first save); listing it
        # takes milliseconds, which a tiny model's save (about 0.1 s) cannot spare once its folder appears
        port = _run_port(proc)
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        partial = []
        while not partial:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            partial = list(ckpts.glob("step_*.tmp"))
            time.sleep(0.001)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        proc.wait(timeout=30)
        _wait_until_gone(tree, EXIT_BOUND_S)
        exit_s = time.monotonic() - t0
        left = _living(tree) + [p for p in _of_run(port) if p not in tree]
        assert not left, left
    finally:
        _stop(proc)
    saved = _latest(out)
    assert partial[0].exists() and partial[0].name > saved.name, (partial, saved)  # the save was cut short
    rows = _whole_lines(out)
    target = int(saved.name.split("_")[1]) + 2
    proc = run_train(2, common + [f"trainer.total_steps={target}", "trainer.resume=auto"], timeout=600)
    text = proc.stdout + proc.stderr
    assert f"resumed from {saved} at step {int(saved.name.split('_')[1])}" in text, text[-3000:]
    assert f"removed {partial[0]}: a checkpoint whose save did not finish" in text, text[-3000:]
    assert not list(ckpts.glob("*.tmp"))
    assert [r["step"] for r in _whole_lines(out)] == list(range(1, target + 1)), rows
    assert _latest(out).name == f"step_{target:07d}"
    record(case="kill -9 of every process of the run while a checkpoint is written",
           sees="nothing at once; resume=auto: 'removed .../step_N.tmp: a checkpoint whose save did not finish', "
           "'resumed from <the last complete checkpoint>'", exit_s=round(exit_s, 1), left=len(left))


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_ctrl_c_mid_phase_stops_cleanly(phase, tiny_model, arith_data, tmp_path, record):
    """SIGINT to the launch's process group (what a terminal's Ctrl-C sends; torchrun passes it on to every
    worker's process group), aimed a third into step 4's rollout or the middle of its update from step 2's
    timings: rank 0 says once where it was interrupted and which checkpoint to continue from; every process of
    the run is gone, nothing is half-written (no step_N.tmp, metrics.jsonl ends with a whole line, no step 4
    row), and the engine, the process groups and the logger were closed (no traceback from the trainer)."""
    out, log_path = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + [
        "trainer.export_hf=false", "trainer.save_every=2", "trainer.total_steps=100000", *SLOW_STEP], log_path)
    try:
        _sleep_into_step_4(proc, out, phase)
        port = _run_port(proc)
        run_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        exit_s = _ended(proc, run_pids, t0)
        assert not _of_run(port)
        text = log_path.read_text()
        assert proc.returncode != 0
        lines = [line for line in text.splitlines() if "mcore_rl: interrupted in step" in line]
        assert len(lines) == 1, text[-4000:]
        landed = re.search(r"interrupted in step 4 \((\w[\w ]*)\)", lines[0])
        assert landed and landed[1] in ("rollout", "forward", "update", "weight sync"), lines[0]
        if landed[1] != phase:  # aimed from step 2's timings; a loaded machine can shift a step's phases
            warnings.warn(f"Ctrl-C aimed mid-{phase} landed in the {landed[1]} phase")
        assert f"Last checkpoint: {out / 'checkpoints' / 'step_0000002'}; continue with trainer.resume=auto" \
            in lines[0], lines[0]
        assert not _our_tracebacks(text) and "KeyboardInterrupt" not in text, text[-4000:]  # SGLang's neither
        assert exit_s <= STOP_BOUND_S, f"{exit_s:.1f} s to exit (bound {STOP_BOUND_S} s)"
        assert [r["step"] for r in _whole_lines(out)] == [1, 2, 3]
        assert not list((out / "checkpoints").glob("*.tmp")) and _latest(out).name == "step_0000002"
        record(case=f"Ctrl-C (SIGINT to the launch's process group) mid-{phase}",
               sees="once, from rank 0: 'interrupted in step k (<phase>). Last checkpoint: ...; continue with "
               f"trainer.resume=auto' (landed in: {landed[1]}); torchrun exits non-zero", exit_s=round(exit_s, 1),
               left=len(_living(run_pids)))
    finally:
        _stop(proc)
