"""User reward functions named by a dotted path.

A path is "package.module:function", "package.module.function", or "path/to/file.py:function". The function
is called once per sample as

    fn(prompt_text: str, response_text: str, meta: dict) -> float

where prompt_text is the templated prompt the policy saw, response_text the decoded response, and meta the
dataset fields of the row (meta["answer"], extra meta_keys, meta["messages"]). It may raise; the
RewardManager turns an exception into the fallback reward and counts it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

UserRewardFn = Callable[[str, str, dict[str, Any]], float]


def load_function(path: str) -> UserRewardFn:
    """Import and return the callable at `path`; ValueError saying what failed if it cannot."""
    module_name, attr = _split(path)
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # anything the imported module raises at import time
        raise ValueError(f"reward function {path!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {path!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable (it is a {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("prompt", "response", {})
    except TypeError as e:
        raise ValueError(f"reward function {path!r} must accept (prompt_text, response_text, meta): {e}") from None
    except ValueError:
        pass  # builtins without an inspectable signature: trust them
    return fn


def _split(path: str) -> tuple[str, str]:
    if ":" in path:
        module_name, _, attr = path.rpartition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"reward function path {path!r} must look like 'package.module:function', 'package.module.function' "
            "or 'path/to/file.py:function'"
        )
    return module_name, attr


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise FileNotFoundError(f"no such file {file}")
    name = f"mcore_rl_user_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module
