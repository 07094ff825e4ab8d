"""Offline conversion HF <-> Megatron dist checkpoint at any TP / PP (the library behind tools/convert_hf.py).

    torchrun --nproc_per_node 2 tools/convert_hf.py to-mcore --hf-dir HF --out CKPT --tp 2
    torchrun --nproc_per_node 1 tools/convert_hf.py to-hf --ckpt CKPT --out HF2

A Megatron checkpoint written by `hf_to_mcore` is self-describing:
    CKPT/                 the torch_dist checkpoint ({"model": ...}; loads at any TP / PP)
    CKPT/hf/              config.json, generation config and tokenizer files of the source HF folder
    CKPT/mcore_rl.json    format, architecture, dtype and the layout it was saved at

Outputs are written atomically: into a temporary folder next to the target (`.NAME.tmp-XXXX`), renamed into place
once every rank has finished. On any error every rank removes that folder, so nothing partial remains. An
existing output is refused unless overwrite=True. The output must be on a filesystem every rank sees.

One conversion per output: rank 0 holds an OS file lock beside it (`NAME.lock`, mcore_rl/procs.py OutputLock)
from before the output is checked until it is in place; a second conversion to the same output fails at once,
on every rank, naming the holder. The lock file stays (harmless once its holder is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_rl.bridge.checkpoint import load_mcore_checkpoint, save_mcore_checkpoint
from mcore_rl.bridge.export import DEFAULT_BUCKET_BYTES, HFWeightExporter
from mcore_rl.bridge.hf_io import DTYPE_NAMES, SafetensorsReader, ShardedWriter, copy_side_files, parse_size
from mcore_rl.bridge.load import load_hf_weights
from mcore_rl.bridge.maps import EMBEDDING
from mcore_rl.parallel.runtime import barrier as _barrier
from mcore_rl.parallel.runtime import from_rank0
from mcore_rl.parallel.runtime import rank as _rank
from mcore_rl.procs import OutputLock, OutputLockedError

FORMAT = "mcore_rl.bridge/1"
META_FILE = "mcore_rl.json"
HF_SUBDIR = "hf"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_output(out: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} exists and is not a folder; remove it first")
    return out


def _mkdtemp(out: Path, tag: str) -> str:
    path = tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp makes 0700; the output gets the usual permissions
    return path


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder (the same on every rank) that becomes `out` when the block succeeds everywhere.

    Collective. Rank 0 holds the output's lock throughout; a held lock (OutputLockedError) or an existing output
    is raised on every rank. On an exception (or SIGTERM, which torchrun sends to the other workers when one
    fails) the temporary folder is removed by whichever rank gets there, and the exception propagates.
    """
    out = Path(out)
    lock = OutputLock.beside(out, what="conversion", elsewhere="another --out")
    tmp = None
    if _rank() == 0:
        try:
            lock.acquire()
            check_output(out, overwrite)  # again, under the lock: a conversion that held it may have finished
            tmp = _mkdtemp(out, "tmp")
        except (OutputLockedError, OSError) as e:  # every rank raises it (from_rank0)
            lock.release()
            tmp = e
    try:
        tmp = Path(from_rank0(tmp))
    except BaseException:
        lock.release()
        raise
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    if main_thread:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield tmp
        _barrier()
        if _rank() == 0:
            if out.exists():  # overwrite: move the old output aside first, so `out` is never half there
                trash = Path(_mkdtemp(out, "old"))
                os.replace(out, trash / out.name)
                os.replace(tmp, out)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, out)
        _barrier()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _setup(hf: dict, tp: int, pp: int, ep: int = 1):
    """Validate the layout against the model and the world, then start torch.distributed + Megatron."""
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.models.arch import resolve_arch
    from mcore_rl.models.builder import validate_layout
    from mcore_rl.parallel import env_world, initialize, validate

    resolve_arch(hf)
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep)
    try:
        validate_layout(hf, parallel)  # the model's constraints first: they say which tp / pp can work at all
        validate(parallel, env_world()[1], hf)
    except ValueError as e:  # said in this tool's words: --tp, not the trainer's parallel.tp
        raise ValueError(str(e).replace("parallel.", "--")) from None
    initialize(parallel, hf)
    return parallel


def _build(hf: dict, hf_dir, dtype: str, parallel):
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.models import build_model

    return build_model(hf, ModelConfig(path=str(hf_dir), dtype=dtype), parallel).chunks


