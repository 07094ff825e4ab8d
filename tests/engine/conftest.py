"""Fixtures for the engine's multi-process tests: the torchrun launcher and the tiny HF model folders."""

from pathlib import Path

import pytest

from mcore_rl.net import free_port
from tests.parallel import launcher

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Folder holding tiny_llama (untied) and tiny_qwen2 (tied) HF checkpoints (engine_cases.ARCHS)."""
    from tests.engine import engine_cases

    root = tmp_path_factory.mktemp("tiny_models")
    engine_cases.make_models(root)
    return root


@pytest.fixture(scope="session")
def torchrun():
    """torchrun(script_name, nproc, *args) -> output; the script lives in tests/engine/."""
    def run(script: str, nproc: int, *args, timeout: float = 600) -> str:
        return launcher.run_torchrun(HERE / script, nproc, *args, timeout=timeout)

    return run


@pytest.fixture(scope="session")
def torchrun_nodes():
    """torchrun_nodes(script_name, nnodes, *args) -> outputs: one single-process torchrun per "node", all on
    this machine, meeting at 127.0.0.1:<free port> (static rendezvous with --node_rank)."""
    import subprocess

    def run(script: str, nnodes: int, *args, timeout: float = 600) -> list[str]:
        port = free_port()
        procs = [
            subprocess.Popen(launcher.torchrun_cmd(HERE / script, 1, list(args), port, nnodes=nnodes,
                                                   node_rank=node_rank),
                             cwd=launcher.REPO, env=launcher.worker_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for node_rank in range(nnodes)
        ]
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for node_rank, (p, text) in enumerate(zip(procs, outputs)):
            if p.returncode != 0:
                raise AssertionError(f"{script} node {node_rank} failed (rc {p.returncode}):\n{text[-8000:]}")
        return outputs

    return run
