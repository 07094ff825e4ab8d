"""Checks of names a config refers to (registered estimators and losses, fixed choices), run when the config is
built, so a typo fails in seconds, before any process group or engine starts, with the close matches named."""

from __future__ import annotations

import difflib
from typing import Iterable


def check_choice(field: str, value: str, known: Iterable[str]) -> None:
    """ValueError naming `field`, the bad value, the nearest known names and all known names."""
    known = sorted(known)
    if value in known:
        return
    close = difflib.get_close_matches(str(value), known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ValueError(f"{field}={value!r} is not one of {', '.join(known)}{hint}")


def advantage_estimators() -> list[str]:
    from mcore_rl.algorithms import list_advantage_estimators

    return list_advantage_estimators()


def policy_losses() -> list[str]:
    from mcore_rl.algorithms import list_policy_losses

    return list_policy_losses()


def off_policy_corrections() -> list[str]:
    from mcore_rl.algorithms import list_corrections

    return list_corrections()


def kl_estimators() -> tuple[str, ...]:
    from mcore_rl.algorithms.kl import KL_ESTIMATORS

    return KL_ESTIMATORS
