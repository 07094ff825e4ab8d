"""Patches applied to a module right after its own code ran, in whichever process imports it: how the CPU
stand-in layer (sgl_kernel_stand_in.py, cpu_seeded_sampling.py) adjusts SGLang modules that refuse or break on a
machine without CUDA, including in the engine processes SGLang spawns (they import the stand-in first).

    patch_after_import("sglang.srt.layers.sampler", fn)   # fn(module) now if imported, else right after import
"""

from __future__ import annotations

import sys
from typing import Callable

_PATCHES: dict[str, list[Callable]] = {}


class _PatchAfterImport:
    """Import hook (sys.meta_path): loads a patched module as usual, then runs its patches on it."""

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for patch in _PATCHES[name]:
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_after_import(name: str, patch: Callable) -> None:
    """Run patch(module) on module `name`: now if it is imported, else right after its import. Idempotent for
    the same (name, patch)."""
    patches = _PATCHES.setdefault(name, [])
    if patch in patches:
        return
    patches.append(patch)
    if name in sys.modules:
        patch(sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
