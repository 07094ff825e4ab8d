"""Engine and shared sync layouts vs the HF sync layout on the real SGLang engine (CPU, fp32): after the same perturbed
actor is synced each way (engine layout: buckets as flat buffers through our loader, and tensor by tensor through
SGLang's load_format="direct"; shared: the engine copies from the actor's own parameters, handed over once),
every engine parameter is bit-identical (each ends in one copy of the same fp32 values),
and the sync changed every parameter. Qwen2 with untied embeddings (vocab 512) and with tied embeddings and vocab 500,
whose embedding SGLang pads to 512 rows (zeros). Runs in a subprocess (Megatron + one engine per model, ~1 min).
Pure parts: tests/bridge/test_engine_layout.py (names, shapes), test_plan.py (choice, fallback, messages),
test_loaders.py (the name check, the flat packing).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.testing import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_engine_layout_equals_hf_layout(tmp_path):
    untied = make_tiny_hf_model(tmp_path / "untied", arch="qwen2", seed=0)
    tied = make_tiny_hf_model(tmp_path / "tied", arch="qwen2", tied=True, vocab_size=500, seed=1)
    worker = ROOT / "tests" / "weight_sync" / "sync_layout_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), str(untied), str(tied)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    results = json.loads((tmp_path / "result.json").read_text())
    for name, r in results.items():
        assert r["layouts"] == ["engine", "hf"], (name, r["layouts"])
        assert r["num_buckets"] > 3, name  # 64 KiB buckets: several calls, fused tensors across bucket cuts
        assert r["same_names"], (name, r["names"])
        assert not r["engine_unlike_hf"] and not r["direct_unlike_hf"], (name, r["engine_unlike_hf"],
                                                                          r["direct_unlike_hf"])  # name -> max |diff|
        assert r["unchanged_by_sync"] == [], (name, r["unchanged_by_sync"])  # not a no-op
        assert not r["reload_unrestored"], (name, r["reload_unrestored"])  # weight -> max |diff| after the reload
        # shared layout: bit-identical to the HF and engine layouts; in-place updates reach the engine with nothing
        # handed over again; a parameter whose storage moved is handed over again
        assert r["shared_layout"] == "shared", name
        assert r["shared_equals_hf"] and r["shared_in_place_equals_engine"], (name, r)
        assert r["shared_changed"] == [], (name, r["shared_changed"])
        assert r["shared_same_token"], name
        assert r["shared_after_move_equals_engine"] and r["shared_moved_token_changed"] and r["shared_norm_moved"], r
        # the shared sync flushes the prefix cache within its copy call; a sync without a flush serves stale KV
        assert r["flush_with_shared_sync"] and r["stale_without_flush"], (name, r)
        assert r["shared_after_reload_equals_engine"], name  # the engine reloaded from disk after the plan compiled
        assert r["shared_mapped_before_close"] > 0 and r["shared_mapped_after_close"] == 0, (name, r)
        assert r["shared_token_after_close"] is None, name
        assert r["version"] == 5, name  # engine, disk, hf, disk, engine (the refused bucket bumps nothing)
        assert "not engine parameters: model.layers.0.self_attn.q_proj.weight" in r["bad_name_error"], r
        assert r["alive_after_bad_name"], name
        assert "model.layers.3.self_attn.qkv_proj.weight" in r["names"]
        assert "model.layers.3.mlp.gate_up_proj.weight" in r["names"]
    assert "lm_head.weight" in results["untied"]["names"]
    assert "lm_head.weight" not in results["tied"]["names"]  # SGLang ties lm_head to embed_tokens
    assert results["untied"]["embed_shape"] == [512, 64]
    assert results["tied"]["embed_shape"] == [512, 64] and results["tied"]["embed_padding_zero"]
