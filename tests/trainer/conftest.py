import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.net import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from mcore_rl.testing import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3))


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory):
    from mcore_rl.data.synthetic import make_arithmetic_rows, write_jsonl

    path = tmp_path_factory.mktemp("data") / "arith.jsonl"
    write_jsonl(make_arithmetic_rows(64, seed=0, max_digits=1, operators="+"), path)
    return str(path)


def run_train(nproc: int, overrides: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    """Launch tools/train_ppo.py under torchrun with the given Hydra overrides; fail with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(ROOT / "tools" / "train_ppo.py"), *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"training run failed (exit {proc.returncode}):\n{tail}")
    return proc


def read_metrics(out_dir) -> list[dict]:
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_overrides(model: str, data: str, out: str) -> list[str]:
    """A run small enough for CI: the tiny random model, 2 prompts x 4 samples, 12 new tokens, fp32."""
    return [f"model.path={model}", "model.dtype=fp32", "model.max_seq_len=256", f"data.train_files=[{data}]",
            f"trainer.output_dir={out}", "trainer.prompts_per_step=2", "algorithm.n_samples_per_prompt=4",
            "rollout.max_new_tokens=12", "rollout.max_total_tokens=4096", "rollout.show_progress=false",
            "actor.lr=1e-4", "logger.tensorboard=true",
            "reward.name=function", "reward.function_path=tests.trainer.reward_fns:text_length"]
