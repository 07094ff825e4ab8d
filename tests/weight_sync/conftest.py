"""Shared pieces of the weight-sync tests: the repository root and a tiny random Qwen2 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from mcore_rl.testing import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3))
