"""The engine sync layout's pure parts: SGLang names and shapes per bridge entry, the name check's message, and
the layout choice with its fallback and error messages. The engine parity itself: tests/rollout/test_sync_layout.py.
"""

from __future__ import annotations

import pytest

from mcore_rl.bridge.engine_layout import engine_tensors, unsupported_reason
from mcore_rl.bridge.maps import Dims, expand
from mcore_rl.rollout.engine_params import check_names


def _hf(arch: str = "qwen2", tied: bool = False, vocab: int = 500, **extra) -> dict:
    model_type, cls = {"qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                       "llama": ("llama", "LlamaForCausalLM")}[arch]
    return {"architectures": [cls], "model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
            "num_hidden_layers": 2, "tie_word_embeddings": tied, **extra}


def _engine_table(hf: dict) -> dict[str, tuple[int, ...]]:
    dims = Dims.from_hf(hf)
    return dict(t for e in expand(hf) if e.export for t in engine_tensors(e, dims))


def test_qwen2_untied_engine_names_and_shapes():
    # Worked out from SGLang 0.5.17 models/qwen2.py: q 4 heads x 16 = 64 rows, k and v 2 x 16 = 32 rows each;
    # gate and up 96 rows each; vocab 500 padded to 512 (multiple of 64).
    table = _engine_table(_hf())
    assert table["model.embed_tokens.weight"] == (512, 64)
    assert table["lm_head.weight"] == (512, 64)
    assert table["model.layers.1.self_attn.qkv_proj.weight"] == (128, 64)
    assert table["model.layers.1.self_attn.qkv_proj.bias"] == (128,)
    assert table["model.layers.1.mlp.gate_up_proj.weight"] == (192, 64)
    assert table["model.layers.1.self_attn.o_proj.weight"] == (64, 64)
    assert table["model.layers.1.mlp.down_proj.weight"] == (64, 96)
    assert table["model.layers.1.input_layernorm.weight"] == (64,)
    assert table["model.norm.weight"] == (64,)
    assert not any(k in n for n in table for k in (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj."))
    assert len(table) == 2 + 2 * 7 + 1  # embed, lm_head; per layer 2 norms, qkv w+b, o, gate_up, down; norm


def test_tied_sends_no_lm_head_and_qwen3_keeps_qk_norms():
    tied = _engine_table(_hf(tied=True))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"] == (512, 64)
    q3 = _engine_table(_hf("qwen3", vocab=512))
    assert q3["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert q3["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert "model.layers.0.self_attn.qkv_proj.bias" not in q3  # qwen3 and llama: no q/k/v bias
    assert q3["model.embed_tokens.weight"] == (512, 64)  # already a multiple of 64: no padding


def test_unsupported_reasons():
    assert unsupported_reason(_hf()) is None
    assert "quantized (quantization_config.quant_method='gptq')" in unsupported_reason(
        _hf(quantization_config={"quant_method": "gptq"}))
    assert "unsupported architecture" in unsupported_reason({"architectures": ["GPT2LMHeadModel"]})


def test_check_names_message():
    engine = {"a.qkv_proj.weight": (8, 4), "b.weight": (4,), "c.weight": (2,)}
    check_names({"a.qkv_proj.weight": (8, 4), "b.weight": (4,), "c.weight": (2,)}, engine, "x")
    check_names({"b.weight": (4,)}, engine, "a bucket", complete=False)
    with pytest.raises(ValueError) as e:
        check_names({"a.q_proj.weight": (4, 4), "b.weight": (5,)}, engine, "the export")
    msg = str(e.value)
    assert "the export does not match the engine's parameters" in msg
    assert "not engine parameters: a.q_proj.weight" in msg
    assert "engine parameters not sent: a.qkv_proj.weight, c.weight" in msg
    assert "shape mismatches: b.weight (5,) vs the engine's (4,)" in msg
    assert "rollout.weight_sync_layout=hf" in msg


class _Rollout:
    def __init__(self, **cfg):
        from mcore_rl.config.rollout import RolloutConfig

        self.cfg = RolloutConfig(**cfg)

    def engine_layout_blocker(self):
        return self.cfg.engine_layout_blocker()


def test_choose_layout_auto_falls_back_with_one_log_line(caplog):
    import logging

    from mcore_rl.trainer.sync import choose_layout, layout_blockers, shared_blockers

    assert choose_layout("auto", layout_blockers("tensor", _hf(), _Rollout())) == "shared"
    assert choose_layout("auto", [], shared_blockers(1, 1)) == "shared"
    assert choose_layout("engine", [], []) == "engine"
    assert choose_layout("hf", []) == "hf"
    with caplog.at_level(logging.INFO, logger="mcore_rl.trainer.sync"):
        assert choose_layout("auto", [], shared_blockers(2, 1)) == "engine"
    assert [r.getMessage() for r in caplog.records] == [
        "weight sync: engine layout (buckets, not shared parameters), since the actor is split (parallel.tp=2, "
        "parallel.pp=1): rank 0 does not hold whole parameters for the engine to copy from"]
    caplog.clear()
    blockers = layout_blockers("tensor", _hf(), _Rollout(tp_size=2))
    with caplog.at_level(logging.INFO, logger="mcore_rl.trainer.sync"):
        assert choose_layout("auto", blockers) == "hf"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [("weight sync: HF layout (SGLang maps the names), since rollout.tp_size=2 (each engine rank "
                      "would need its own shard; needs 1)")]
    assert layout_blockers("distributed", _hf(quantization_config={"quant_method": "awq"}), _Rollout()) == [
        "trainer.weight_sync=distributed (the engine layout is for colocated tensor syncs)",
        "the checkpoint is quantized (quantization_config.quant_method='awq')"]


def test_forcing_engine_where_unsupported_says_what_to_change():
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.trainer.sync import choose_layout, layout_blockers, shared_blockers

    with pytest.raises(ValueError, match=r"rollout.weight_sync_layout=engine is not possible: the checkpoint is "
                                         r"quantized .*Set rollout.weight_sync_layout=auto \(falls back to hf\) or hf"):
        choose_layout("engine", layout_blockers("tensor", _hf(quantization_config={"quant_method": "awq"}),
                                                _Rollout()))
    with pytest.raises(ValueError, match=r"rollout.weight_sync_layout=engine is not possible here: "
                                         r"rollout.tp_size=2 .*Set rollout.weight_sync_layout=auto"):
        RolloutConfig(weight_sync_layout="engine", tp_size=2)
    with pytest.raises(ValueError, match="rollout.extra_args.quantization='fp8'"):
        RolloutConfig(weight_sync_layout="engine", extra_args={"quantization": "fp8"})
    with pytest.raises(ValueError, match="rollout.weight_sync_layout must be one of"):
        RolloutConfig(weight_sync_layout="direct")
    with pytest.raises(ValueError, match=r"rollout.weight_sync_layout=shared is not possible: the actor is split "
                                         r"\(parallel.tp=1, parallel.pp=2\).*Set rollout.weight_sync_layout=auto "
                                         r"\(falls back to engine or hf\) or hf"):
        choose_layout("shared", [], shared_blockers(1, 2))
    with pytest.raises(ValueError, match=r"rollout.weight_sync_layout=shared is not possible here: rollout.tp_size=2"):
        RolloutConfig(weight_sync_layout="shared", tp_size=2)


def test_pack_flat_sends_each_buffer_once_with_offsets():
    import json

    import torch

    from mcore_rl.rollout.engine_params import pack_flat

    a, b = torch.arange(10.0), torch.arange(6, dtype=torch.int32)
    named = [("x", a[0:6].view(2, 3)), ("y", a[6:10]), ("z", b[2:6].view(2, 2))]
    packed = pack_flat(named)
    assert [json.loads(spec) for spec, _ in packed] == [[["x", 0, [2, 3]], ["y", 6, [4]]], [["z", 2, [2, 2]]]]
    assert packed[0][1] is a and packed[1][1] is b
    assert pack_flat([("x", a.clone())]) is None  # not a view: sent tensor by tensor
    assert pack_flat([("x", a.view(2, 5)[:, :2])]) is None  # a non-contiguous view
