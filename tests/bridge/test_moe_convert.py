"""tools/convert_hf.py with a mixture-of-experts model: HF -> Megatron dist checkpoint at EP2 -> HF at EP2 and at EP1
reproduces the original files byte for byte (the experts of each expert-parallel rank are gathered on rank 0 by
the export; the checkpoint reshards between EP sizes). Three torchrun launches. The layout's user errors are checked
in-process (tests/models/test_moe_config.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_hf.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    from mcore_rl.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("moe_hf") / "mixtral", "mixtral", seed=3)


def test_to_mcore_ep2_then_to_hf_at_ep2_and_ep1_is_bit_exact(mixtral_dir, torchrun, tmp_path):
    ckpt = tmp_path / "ckpt"
    torchrun(TOOL, 2, ["to-mcore", "--hf-dir", mixtral_dir, "--out", ckpt, "--ep", 2, "--no-progress"])
    meta = json.loads((ckpt / "mcore_rl.json").read_text())
    assert meta["saved_ep"] == 2 and meta["architecture"] == "MixtralForCausalLM"
    for nproc, ep in ((2, 2), (1, 1)):
        out = tmp_path / f"hf_ep{ep}"
        torchrun(TOOL, nproc, ["to-hf", "--ckpt", ckpt, "--out", out, "--ep", ep, "--no-progress"])
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in mixtral_dir.iterdir())
        for f in mixtral_dir.iterdir():
            assert (out / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs after to-hf at EP{ep}"

