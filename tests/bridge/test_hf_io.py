"""HF folders on disk: checkpoint validation errors, sharded writing, side files, and the CLI's user errors.

All in-process: no torch.distributed is started (every error here is raised before it would be).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.bridge.hf_io import INDEX_FILE, SafetensorsReader, ShardedWriter, copy_side_files, weight_files
from mcore_rl.bridge.load import check_hf_checkpoint
from mcore_rl.models.arch import load_hf_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from mcore_rl.testing import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("io") / "qwen2", arch="qwen2", tied=False, seed=3)


def edited_copy(src, dst, edit):
    """Copy an HF folder, letting `edit(state_dict)` change its weights."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def check(path, strict=True):
    with SafetensorsReader(path) as reader:
        check_hf_checkpoint(reader, load_hf_config(path), strict=strict)


def test_valid_checkpoint_passes(tiny_dir):
    check(tiny_dir)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    path = edited_copy(tiny_dir, tmp_path / "m", lambda sd: sd.pop("model.layers.2.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"has no tensor 'model\.layers\.2\.self_attn\.k_proj\.bias'"):
        check(path)


def test_wrong_shape_names_tensor_expected_and_got(tiny_dir, tmp_path):
    def edit(sd):
        sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)

    path = edited_copy(tiny_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError) as err:
        check(path)
    msg = str(err.value)
    assert "'model.layers.1.mlp.up_proj.weight'" in msg and "[100, 64]" in msg and "expected [128, 64]" in msg


def test_unexpected_tensor_errors_or_warns(tiny_dir, tmp_path):
    def edit(sd):
        sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)

    path = edited_copy(tiny_dir, tmp_path / "m", edit)
    unused = r"does not use: \['model\.layers\.0\.self_attn\.o_proj\.bias'\].*strict=False"
    with pytest.raises(ValueError, match=unused):
        check(path)
    with pytest.warns(UserWarning, match="o_proj.bias"):
        check(path, strict=False)


def test_tied_checkpoint_may_carry_lm_head_and_inv_freq(tmp_path):
    from mcore_rl.testing import make_tiny_hf_model

    src = make_tiny_hf_model(tmp_path / "src", arch="llama", tied=True)

    def edit(sd):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    path = edited_copy(src, tmp_path / "m", edit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        weight_files(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        weight_files(tmp_path)


def test_sharded_write_loads_in_transformers(tiny_dir, tmp_path):
    import transformers

    sd = load_file(str(tiny_dir / "model.safetensors"))
    sizes = [(n, t.numel() * t.element_size()) for n, t in sd.items()]
    writer = ShardedWriter(tmp_path, sizes, max_shard_bytes=200_000)
    for name, tensor in sd.items():
        writer.add(name, tensor)
    writer.close()
    copy_side_files(tiny_dir, tmp_path)
    assert len(writer.written) > 2 and (tmp_path / INDEX_FILE).is_file()
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(s for _, s in sizes)
    with SafetensorsReader(tmp_path) as reader:
        assert sorted(reader.names()) == sorted(sd)
    check(tmp_path)  # the loader's validation reads sharded folders through the index
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in sd.items())


def test_writer_refuses_to_finish_incomplete(tmp_path):
    writer = ShardedWriter(tmp_path, [("a", 4), ("b", 4)], max_shard_bytes=100)
    writer.add("a", torch.zeros(1))
    with pytest.raises(RuntimeError, match="1 tensors never arrived"):
        writer.close()


def test_side_files_skip_weights_and_rewrite_dtype(tiny_dir, tmp_path):
    (tmp_path / "same").mkdir()
    copied = copy_side_files(tiny_dir, tmp_path / "same", dtype=torch.float32)
    assert "model.safetensors" not in copied and "tokenizer.json" in copied and "config.json" in copied
    assert (tmp_path / "same" / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    (tmp_path / "bf16").mkdir()
    copy_side_files(tiny_dir, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


# ---- CLI user errors (raised before torch.distributed starts) ---------------------------------------------------
@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("convert_hf_tool", REPO / "tools" / "convert_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(cli, capsys, *argv):
    code = cli.main(list(map(str, argv)))
    return code, capsys.readouterr().err


def test_cli_unsupported_architecture(cli, capsys, tiny_dir, tmp_path):
    src = shutil.copytree(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (src / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(cli, capsys, "to-mcore", "--hf-dir", src, "--out", tmp_path / "out")
    assert code == 2
    assert "unsupported architecture (architectures=['GPT2LMHeadModel']" in err
    assert "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err
    assert not (tmp_path / "out").exists()


def test_cli_tp_not_dividing_heads(cli, capsys, tiny_dir, tmp_path):
    code, err = run_cli(cli, capsys, "to-mcore", "--hf-dir", tiny_dir, "--out", tmp_path / "out", "--tp", 3)
    assert code == 2
    assert "num_attention_heads (4) is not divisible by --tp (3); use a --tp that divides 4" in err
    assert list(tmp_path.iterdir()) == []


def test_cli_output_already_present(cli, capsys, tiny_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    code, err = run_cli(cli, capsys, "to-mcore", "--hf-dir", tiny_dir, "--out", tmp_path / "out")
    assert code == 2 and "already exists; pass --overwrite" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_cli_to_hf_needs_a_dist_checkpoint(cli, capsys, tiny_dir, tmp_path):
    code, err = run_cli(cli, capsys, "to-hf", "--ckpt", tiny_dir, "--out", tmp_path / "out")
    assert code == 2 and "is not a Megatron dist checkpoint (no metadata.json)" in err
