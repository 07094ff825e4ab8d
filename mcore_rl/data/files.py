"""Reading dataset rows from jsonl, json and parquet files, with the file and row of every row kept for errors.

jsonl and json are parsed here with the standard `json` module rather than `datasets`' json loader: that loader
gives no line number for a broken line, and datasets 5.2 turns a column of mixed types (a prompt that is a string
in one row and a message list in another) into a `Json` feature that decodes the string "42" as the integer 42.
Since every line has to be parsed once anyway to find broken ones, the parsed rows are used directly. Parquet
files have a schema and are read through `datasets.load_dataset("parquet", ...)`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class RowLocation:
    """Where a row came from: `line` for jsonl (1-based line number), `row` for json and parquet (1-based)."""

    file: str
    number: int
    kind: str  # "line" | "row"

    def __str__(self) -> str:
        return f"{self.file}, {self.kind} {self.number}"


class BadRowError(ValueError):
    """A row that cannot be used; the message names the file, the row and what is wrong."""

    def __init__(self, location: RowLocation, problem: str):
        super().__init__(f"{location}: {problem}")
        self.location = location
        self.problem = problem


def resolve_files(paths: list[str]) -> list[Path]:
    """Expand folders into their data files (sorted, not recursive) and check that every path exists."""
    files: list[Path] = []
    for raw in paths:
        path = Path(os.path.expanduser(raw))
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise ValueError(f"folder {raw} holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"{raw}: unsupported file type {path.suffix!r}; use one of {SUFFIXES}")
            files.append(path)
        else:
            raise ValueError(f"data file or folder {raw} does not exist; check the data's train_files / val_files")
    return files


def files_for_split(train_files: list[str], val_files: list[str], split: str) -> list[str]:
    """The file list of a split ("train" or "val")."""
    if split == "train":
        return train_files
    if split == "val":
        if not val_files:
            raise ValueError("split='val' asked for, but val_files is empty")
        return val_files
    raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def iter_rows(path: Path, cache_dir: str | None = None) -> Iterator[tuple[RowLocation, dict[str, Any] | str]]:
    """Yield (location, row) for each row of `path`, or (location, problem) for a row that does not parse.

    Blank lines in jsonl are ignored (they count for line numbers but are not rows).
    """
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif path.suffix == ".json":
        yield from _iter_json(path)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path, cache_dir)
    else:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {SUFFIXES}")


def _iter_jsonl(path: Path) -> Iterator[tuple[RowLocation, dict[str, Any] | str]]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = RowLocation(str(path), line_no, "line")
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield where, f"invalid JSON ({e.msg} at column {e.pos + 1})"
                continue
            yield where, row if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"


def _iter_json(path: Path) -> Iterator[tuple[RowLocation, dict[str, Any] | str]]:
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            # A whole-document error: no row can be trusted, so this is never skippable.
            raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(rows, list):
        raise ValueError(
            f"{path}: a .json data file must hold a list of objects, got {type(rows).__name__}; "
            "for one object per line use .jsonl"
        )
    for i, row in enumerate(rows, start=1):
        where = RowLocation(str(path), i, "row")
        yield where, row if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"


def _iter_parquet(path: Path, cache_dir: str | None) -> Iterator[tuple[RowLocation, dict[str, Any] | str]]:
    import datasets

    table = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache_dir)
    for i, row in enumerate(table, start=1):
        yield RowLocation(str(path), i, "row"), row


class RowErrors:
    """Applies the on_bad_row policy: raise the first problem, or count problems and keep a few for the log."""

    def __init__(self, on_bad_row: str, max_examples: int = 5):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row ({on_bad_row!r}) must be 'error' or 'skip'")
        self.on_bad_row = on_bad_row
        self.max_examples = max_examples
        self.num_bad_rows = 0
        self.examples: list[str] = []

    def add(self, location: RowLocation, problem: str) -> None:
        error = BadRowError(location, problem)
        if self.on_bad_row == "error":
            raise BadRowError(location, f"{problem}; fix the row, or set on_bad_row=skip to skip bad rows")
        self.num_bad_rows += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(str(error))
            logger.warning("skipping bad row: %s", error)
