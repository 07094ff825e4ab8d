"""mcore_rl.cuda_libs: Transformer Engine is pointed at the cuDNN torch uses (on the H200, without it, TE loaded the
image's cuDNN 9.14 beside torch's 9.19 and lost its fused attention; with it, FusedAttention and one cuDNN:
docs/gpu.md). Here, without a GPU: the maps parsing, and the folder choice in fresh interpreters, with a
transformer_engine and an nvidia-cudnn folder laid out on the path as pip lays them out."""

import os
import subprocess
import sys
from pathlib import Path

from mcore_rl.cuda_libs import loaded_library

ROOT = Path(__file__).resolve().parents[1]

MAPS = """\
7f00-7f01 r-xp 00000000 00:2a 11 /opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so
7f02-7f03 r-xp 00000000 00:2a 12 /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn_graph.so.9
7f04-7f05 r-xp 00000000 00:2a 13 /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f06-7f07 rw-p 00000000 00:00 0
7f08-7f09 r-xp 00000000 00:2a 14 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0
"""


def test_loaded_library_finds_the_first_mapping_by_soname():
    pip_cudnn = "/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9"
    assert loaded_library(MAPS, "libcudnn.so.9") == pip_cudnn
    assert loaded_library(MAPS.splitlines()[-1], "libcudnn.so.9") == "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0"
    assert loaded_library(MAPS, "libcudnn_ops.so.9") is None  # not libcudnn_graph, not a prefix match
    assert loaded_library("", "libcudnn.so.9") is None


def _run(tmp_path: Path, env_extra: dict, layout: bool = True) -> str:
    site = tmp_path / "site"
    if layout:
        (site / "transformer_engine").mkdir(parents=True)
        (site / "transformer_engine" / "__init__.py").write_text("raise ImportError('not for import here')\n")
        (site / "nvidia" / "cudnn" / "lib").mkdir(parents=True)  # nvidia / nvidia.cudnn: namespace packages
        (site / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9").write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_PATH", "CUDNN_HOME")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]), **env_extra)
    code = "import os, mcore_rl; print(os.environ.get('CUDNN_PATH'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_cudnn_path_points_at_the_pip_cudnn_where_te_is_installed(tmp_path):
    # torch's CPU build here maps no cuDNN, so the pip package's folder is the one chosen
    assert _run(tmp_path, {}) == str(tmp_path / "site" / "nvidia" / "cudnn" / "lib")


def test_a_users_cudnn_setting_or_no_te_is_left_alone(tmp_path):
    assert _run(tmp_path / "a", {"CUDNN_HOME": "/somewhere"}) == "None"
    assert _run(tmp_path / "b", {"CUDNN_PATH": "/their/cudnn"}) == "/their/cudnn"
    assert _run(tmp_path / "c", {}, layout=False) == "None"
