"""Launch torchrun (gloo, CPU) jobs from pytest: a free port each, output shown on failure.

Worker scripts keep their code under `if __name__ == "__main__":` (dist-checkpoint saving re-imports them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mcore_rl.net import free_port

REPO = Path(__file__).resolve().parents[2]


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")  # 2-core machines: one thread per rank avoids oversubscription
    env["PYTHONWARNINGS"] = "ignore"
    return env


def torchrun_cmd(script: Path, nproc: int, args: list[str], port: int, nnodes: int = 1,
                 node_rank: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
            f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
            str(script), *map(str, args)]


def run_torchrun(script: Path, nproc: int, *args, timeout: float = 600) -> str:
    """Run one single-node torchrun job to completion; return its output, raise with it on failure."""
    cmd = torchrun_cmd(script, nproc, list(args), free_port())
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} {args} failed (rc {proc.returncode}):\n{out[-12000:]}")
    return out
