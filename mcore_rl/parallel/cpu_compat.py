"""Lets Megatron-Core train on CPU (gloo) for tests and CI. Active only when CUDA is not available.

Megatron-Core assumes CUDA in a few dozen places on the training path: `torch.cuda.current_device()` as a device
for buffers, `torch.cuda.synchronize()` / streams / events, tensors allocated with `device="cuda"`, the CUDA RNG
tracker, and tensor-type strings such as "torch.cuda.FloatTensor". Nothing else in those code paths needs a GPU.

Rather than patching torch globally, this module swaps the module-level name `torch` inside a fixed list of
Megatron modules (`PATCHED_MODULES`) for a proxy that forwards everything to torch except:

* `torch.cuda`: a CPU stand-in (`CPU_CUDA`) whose current_device() is "cpu", whose synchronize / streams /
  events do nothing, whose RNG functions act on the CPU generator (so Megatron's RNG tracker forks and restores
  the CPU generator, which is what CPU dropout uses), and whose memory queries return 0.
* tensor factories (`zeros`, `empty`, `ones`, `tensor`, ...): a `device` of "cuda" becomes "cpu".

Code outside those modules, ours included, sees the real torch. Three type-string checks are fixed by wrapping
the function that makes them (`_patch_type_checks`). `apply()` is idempotent; `PATCHED_MODULES` and the tests in
tests/parallel/test_cpu_compat.py say exactly what is covered.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

# Megatron modules whose `torch` global is replaced. Each was seen to reach CUDA on the CPU training path
# (GPT forward/backward, pipeline schedules, DDP, distributed optimizer, dist checkpointing).
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.utils",
)

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor",
)


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    return device


class _Stream:
    """A CUDA stream stand-in: everything is already synchronous on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event(_Stream):
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def elapsed_time(self, other):
        return 0.0


class _CpuCuda(types.SimpleNamespace):
    """What `torch.cuda` looks like to the patched Megatron modules on a CPU-only machine."""

    def __getattr__(self, name):
        # Anything not stood in for is the real torch.cuda: an unexpected CUDA call still fails loudly.
        return getattr(torch.cuda, name)


def _get_rng_state(device=None):
    return torch.get_rng_state()


def _set_rng_state(state, device=None):
    torch.set_rng_state(state)


CPU_CUDA = _CpuCuda(
    is_available=lambda: False,
    current_device=lambda: "cpu",
    device_count=lambda: 0,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    current_stream=lambda device=None: _Stream(),
    default_stream=lambda device=None: _Stream(),
    Stream=_Stream,
    Event=_Event,
    stream=lambda s=None: contextlib.nullcontext(),
    get_rng_state=_get_rng_state,
    set_rng_state=_set_rng_state,
    manual_seed=lambda seed: torch.manual_seed(seed),
    manual_seed_all=lambda seed: torch.manual_seed(seed),
    default_generators=(torch.default_generator,),
    memory_allocated=lambda device=None: 0,
    max_memory_allocated=lambda device=None: 0,
    memory_reserved=lambda device=None: 0,
    max_memory_reserved=lambda device=None: 0,
    empty_cache=lambda: None,
    nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                               range=lambda *a, **k: contextlib.nullcontext()),
    FloatTensor=torch.FloatTensor,
    is_current_stream_capturing=lambda: False,
)


def _factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _TorchProxy(types.ModuleType):
    """`torch` as the patched Megatron modules see it."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CPU_CUDA
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


TORCH_PROXY = _TorchProxy()
_applied = False


def _patch_rng():
    """Megatron's RNG helpers call torch.cuda's private RNG API; route them to the CPU generator."""
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    rnd._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    rnd._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_type_checks():
    """Type strings: Megatron checks `t.type() == "torch.cuda.FloatTensor"`; on CPU the type has no "cuda.".

    Patched where the check sits: the optimizer's fp32/fp16 grouping. A CPU tensor's .type() is rewritten to its
    CUDA name only inside the wrapped functions.
    """
    from megatron.core.optimizer import optimizer as opt_mod

    cuda_name = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    }
    # Float16OptimizerWithFloat16Params builds its groups in __init__ using param.type().
    cls = opt_mod.Float16OptimizerWithFloat16Params
    orig_init = cls.__init__
    if getattr(orig_init, "_mcore_rl_cpu", False):
        return

    @functools.wraps(orig_init)
    def init(self, *args, **kwargs):
        with _cuda_type_names(cuda_name):
            orig_init(self, *args, **kwargs)

    init._mcore_rl_cpu = True
    cls.__init__ = init

    from megatron.core.optimizer import distrib_optimizer as do_mod

    dcls = do_mod.DistributedOptimizer
    for meth in ("_build_model_and_main_param_groups",):
        orig = getattr(dcls, meth, None)
        if orig is None or getattr(orig, "_mcore_rl_cpu", False):
            continue

        def make(orig):
            @functools.wraps(orig)
            def wrapped(*args, **kwargs):
                with _cuda_type_names(cuda_name):
                    return orig(*args, **kwargs)

            wrapped._mcore_rl_cpu = True
            return wrapped

        setattr(dcls, meth, staticmethod(make(orig)) if isinstance(
            dcls.__dict__.get(meth), staticmethod) else make(orig))


@contextlib.contextmanager
def _cuda_type_names(mapping):
    orig_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = orig_type(self)
            return mapping.get(name, name)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = orig_type


def apply() -> bool:
    """Install the CPU stand-ins into Megatron-Core. No-op (returns False) when CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    for name in PATCHED_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue  # not every Megatron version has every module
        if getattr(mod, "torch", None) is torch:
            mod.torch = TORCH_PROXY
    _patch_rng()
    _patch_type_checks()
    _applied = True
    return True
