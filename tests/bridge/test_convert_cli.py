"""tools/convert_hf.py end to end: HF -> Megatron dist checkpoint at TP2 -> HF at TP1 reproduces the original files
byte for byte; a failing conversion leaves nothing behind. Three torchrun launches.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_hf.py"

pytestmark = pytest.mark.slow


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_to_mcore_tp2_then_to_hf_tp1_is_bit_exact(tiny_models, torchrun, tmp_path):
    import transformers

    src = tiny_models[("qwen2", False)]
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf2"
    torchrun(TOOL, 2, ["to-mcore", "--hf-dir", src, "--out", ckpt, "--tp", 2, "--no-progress"])
    meta = json.loads((ckpt / "mcore_rl.json").read_text())
    assert meta["saved_tp"] == 2 and meta["dtype"] == "fp32" and meta["architecture"] == "Qwen2ForCausalLM"
    assert (ckpt / "metadata.json").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()

    out.mkdir()
    (out / "stale.txt").write_text("replaced by --overwrite")
    torchrun(TOOL, 1, ["to-hf", "--ckpt", ckpt, "--out", out, "--overwrite"])  # config, tokenizer from CKPT/hf
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    for f in src.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs"
    assert leftovers(tmp_path) == []
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    original = load_file(str(src / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[n], t) for n, t in original.items())


def test_failed_conversion_leaves_nothing(tiny_models, torchrun, tmp_path):
    src = shutil.copytree(tiny_models[("llama", True)], tmp_path / "broken")
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.3.mlp.down_proj.weight"]
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "ckpt"
    proc = torchrun(TOOL, 2, ["to-mcore", "--hf-dir", src, "--out", out, "--tp", 2], check=False)
    assert proc.returncode != 0
    assert "has no tensor 'model.layers.3.mlp.down_proj.weight'" in proc.stderr
    assert not out.exists()
    assert leftovers(tmp_path) == []
