"""User code named by a path in a config: "package.module:attr", "package.module.attr" or "path/to/file.py:attr".
Reward functions (mcore_rl.rewards.function) and tools (mcore_rl.agent.tools) are loaded this way. Imports nothing
heavy, so the packages that use it stay fast to import."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(path: str, prefix: str, bad_path: str) -> Any:
    """The object `path` names. Any failure is a ValueError: `bad_path` when the path has no module part,
    else `prefix` followed by what failed (the import, with the module's own error, or a missing attribute)."""
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(bad_path)
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # anything the user's module raises at import time
        raise ValueError(f"{prefix}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{prefix}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise FileNotFoundError(f"no such file {file}")
    name = f"mcore_rl_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module
