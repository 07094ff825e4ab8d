"""HF checkpoint folders on disk: reading safetensors (one file or shards with an index), writing them the way
`transformers.save_pretrained` does, and copying the config / tokenizer files that travel with the weights.

Writing follows transformers' layout: one `model.safetensors` when everything fits in one shard, otherwise
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` (its weight_map and total_size). Files carry
the same metadata ({"format": "pt"}), so a round trip of a single-file checkpoint reproduces its bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files in an HF folder that hold weights: never copied beside converted weights.
WEIGHT_PATTERNS = (r".*\.safetensors$", r".*\.safetensors\.index\.json$", r".*\.bin$", r".*\.bin\.index\.json$",
                   r".*\.pt$", r".*\.pth$", r".*\.gguf$", r".*\.msgpack$", r".*\.h5$", r".*\.ckpt$")

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes from 5GB / 500MB / 2GiB / 1048576 (decimal units as transformers reads them, binary with 'i')."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"cannot read size {size!r}; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def check_safetensors(path: str | os.PathLike) -> None:
    """A ValueError naming the file when it is not the size its header says (a download or a write that was cut
    short) or its header does not parse; safetensors itself says only "incomplete metadata". Reads the header
    only, so it does not see corrupt bytes inside the tensors."""
    size = os.path.getsize(path)
    what = f"{path} is truncated or corrupt"
    todo = "re-download or re-export it"
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little")
        if len(head) < 8 or 8 + header_len > size:
            raise ValueError(f"{what}: it has {size} bytes, less than its header needs "
                             f"({8 + header_len if len(head) == 8 else 8}); {todo}")
        try:
            header = json.loads(f.read(header_len))
            data_len = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"{what}: its header is not a safetensors header ({type(e).__name__}: {e}); "
                             f"{todo}") from None
    if 8 + header_len + data_len != size:
        raise ValueError(f"{what}: header says {8 + header_len + data_len} bytes, file has {size}; {todo}")


def weight_files(hf_dir: str | os.PathLike) -> dict[str, str]:
    """HF name -> file (absolute path) of every tensor in the folder's safetensors. Every file is checked against
    its header first (check_safetensors), and every shard the index lists must be there."""
    root = Path(hf_dir)
    index = root / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({v for v in weight_map.values() if not (root / v).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that are not there: {missing}; the download or "
                                    "export is incomplete: re-download or re-export them")
        for file in sorted(set(weight_map.values())):
            check_safetensors(root / file)
        return {name: str(root / file) for name, file in weight_map.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        check_safetensors(single)
        with safe_open(str(single), "pt") as f:
            return {name: str(single) for name in f.keys()}
    files = sorted(root.glob("*.safetensors"))
    if len(files) == 0:
        raise FileNotFoundError(
            f"no safetensors weights in {str(root)!r} (looked for {SINGLE_FILE} and {INDEX_FILE}); "
            "convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True) first"
        )
    raise FileNotFoundError(f"{str(root)!r} has safetensors files {[p.name for p in files]} but no {INDEX_FILE}")


class SafetensorsReader:
    """Open every shard of an HF folder once; `slice(name)` is a lazy safetensors slice (read only what's indexed).

        with SafetensorsReader(hf_dir) as reader:
            reader.shape("model.norm.weight"); reader.slice("lm_head.weight")[0:128]
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = str(hf_dir)
        self.files = weight_files(hf_dir)
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self._handles.clear()
        return False

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(file, "pt"))
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.files)

    def slice(self, name: str):
        return self._handle(self.files[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self.slice(name).get_dtype()
        if code not in ST_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {code}; supported: {sorted(ST_DTYPES)}")
        return ST_DTYPES[code]

    def file_of(self, name: str) -> str:
        return os.path.basename(self.files[name])


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of (name, bytes) in order into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []


class ShardedWriter:
    """Write tensors into the planned shard files as they arrive; a shard is written as soon as it is complete,
    so the writer holds at most one shard of tensors. `close()` writes the index (with more than one shard).
    """

    def __init__(self, out_dir: str | os.PathLike, sizes: list[tuple[str, int]], max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(sizes, max_shard_bytes)
        n = len(self.shards)
        self.file_names = [SINGLE_FILE] if n == 1 else [
            f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self._shard_of = {name: k for k, names in enumerate(self.shards) for name in names}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._sizes = dict(sizes)
        self.written: list[str] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._shard_of:
            raise KeyError(f"tensor {name!r} is not in the write plan")
        k = self._shard_of[name]
        # A private contiguous copy: safetensors refuses tensors sharing storage (ours are views of a bucket).
        self._pending.setdefault(k, {})[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if len(self._pending[k]) == len(self.shards[k]):
            from safetensors.torch import save_file

            save_file(self._pending.pop(k), str(self.out_dir / self.file_names[k]), metadata={"format": "pt"})
            self.written.append(self.file_names[k])

    def close(self) -> None:
        if self._pending or len(self.written) != len(self.shards):
            missing = [n for k, names in enumerate(self.shards) if self.file_names[k] not in self.written
                       for n in names if n not in self._pending.get(k, {})]
            raise RuntimeError(f"incomplete export: {len(missing)} tensors never arrived, e.g. {missing[:5]}")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(self._sizes.values())},
                     "weight_map": {n: self.file_names[k] for n, k in sorted(self._shard_of.items())}}
            with open(self.out_dir / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | None = None) -> list[str]:
    """Copy config, generation config, tokenizer and other non-weight top-level files from src to dst.

    With `dtype`, config.json's dtype field (`dtype`, or `torch_dtype` in older files) is set to it when it
    differs; otherwise config.json is copied byte for byte.
    """
    src, dst = Path(src), Path(dst)
    copied = []
    for path in sorted(src.iterdir()):
        if not path.is_file() or any(re.match(p, path.name) for p in WEIGHT_PATTERNS):
            continue
        if path.name == "config.json" and dtype is not None:
            with open(path) as f:
                cfg = json.load(f)
            name = HF_DTYPE_NAMES[dtype]
            keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
            if any(cfg.get(k) != name for k in keys):
                for k in keys:
                    cfg[k] = name
                with open(dst / path.name, "w") as f:
                    json.dump(cfg, f, indent=2, sort_keys=True)
                    f.write("\n")
                copied.append(path.name)
                continue
        shutil.copy2(path, dst / path.name)
        copied.append(path.name)
    return copied
