"""bridge.checkpoint.writers_die_with_saver: processes forked during a save (Megatron's filesystem writer forks
one per write bucket, through multiprocessing's fork context) die when the saving process is killed, instead of
writing on as orphans. A stand-in saver forks a "writer" that would sleep for two minutes, then gets SIGKILL;
the control, without the block, shows the writer outliving it."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

SAVER = textwrap.dedent("""
    import contextlib, multiprocessing, sys, time
    from mcore_rl.bridge.checkpoint import writers_die_with_saver

    def writer():
        time.sleep(120)

    if __name__ == "__main__":
        block = writers_die_with_saver() if sys.argv[1] == "on" else contextlib.nullcontext()
        with block:
            child = multiprocessing.get_context("fork").Process(target=writer)
            child.start()
            print(child.pid, flush=True)
            time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_saver(mode: str, tmp_path) -> int:
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    saver = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env)
    writer = int(saver.stdout.readline())
    assert _alive(writer)
    saver.send_signal(signal.SIGKILL)
    saver.wait(timeout=10)
    return writer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux only")
def test_writers_forked_during_a_save_die_with_the_saver(tmp_path):
    writer = _kill_saver("on", tmp_path)
    deadline = time.monotonic() + 5
    while _alive(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(writer), "the writer outlived the killed saver"


def test_without_it_the_writer_outlives_the_saver(tmp_path):
    writer = _kill_saver("off", tmp_path)
    try:
        time.sleep(1.0)
        assert _alive(writer)  # the orphan the block prevents
    finally:
        if _alive(writer):
            os.kill(writer, signal.SIGKILL)