def hf_dtype(hf_dir: str | os.PathLike) -> str:
    """fp32 / bf16 / fp16: the dtype the checkpoint's embedding is stored in."""
    with SafetensorsReader(hf_dir) as reader:
        name = EMBEDDING.hf[0] if EMBEDDING.hf[0] in reader.files else reader.names()[0]
        dtype = reader.dtype(name)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{hf_dir}: weights are {dtype}; pass dtype= one of {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def hf_to_mcore(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1,
                dtype: str | None = None, overwrite: bool = False, strict: bool = True,
                progress: bool = True, ep: int = 1) -> Path:
    """HF folder -> self-describing Megatron dist checkpoint at `out`. Run under torchrun with tp*pp*dp ranks
    (ep: expert parallelism of a mixture-of-experts model; the world must also be a multiple of tp*ep*pp).

    dtype: fp32 / bf16 / fp16 of the saved weights (None: the HF weights' dtype). strict: tensors the map does not
    use are an error (else a warning).
    """
    from mcore_rl.models.arch import load_hf_config, resolve_arch

    _check_dtype(dtype)
    hf = load_hf_config(hf_dir)
    resolve_arch(hf)
    check_output(out, overwrite)
    dtype = dtype or hf_dtype(hf_dir)
    parallel = _setup(hf, tp, pp, ep)
    with atomic_output_dir(out, overwrite) as tmp:
        chunks = _build(hf, hf_dir, dtype, parallel)
        load_hf_weights(chunks, hf_dir, hf, strict=strict, progress=progress and _rank() == 0)
        save_mcore_checkpoint(chunks, tmp)
        if _rank() == 0:
            (tmp / HF_SUBDIR).mkdir()
            copy_side_files(hf_dir, tmp / HF_SUBDIR)
            meta = {"format": FORMAT, "architecture": resolve_arch(hf).hf_class, "dtype": dtype,
                    "saved_tp": tp, "saved_pp": pp, "saved_ep": ep, "source": str(Path(hf_dir).resolve())}
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=2)
                f.write("\n")
    return Path(out)


def mcore_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, hf_dir: str | os.PathLike | None = None,
                tp: int = 1, pp: int = 1, dtype: str | None = None, max_shard_size: str | int = "5GB",
                overwrite: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES, progress: bool = True,
                ep: int = 1) -> Path:
    """Megatron dist checkpoint -> HF folder (safetensors, config, tokenizer) at `out`, loaded at tp x pp (x ep
    for a mixture-of-experts model; any layout loads a checkpoint saved at any other).

    hf_dir: where config and tokenizer files come from (None: CKPT/hf written by hf_to_mcore). dtype: of the
    written weights (None: the checkpoint's). Rank 0 writes; memory on rank 0 is one shard plus one bucket.
    """
    from mcore_rl.models.arch import load_hf_config, resolve_arch

    _check_dtype(dtype)
    ckpt = Path(ckpt)
    if not (ckpt / "metadata.json").is_file():
        raise FileNotFoundError(f"{str(ckpt)!r} is not a Megatron dist checkpoint (no metadata.json)")
    meta = json.loads((ckpt / META_FILE).read_text()) if (ckpt / META_FILE).is_file() else {}
    if hf_dir is None:
        hf_dir = ckpt / HF_SUBDIR
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"{str(ckpt)!r} has no {HF_SUBDIR}/config.json; pass --hf-dir with the HF "
                                    "config and tokenizer of the model")
    hf = load_hf_config(hf_dir)
    resolve_arch(hf)
    max_shard_bytes = parse_size(max_shard_size)
    check_output(out, overwrite)
    stored = meta.get("dtype") or _config_dtype(hf)
    out_dtype = DTYPES[dtype or stored]
    parallel = _setup(hf, tp, pp, ep)
    with atomic_output_dir(out, overwrite) as tmp:
        chunks = _build(hf, hf_dir, stored, parallel)
        load_mcore_checkpoint(chunks, ckpt)
        exporter = HFWeightExporter(chunks, hf, bucket_bytes=bucket_bytes, destination=0, dtype=out_dtype)
        write_hf_files(exporter, tmp, hf_dir, max_shard_bytes, config_dtype=out_dtype if dtype else None,
                       progress=progress)
    return Path(out)


def write_hf_files(exporter: HFWeightExporter, out_dir: str | os.PathLike, side_files_from: str | os.PathLike,
                   max_shard_bytes: int = 5 * 10**9, config_dtype: torch.dtype | None = None,
                   progress: bool = False) -> int:
    """Collective: stream the exporter's buckets into safetensors shards in the existing folder out_dir, and copy
    config / tokenizer files from side_files_from (config.json's dtype set to config_dtype when given).

    The exporter's destination rank writes (it must be the one rank that receives buckets, e.g. destination=0);
    it holds at most one shard plus one bucket. Returns the bytes written there (0 elsewhere). Wrap it in
    atomic_output_dir for an all-or-nothing folder.
    """
    if exporter.destination == "all":
        raise ValueError("write_hf_files needs an exporter with one destination rank (e.g. destination=0)")
    names = exporter.hf_names()  # builds the plan: collective
    writer = None
    if dist.get_rank() == exporter.destination:
        writer = ShardedWriter(out_dir, [(n, _numel(s) * _itemsize(d)) for n, s, d in names], max_shard_bytes)
    buckets = exporter
    if progress and writer is not None:
        from tqdm import tqdm

        buckets = tqdm(exporter, total=len(exporter.plan()), desc="exporting HF weights", unit="bucket")
    total = 0
    for bucket in buckets:
        if bucket is not None and writer is not None:
            for name, tensor in bucket:
                writer.add(name, tensor)
                total += tensor.numel() * tensor.element_size()
    if writer is not None:
        writer.close()
        copy_side_files(side_files_from, out_dir, dtype=config_dtype)
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _config_dtype(hf: dict) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(name), "fp32")
