"""One cuDNN per process, for Transformer Engine.

Transformer Engine loads cuDNN itself when it is imported, by full path, searching CUDNN_HOME, CUDNN_PATH,
CUDA_HOME, CUDA_PATH and /usr/local/cuda before the library path. On an image whose CUDA toolkit carries a cuDNN
of its own (the lent H100's has 9.14 beside torch's pip cuDNN 9.19) it loads that second copy; the sublibraries it
then asks for resolve to torch's already loaded ones, and every fused attention fails with
CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED: TE quietly falls back to its unfused attention, which is slow and stores
the whole score matrix (an out-of-memory at 8k tokens a micro batch on an 80 GB GPU).

`align_cudnn_for_te()` points CUDNN_PATH at the folder of the cuDNN torch uses, before anything imports TE, so that
both load the same library. It does nothing where TE is not installed, where TE is already imported, where the
user set CUDNN_HOME or CUDNN_PATH, or off Linux.
"""

from __future__ import annotations

import importlib.util
import os
import sys

CUDNN = "libcudnn.so.9"


def loaded_library(maps: str, name: str) -> str | None:
    """The path of the shared library `name` in a /proc/<pid>/maps text, or None."""
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        if os.path.basename(path) == name or os.path.basename(path).startswith(name + "."):
            return path
    return None


def torch_cudnn_dir() -> str | None:
    """The folder of the cuDNN torch loaded (/proc/self/maps), else of the pip package nvidia-cudnn, else None."""
    import torch  # noqa: F401  (its CUDA library loads cuDNN)

    try:
        with open("/proc/self/maps") as f:
            path = loaded_library(f.read(), CUDNN)
    except OSError:
        path = None
    if path:
        return os.path.dirname(path)
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        if os.path.exists(os.path.join(root, "lib", CUDNN)):
            return os.path.join(root, "lib")
    return None


def align_cudnn_for_te() -> str | None:
    """Set CUDNN_PATH to torch's cuDNN folder where Transformer Engine will load one (see the module's docstring);
    returns the folder set, or None where nothing was done."""
    if not sys.platform.startswith("linux") or "transformer_engine" in sys.modules:
        return None
    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return None
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return None
    except (ImportError, ValueError):
        return None
    folder = torch_cudnn_dir()
    if folder:
        os.environ["CUDNN_PATH"] = folder
        _preload_sublibraries(folder)
    return folder


def _preload_sublibraries(folder: str) -> None:
    """Load cuDNN's sublibraries from `folder` now: cuDNN opens them by soname later, and the dynamic loader
    reuses a loaded library of that soname before it searches the library path (which may list another cuDNN)."""
    import ctypes
    import glob

    for lib in sorted(glob.glob(os.path.join(folder, "libcudnn_*.so.9"))):
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
