"""User reward functions named by a dotted path.

A path is "package.module:function", "package.module.function", or "path/to/file.py:function". The function
is called once per sample as

    fn(prompt_text: str, response_text: str, meta: dict) -> float

where prompt_text is the templated prompt the policy saw, response_text the decoded response, and meta the
dataset fields of the row (meta["answer"], extra meta_keys, meta["messages"]). It may raise; the
RewardManager turns an exception into the fallback reward and counts it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mcore_rl.user_code import load_object

UserRewardFn = Callable[[str, str, dict[str, Any]], float]


def load_function(path: str) -> UserRewardFn:
    """Import and return the callable at `path`; ValueError saying what failed if it cannot."""
    fn = load_object(path, f"reward function {path!r}",
                     f"reward function path {path!r} must look like 'package.module:function', "
                     "'package.module.function' or 'path/to/file.py:function'")
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable (it is a {type(fn).__name__})")
    try:
        inspect.signature(fn).bind("prompt", "response", {})
    except TypeError as e:
        raise ValueError(f"reward function {path!r} must accept (prompt_text, response_text, meta): {e}") from None
    except ValueError:
        pass  # builtins without an inspectable signature: trust them
    return fn

