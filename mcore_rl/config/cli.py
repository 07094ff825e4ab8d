"""Command-line overrides checked against the config schema before Hydra composes anything, so that a typo or a
value of the wrong type is one line naming the key, the closest field and what is valid (Hydra's own message
for an unknown key suggests appending it with `+`, which the schema then refuses).

    check_overrides(["trainer.totl_steps=3"])
    # ValueError: unknown config key 'trainer.totl_steps': trainer has no field 'totl_steps'; did you mean
    #   trainer.total_steps? Its fields: ...
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing

SCALARS = {int: "an integer", float: "a number", bool: "true or false"}


def check_overrides(argv: list[str]) -> None:
    """Raise ValueError for a `key=value` override whose key is not a field of the schema (root.RLConfig), or
    whose value cannot be an int / float / bool where the field is one. Group choices (`experiment=...`), `+` / `~`
    overrides, `hydra.*` keys and keys inside lists or dicts are left to Hydra."""
    from mcore_rl.config.root import RLConfig

    for arg in argv:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        parts = key.split(".")
        if len(parts) == 1 or parts[0] == "hydra":
            continue
        node = RLConfig
        for i, part in enumerate(parts):
            fields = {f.name for f in dataclasses.fields(node)}
            if part not in fields:
                where = ".".join(parts[:i]) or "the config"
                close = difflib.get_close_matches(part, fields, n=1)
                hint = f"did you mean {'.'.join([*parts[:i], close[0]])}? " if close else ""
                raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}; {hint}"
                                 f"its fields: {', '.join(sorted(fields))}")
            hint = _dataclass_or_scalar(typing.get_type_hints(node)[part])
            if hint is None:  # a list, dict or Any: Hydra checks what is inside
                break
            if hint in SCALARS:
                if i == len(parts) - 1 and not _fits(hint, value):
                    raise ValueError(f"config key {key!r} takes {SCALARS[hint]}, got {value!r}")
                break
            node = hint


def check_output_dir(argv: list[str]) -> None:
    """Raise ValueError if `trainer.output_dir=...` on the command line names a folder that cannot be made or
    written (under a file, on a read-only file system, without permission): Hydra would fail first, with a
    traceback, making its log folder in it. Nothing is created here."""
    import os

    given = [a.split("=", 1)[1] for a in argv if a.startswith("trainer.output_dir=")]
    if not given:
        return
    path = os.path.abspath(os.path.expanduser(given[-1]))
    probe = path
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    problem = None
    if not os.path.isdir(probe):
        problem = f"{probe} is not a folder"
    elif not os.access(probe, os.W_OK | os.X_OK):
        ro = os.statvfs(probe).f_flag & os.ST_RDONLY
        problem = f"{probe} is on a read-only file system" if ro else f"{probe} is not writable"
    if problem:
        raise ValueError(f"trainer.output_dir={given[-1]} cannot be created or written: {problem}; choose a folder "
                         "this run can create and write")


def _dataclass_or_scalar(hint):
    """The dataclass or int / float / bool a field holds (None allowed), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    if hint in SCALARS or dataclasses.is_dataclass(hint):
        return hint
    return None


def _fits(hint, value: str) -> bool:
    value = value.strip()
    if value.lower() in ("null", "none", "~") or "${" in value or "," in value or "(" in value:
        return True  # null, an interpolation, or a sweep (a,b / range(...)): Hydra's to check
    if hint is bool:
        return value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0")
    try:
        (int if hint is int else float)(value.replace("_", ""))
    except ValueError:
        return False
    return True
