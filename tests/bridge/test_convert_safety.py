"""tools/convert_hf.py against broken inputs and a busy output: a truncated or corrupt safetensors file and a shard the
index lists but the folder lacks are named (file and what is wrong) before anything is written; a second
conversion to an output another one is writing fails at once on every rank, naming the holder, and the first
finishes as if nothing happened. The input errors run in-process (raised before torch.distributed starts); the lock
test runs two real conversions under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from mcore_rl.bridge.hf_io import INDEX_FILE, SafetensorsReader, ShardedWriter, copy_side_files
from mcore_rl.net import free_port
from mcore_rl.procs import lock_path_beside

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_hf.py"


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("convert_hf_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    """A tiny qwen2 folder written as three or more shards with an index."""
    from mcore_rl.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("sharded")
    src = make_tiny_hf_model(root / "single", arch="qwen2", tied=False, seed=3)
    out = root / "sharded"
    out.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    writer = ShardedWriter(out, [(n, t.numel() * t.element_size()) for n, t in sd.items()], max_shard_bytes=200_000)
    for name, tensor in sd.items():
        writer.add(name, tensor)
    writer.close()
    copy_side_files(src, out)
    assert len(writer.written) > 2
    return out


def convert(cli, capsys, src, out) -> tuple[int, str]:
    code = cli.main(["to-mcore", "--hf-dir", str(src), "--out", str(out), "--no-progress"])
    return code, capsys.readouterr().err


def nothing_written(parent: Path, out: Path) -> bool:
    return not out.exists() and not [p for p in parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_truncated_shard_is_named_and_nothing_is_written(cli, capsys, sharded_dir, tmp_path):
    src = shutil.copytree(sharded_dir, tmp_path / "hf")
    shard = src / "model-00002-of-00003.safetensors"
    if not shard.exists():
        shard = min(src.glob("model-00002-of-*.safetensors"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)  # a download cut short
    code, err = convert(cli, capsys, src, tmp_path / "ckpt")
    assert code == 2, err
    assert (f"{shard} is truncated or corrupt: header says {size} bytes, file has {size - 1000}; re-download or "
            "re-export it") in err, err
    assert nothing_written(tmp_path, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=f"{shard.name} is truncated or corrupt"):  # the trainer's loader
        SafetensorsReader(src)


@pytest.mark.parametrize("content, what", [
    (b"\x10\x00", "it has 2 bytes, less than its header needs (8)"),
    (b"\xff" * 64, "it has 64 bytes, less than its header needs"),
    ((12).to_bytes(8, "little") + b"not json at!", "its header is not a safetensors header (JSONDecodeError"),
], ids=["two bytes", "garbage", "header not json"])
def test_corrupt_single_file_is_named(cli, capsys, sharded_dir, tmp_path, content, what):
    src = tmp_path / "hf"
    src.mkdir()
    copy_side_files(sharded_dir, src)
    (src / "model.safetensors").write_bytes(content)
    code, err = convert(cli, capsys, src, tmp_path / "ckpt")
    assert code == 2, err
    assert f"{src / 'model.safetensors'} is truncated or corrupt: {what}" in err, err
    assert "re-download or re-export it" in err and "incomplete metadata" not in err
    assert nothing_written(tmp_path, tmp_path / "ckpt")


def test_shard_missing_from_the_folder_is_named(cli, capsys, sharded_dir, tmp_path):
    src = shutil.copytree(sharded_dir, tmp_path / "hf")
    weight_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    gone = max(weight_map.values())
    (src / gone).unlink()
    code, err = convert(cli, capsys, src, tmp_path / "ckpt")
    assert code == 2, err
    assert f"{src / INDEX_FILE} lists shard files that are not there: ['{gone}']; the download or export is " \
           "incomplete" in err, err
    assert nothing_written(tmp_path, tmp_path / "ckpt")


# ---- one conversion per output ----------------------------------------------------------------------------------
def _torchrun(nproc: int, args: list, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(TOOL), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, start_new_session=True, **popen)


@pytest.mark.slow
def test_second_conversion_to_a_busy_output_is_refused(tiny_models, tmp_path):
    """The first conversion is frozen (SIGSTOP) while it holds the output's lock, with its temporary folder
    written; a second conversion (2 ranks) to the same output must fail at once on both ranks, naming the output
    and the holder. Resumed, the first finishes and its output is complete."""
    src, out = tiny_models[("qwen2", False)], tmp_path / "ckpt"
    first = _torchrun(1, ["to-mcore", "--hf-dir", src, "--out", out, "--no-progress"],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    frozen: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".ckpt.tmp-*")):  # made under the lock
            assert first.poll() is None, f"the first conversion ended early:\n{first.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "the first conversion did not start writing within 300 s"
            time.sleep(0.05)
        frozen = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
        for p in frozen:
            p.suspend()
        holder = json.loads(Path(lock_path_beside(out)).read_text())
        assert holder["what"] == "conversion" and holder["pid"] in [p.pid for p in frozen]

        t0 = time.monotonic()
        second = _torchrun(2, ["to-mcore", "--hf-dir", src, "--out", out, "--tp", 2, "--no-progress"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text = second.communicate(timeout=300)[0]
        took = time.monotonic() - t0
        assert second.returncode != 0, text[-3000:]
        lines = [ln for ln in text.splitlines() if f"{out} is in use by another conversion" in ln]
        assert len(lines) == 2, text[-3000:]  # each rank says it, neither waits
        assert any("[rank 0]" in ln for ln in lines) and any("[rank 1]" in ln for ln in lines)
        for part in (f"host {holder['host']}", f"pid {holder['pid']}", f"started {holder['started']}",
                     "Wait for it to finish or stop it", "another --out"):
            assert part in lines[0], lines[0]
        assert len(list(tmp_path.glob(".ckpt.tmp-*"))) == 1  # the second made no folder of its own
        print(f"second conversion refused after {took:.1f} s (torchrun start included)")
    finally:
        for p in frozen:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
    try:
        text = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, text[-3000:]
    assert (out / "metadata.json").is_file() and (out / "mcore_rl.json").is_file()
    assert not list(tmp_path.glob(".ckpt.tmp-*")) and not list(tmp_path.glob(".ckpt.old-*"))
