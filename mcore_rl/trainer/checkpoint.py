"""Run checkpoints: folders `output_dir/checkpoints/step_NNNNNNN/`, a `latest` marker, and retention.

A checkpoint holds the actor and critic (model, optimizer, scheduler: Megatron dist checkpoints written by the
engine), each rank's RNG states, and `state.json` (step, data position, KL controller, config). It is written
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
            f"{f} is missing: the checkpoint was written by fewer ranks; resume with the same number of processes"
        )
    return torch.load(f, weights_only=False)


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


def read_state(path: Path) -> dict:
    with open(path / "state.json") as f:
        return json.load(f)


