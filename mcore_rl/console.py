"""What a training run prints: `logger.level` applied to the libraries' warnings and log records.

At `info` (the default) the console carries our own lines (start-up summary, one line per step, checkpoints, errors
and tracebacks) and progress bars. Each kind of library noise is silenced at its source, as narrowly as it can be
named, never by redirecting a stream: Python warnings issued from Megatron-Core, SGLang, its kernel packages,
transformers and Transformer Engine modules (their capability notes: "Apex is not installed", "Only CUDA ...
support AWQ"), torch's deprecation warnings for the collectives Megatron calls, Megatron's INFO records (its DDP /
optimizer config and bucket dumps), transformers' warnings, the shutdown note of multiprocessing's resource
tracker, and SGLang's note of our SIGQUIT handler (which it logs as an error). SGLang's own log lines (the
ServerArgs dump, "Ignore import error when loading sglang.srt.models...") follow rollout.log_level, which a
training run derives from logger.level (RLConfig). At `verbose` nothing is filtered and SGLang logs at info.

    configure("info", sglang_level="error")   # tools/train_ppo.py, before Megatron or SGLang is imported
    configure_from_env()                       # processes spawned by the run (SGLang's scheduler) re-import the
                                               # entry script, which calls this: they inherit the level
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LEVELS = ("info", "verbose")
ENV = "MCORE_RL_LOG_LEVEL"
"""The level handed to the run's child processes (spawned ones re-import the entry script, which reads it)."""

# (action args for warnings.filterwarnings). module / message are regular expressions matched at the start.
_LIB = r"(megatron\.core|sglang|sgl_kernel|flashinfer|transformers|transformer_engine)(\.|$)"
WARNING_FILTERS = (
    # Megatron's and SGLang's (and the kernels' and transformers') notes about what this machine lacks (TE, apex,
    # triton on CPU, AWQ/GGUF kernels), deprecations inside them, and torch warnings their calls trigger
    # (attributed to the calling line).
    dict(category=UserWarning, module=_LIB),
    dict(category=FutureWarning, module=_LIB),
    dict(category=DeprecationWarning, module=_LIB),
    # torch's deprecation of the collectives Megatron's distributed optimizer calls (attributed to torch's wrapper).
    dict(category=FutureWarning, module=r"torch\.distributed\.c10d_logger",
         message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"),
    # torch's note at every barrier of an NCCL group started without device_id (Megatron's checkpoint save calls
    # barriers; the device is the one set for the rank, as intended)
    dict(category=UserWarning, module=r"torch\.distributed\.c10d_logger",
         message=r"barrier\(\): using the device under current context"),
)
# -W form (literal message prefix, exact module) for processes started with the interpreter's flags and no import
# of the entry script: multiprocessing's resource tracker notes semaphores SGLang's processes leave at shutdown.
WARNOPTIONS = ("ignore:resource_tracker:UserWarning:multiprocessing.resource_tracker",)
QUIET_LOGGERS = {"megatron": logging.WARNING}
"""Library loggers raised to a level at `info` (records still propagate to whatever handler is configured)."""
DROPPED_RECORDS = {
    # SGLang logs the SIGQUIT handler our in-process engine registers (rollout/inprocess.py) at ERROR level.
    "sglang.srt.entrypoints.engine": ("Using custom SIGQUIT handler",),
}
"""Records dropped at `info` by logger name and message start: notes a library logs above their weight."""


class _DropRecords(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_installed: list[tuple] = []
_saved_levels: dict[str, int] = {}
_set_env: list[str] = []
_record_filters: list[tuple[str, logging.Filter]] = []


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"logger.level must be one of {LEVELS}, got {level!r}")


def configure(level: str, sglang_level: str | None = None) -> None:
    """Apply `level` to this process and to the processes it starts (environment, -W options). Idempotent;
    a later call with another level undoes the earlier one. sglang_level: SGLang's log level (rollout.log_level)
    for the `sglang` loggers of this process, before SGLang configures the root logger itself."""
    check_level(level)
    os.environ[ENV] = level
    _undo()
    if sglang_level is not None:
        _set_level("sglang", getattr(logging, sglang_level.upper()))
    if level == "verbose":
        return
    for f in WARNING_FILTERS:
        warnings.filterwarnings("ignore", **f)
        _installed.append(warnings.filters[0])
    for opt in WARNOPTIONS:
        if opt not in sys.warnoptions:
            sys.warnoptions.append(opt)
    for name, lvl in QUIET_LOGGERS.items():
        _set_level(name, lvl)
    for name, prefixes in DROPPED_RECORDS.items():
        _record_filters.append((name, _DropRecords(prefixes)))
        logging.getLogger(name).addFilter(_record_filters[-1][1])
    # transformers reads this when it sets up its logger; an explicit setting of the user's wins.
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
        _set_env.append("TRANSFORMERS_VERBOSITY")
    if "transformers" in sys.modules:
        _set_level("transformers", logging.ERROR)


def configure_from_env() -> None:
    """In a process the run started: the run's level (nothing when the variable is unset: not a run's child)."""
    level = os.environ.get(ENV)
    if level in LEVELS:
        configure(level)


def _set_level(name: str, level: int) -> None:
    logger = logging.getLogger(name)
    _saved_levels.setdefault(name, logger.level)
    logger.setLevel(level)


def _undo() -> None:
    for f in _installed:
        if f in warnings.filters:
            warnings.filters.remove(f)
    warnings._filters_mutated()
    _installed.clear()
    for opt in WARNOPTIONS:
        if opt in sys.warnoptions:
            sys.warnoptions.remove(opt)
    for name, lvl in _saved_levels.items():
        logging.getLogger(name).setLevel(lvl)
    _saved_levels.clear()
    for name, f in _record_filters:
        logging.getLogger(name).removeFilter(f)
    _record_filters.clear()
    for name in _set_env:
        os.environ.pop(name, None)
    _set_env.clear()
