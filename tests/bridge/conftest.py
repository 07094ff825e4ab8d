"""Shared fixtures of the bridge tests: tiny HF models of every architecture and a torchrun launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.net import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
# Token ids of the parity checks: two sequences of 12, fixed.
SEQ_LEN, BATCH = 12, 2


def _run_torchrun(script: str | os.PathLike, nproc: int, args: list[str], timeout: int = 600,
                 check: bool = True) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` on gloo with a free port; fails the test with the output tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[3:])} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def torchrun():
    """run(script, nproc, args, timeout=600, check=True) -> CompletedProcess."""
    return _run_torchrun


def ref_path(model_dir: str | os.PathLike) -> Path:
    return Path(str(model_dir) + ".ref.pt")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """(arch, tied) -> tiny random HF model folder; transformers' fp32 logits on fixed tokens sit beside it in
    `<folder>.ref.pt` (ref_path)."""
    import torch
    import transformers

    from mcore_rl.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_hf")
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 500, (BATCH, SEQ_LEN), generator=g)
    out = {}
    for seed, arch in enumerate(ARCHS):
        for tied in (False, True):
            path = make_tiny_hf_model(root / f"{arch}_{'tied' if tied else 'untied'}", arch=arch, tied=tied,
                                      seed=seed)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            with torch.no_grad():
                logits = model(input_ids).logits
            torch.save({"input_ids": input_ids, "logits": logits}, ref_path(path))
            out[(arch, tied)] = path
    return out
