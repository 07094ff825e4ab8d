"""Run checkpoints: folders `output_dir/checkpoints/step_NNNNNNN/`, a `latest` marker, and retention.

A checkpoint holds the actor and critic (model, optimizer, scheduler: Megatron dist checkpoints written by the
engine), each rank's RNG states, and `state.json` (step, data position, KL controller, world size and parallel
layout, config). A run resumes at another number of processes too (run.Run._load: the RNG states are then
not restored; the engine refuses a model-parallel change the optimizer format cannot follow). It is written
into `step_NNNNNNN.tmp` and renamed when every rank has finished, then `latest` is replaced atomically, so an
interrupted save never shadows the previous checkpoint. Older checkpoints beyond `keep_last` are deleted only
after the new one is complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from mcore_rl.parallel.runtime import barrier as _barrier
from mcore_rl.parallel.runtime import rank as _rank

LATEST = "latest"
FILE_ERRNOS = (2, 5, 13, 20, 21, 27, 28, 30, 122)
"""ENOENT EIO EACCES ENOTDIR EISDIR EFBIG ENOSPC EROFS EDQUOT: a write that failed for the file system's sake."""


def ckpt_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str, step: int) -> Path:
    return ckpt_root(output_dir) / f"step_{step:07d}"


def find_resume(output_dir: str, resume: str) -> Path | None:
    """The checkpoint folder to resume from, or None. resume: never | auto | a folder."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "state.json").is_file():
            raise FileNotFoundError(
                f"trainer.resume={resume!r} is not a checkpoint folder (no state.json); use auto, never, or a "
                f"folder under {ckpt_root(output_dir)}"
            )
        return path
    marker = ckpt_root(output_dir) / LATEST
    if not marker.is_file():
        return None
    path = ckpt_root(output_dir) / marker.read_text().strip()
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{marker} points to {path}, which is not a complete checkpoint")
    return path


def remove_partial(output_dir: str) -> list[Path]:
    """Delete the `step_N.tmp` folders (and a `latest.tmp`) of saves that never finished: a run killed while it
    saved. Only the holder of the output folder's lock may call it (no live run is writing them). Returns what
    was removed."""
    root = ckpt_root(output_dir)
    partial = sorted(root.glob("step_*.tmp")) + ([root / (LATEST + ".tmp")] if (root / (LATEST + ".tmp")).exists()
                                                 else [])
    for p in partial:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return partial


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def begin(output_dir: str, step: int) -> Path:
    """Create (on rank 0) and return the temporary folder every rank writes this checkpoint into."""
    tmp = step_dir(output_dir, step).with_suffix(".tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def write_rank_state(tmp: Path, extra: dict | None = None) -> None:
    torch.save({"rng": rng_state(), **(extra or {})}, tmp / f"rank_{_rank():05d}.pt")


def read_rank_state(path: Path) -> dict:
    f = path / f"rank_{_rank():05d}.pt"
    if not f.is_file():
        raise FileNotFoundError(
            f"{f} is missing: the checkpoint is damaged, or was written by fewer ranks before checkpoints recorded "
            f"their world size (2026-12-05); resume with the same number of processes, or from an earlier "
            f"checkpoint (trainer.resume=<folder>)"
        )
    try:
        return torch.load(f, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # a file cut short: torch's zip reader says so
        raise ValueError(f"{f} is truncated or corrupt ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                         "resume from an earlier checkpoint (trainer.resume=<folder>)") from None


def commit(output_dir: str, step: int, tmp: Path, state: dict, keep_last: int) -> Path:
    """All ranks call this after writing: rank 0 writes state.json, renames, moves `latest`, prunes."""
    _barrier()
    final = step_dir(output_dir, step)
    if _rank() == 0:
        with open(tmp / "state.json", "w") as f:
            json.dump(state, f, indent=1, default=str)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = ckpt_root(output_dir) / (LATEST + ".tmp")
        marker_tmp.write_text(final.name)
        os.replace(marker_tmp, ckpt_root(output_dir) / LATEST)
        done = sorted(p for p in ckpt_root(output_dir).glob("step_*") if p.is_dir() and p.suffix != ".tmp")
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def write_error(e: BaseException, folder: Path | None = None) -> OSError | None:
    """The OSError behind a failed write into `folder` (`e` itself, one in its chain, or one a writer process
    reported in a RuntimeError's text such as "Worker failure: [Errno 28] No space left on device"), or None.
    torch's zip writer loses the errno ("[enforce fail at inline_container.cc] unexpected pos"): a write that
    failed with less than 1 MiB left on `folder`'s file system is taken for a full disk."""
    import errno
    import re

    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FILE_ERRNOS:  # not a socket error: a launcher that died
            return seen
        m = re.search(r"\[Errno (\d+)\] ([^:'\"\n]+)", str(seen))
        if m and int(m.group(1)) in FILE_ERRNOS:  # not a peer's socket error in a collective
            code = int(m.group(1))
            return OSError(code, m.group(2).strip() or os.strerror(code))
        seen = seen.__cause__ or seen.__context__
    if folder is not None:
        probe = Path(folder)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if free < 1 << 20:
            return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free)")
    return None


def check_engine_files(folder: Path) -> None:
    """A Megatron dist checkpoint (an engine's part of a run checkpoint) against its own index: every file that
    torch's `.metadata` lists is there and as long as the bytes it lists in it; otherwise a ValueError naming the
    file, before anything loads (a file cut short otherwise ends in an EOFError deep in torch)."""
    import pickle

    earlier = "resume from an earlier checkpoint (trainer.resume=<folder>)"
    index = folder / ".metadata"
    for name in (index, folder / "common.pt"):
        if not name.is_file():
            raise FileNotFoundError(f"{name} is missing: the checkpoint {folder.parent} is incomplete; {earlier}")
    try:
        with open(index, "rb") as f:
            storage = pickle.load(f).storage_data.values()
    except Exception as e:  # cut short or not torch's index
        raise ValueError(f"{index} is truncated or corrupt ({type(e).__name__}: {e}); {earlier}") from None
    needs: dict[str, int] = {}
    for info in storage:
        needs[info.relative_path] = max(needs.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needs.items()):
        f = folder / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing, which {index} lists; {earlier}")
        if f.stat().st_size < end:
            raise ValueError(f"{f} is truncated: {index} lists {end} bytes in it, the file has {f.stat().st_size}; "
                             f"{earlier}")


def read_state(path: Path) -> dict:
    with open(path / "state.json") as f:
        return json.load(f)


