"""The console of a real run (tiny model, 2 processes, 2 steps) at logger.level=info and verbose: at info one line
per step and none of the libraries' warnings, import notes or argument dumps; at verbose they are back. The
filters themselves: tests/test_console.py."""

import re

import pytest

from tests.trainer.conftest import run_train, tiny_overrides

NOISE = re.compile(r"Warning\b|warn\(|warnings\.warn|\bWARNING\b|Ignore import error|ServerArgs\(|"
                   r"Params for bucket|Setting up DistributedDataParallel|Using custom SIGQUIT handler")


@pytest.mark.slow
def test_default_console_is_one_line_per_step(tiny_model, arith_data, tmp_path):
    proc = run_train(2, tiny_overrides(tiny_model, arith_data, str(tmp_path / "out")) + ["trainer.total_steps=2"])
    lines = (proc.stdout + proc.stderr).splitlines()
    noisy = [line for line in lines if NOISE.search(line)]
    assert not noisy, "\n".join(noisy)
    steps = [line for line in lines if re.search(r"mcore_rl: step \d+ \| reward", line)]
    assert [re.search(r"step (\d+)", s).group(1) for s in steps] == ["1", "2"]
    assert any("saved checkpoint" in line for line in lines)
    assert len(lines) < 20, "\n".join(lines)  # 142 lines before logger.level existed


@pytest.mark.slow
def test_verbose_console_shows_the_libraries(tiny_model, arith_data, tmp_path):
    proc = run_train(1, tiny_overrides(tiny_model, arith_data, str(tmp_path / "out"))
                     + ["trainer.total_steps=1", "logger.level=verbose"])
    out = proc.stdout + proc.stderr
    assert "UserWarning" in out  # Megatron's and SGLang's Python warnings
    assert "Ignore import error when loading sglang.srt.models" in out  # SGLang's child processes, at info
    assert "server_args=ServerArgs(" in out
    assert re.search(r"mcore_rl: step 1 \| reward", out)
