"""Model-only Megatron dist checkpoints (torch_dist): saved at one TP / PP layout, loadable at any other.

The state dict follows Megatron-LM: {"model": chunk.sharded_state_dict()} for one chunk, {"model0": ..,
"model1": ..} with virtual pipeline stages. Sharded tensor keys carry global layer numbers, so the dict keys do
not tie the checkpoint to a layout. Local and Transformer Engine layer specs map to the same keys (Megatron's
local spec renames its layer norms on save).

Saves are synchronous and keep Megatron's writer from starting its helper process (`in_process_write_results`);
the processes the writer forks to write its files die with the saving process (`writers_die_with_saver`).
"""

from __future__ import annotations

import contextlib
import os
import queue

from mcore_rl.bridge.bind import unwrap


def _keys(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def sharded_model_state(chunks: list) -> dict:
    return {key: unwrap(c).sharded_state_dict() for key, c in zip(_keys(chunks), chunks)}


def in_process_write_results() -> None:
    """Megatron's filesystem writer (torch_dist) hands each save's write results to the saving code through a
    queue that it makes on the process's first save from a spawned multiprocessing Manager: a helper process that
    re-imports the entry script (3.5-4 s on the CPU machine, before the first checkpoint can be written) and, being
    in the run's process group, dies with a SIGTERM meant for the run. A synchronous save (the only kind this
    project makes) puts and gets those results in the saving process, so a plain in-process queue serves. Call
    before each dist_checkpointing.save; a queue already made (ours or Megatron's) is kept."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


_saver_pid: int | None = None
"""The pid of the process inside writers_die_with_saver() (inherited by what it forks), else None."""
_hook_registered = False


def _writer_forked() -> None:
    """In a process just forked by one inside writers_die_with_saver(): die with the forking thread (and what this
    one forks in turn, with it)."""
    global _saver_pid
    if _saver_pid is None:
        return
    from mcore_rl.procs import die_with_parent

    die_with_parent()
    if os.getppid() != _saver_pid:  # the saver died before the request took effect
        os._exit(1)
    _saver_pid = os.getpid()


@contextlib.contextmanager
def writers_die_with_saver():
    """While the block runs, every process this one forks is killed (SIGKILL) when the forking thread exits.

    Megatron's filesystem writer forks one process per write bucket on every save (multiprocessing's fork
    context), and those wrote on into the `.tmp` folder, holding their copies of the state in memory, after the
    saver was killed (`kill -9`, the OOM killer, a scheduler's hard stop), until they had written their files:
    orphans, for a minute on a large model, while the restarted job already began. Linux only (prctl), like
    mcore_rl.procs; elsewhere the block just runs. The saving thread must be the one that forks (saves here are
    synchronous: it is)."""
    global _saver_pid, _hook_registered
    if not _hook_registered:
        os.register_at_fork(after_in_child=_writer_forked)
        _hook_registered = True
    _saver_pid = os.getpid()
    try:
        yield
    finally:
        _saver_pid = None


def save_mcore_checkpoint(chunks: list, ckpt_dir: str | os.PathLike) -> None:
    """Collective: every rank saves its shards of the model into ckpt_dir (an existing, empty folder)."""
    from megatron.core import dist_checkpointing

    in_process_write_results()
    with writers_die_with_saver():
        dist_checkpointing.save(sharded_model_state(chunks), str(ckpt_dir))


def load_mcore_checkpoint(chunks: list, ckpt_dir: str | os.PathLike) -> None:
    """Collective: every rank reads its shards of a model checkpoint saved at any layout into its chunks."""
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise FileNotFoundError(f"{str(ckpt_dir)!r} is not a Megatron dist checkpoint (no metadata.json)")
    loaded = dist_checkpointing.load(sharded_model_state(chunks), str(ckpt_dir))
    for key, c in zip(_keys(chunks), chunks):
        unwrap(c).load_state_dict(loaded[key], strict=True)
