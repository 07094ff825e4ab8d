"""The rollout engine killed while an asynchronous run's producer is generating ahead (trainer.rollout_mode=
one_step_off_policy, trainer/async_rollout.py): the producer thread hands the engine's error to the step that
takes its batch, so every rank stops with rank 0's one line, within a bound, and no process of the run is left.
Real torchrun with 2 workers, real Megatron and SGLang on CPU."""

import time

import psutil
import pytest

from tests.reliability.test_crash_safety import _ended, _launch, _living, _stop, _wait_for_step
from tests.trainer.conftest import tiny_overrides

pytestmark = pytest.mark.slow


def test_engine_death_mid_queue_is_one_line_and_leaves_nothing(tiny_model, arith_data, tmp_path, record):
    out = tmp_path / "run"
    log_path = tmp_path / "run.log"
    proc = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + [
        "trainer.total_steps=100000", "trainer.export_hf=false", "trainer.rollout_mode=one_step_off_policy",
        # long generations: the producer is always mid-batch when the scheduler goes
        "rollout.max_new_tokens=160", "rollout.ignore_eos=true", "model.max_seq_len=512"], log_path)
    try:
        _wait_for_step(proc, out)
        tree = psutil.Process(proc.pid).children(recursive=True)
        run_pids = [c.pid for c in tree]
        scheduler = [c for c in tree if "sglang::scheduler" in " ".join(c.cmdline())]
        assert scheduler, [c.cmdline()[:2] for c in tree]
        scheduler[0].kill()
        t0 = time.monotonic()
        exit_s = _ended(proc, run_pids, t0)
        assert proc.returncode != 0
        text = log_path.read_text()
        lines = [line for line in text.splitlines() if "the rollout engine failed in step" in line]
        assert len(lines) == 1, text[-4000:]
        assert "Last checkpoint:" in lines[0] and "trainer.resume=auto" in lines[0]
        record(case="the SGLang scheduler killed while an asynchronous run generates ahead (one_step_off_policy)",
               sees="once, from rank 0: 'the rollout engine failed in step k: ... Last checkpoint: ...; continue "
               "with trainer.resume=auto'", exit_s=round(exit_s, 1), left=len(_living(run_pids)))
    finally:
        _stop(proc)
