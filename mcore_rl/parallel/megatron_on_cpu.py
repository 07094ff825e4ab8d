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

Code outside those modules, ours included, sees the real torch. Type-string checks are fixed by wrapping the
functions that make them (`TYPE_CHECK_SITES`). `apply()` is idempotent; `PATCHED_MODULES`, `TYPE_CHECK_SITES`
and the tests in tests/parallel/test_megatron_on_cpu.py say exactly what is covered.
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
    # Mixture-of-experts layers (models/moe.py): the alltoall dispatcher makes a torch.cuda.Stream for its
    # device-to-host copies of the split sizes and synchronises on its events; the router moves CPU weights to
    # torch.cuda.current_device(); the aux-loss tracker allocates on "cuda"; the all-to-all of
    # tensor_parallel.mappings allocates its output on torch.cuda.current_device().
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.mappings",
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


# Where Megatron compares `tensor.type()` with a CUDA type name: (module, owner attribute or None, function).
# Found on the CPU training path of megatron-core 0.16.1 (bf16 and fp32, distributed optimizer and not):
#   Float16OptimizerWithFloat16Params.__init__   groups params by 'torch.cuda.{Half,BFloat16,Float}Tensor'
#   DistributedOptimizer.__init__                 marks 16-bit params and builds main-param groups the same way
#   clip_grads.clip_grad_by_total_norm_fp32       asserts grads are 'torch.cuda.FloatTensor' (also imported by
#                                                 name into optimizer.py, so both references are wrapped)
TYPE_CHECK_SITES = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
    ("megatron.core.optimizer.clip_grads", None, "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", None, "clip_grad_by_total_norm_fp32"),
)

CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _patch_type_checks():
    """Type strings: Megatron checks `t.type() == "torch.cuda.FloatTensor"`; on CPU the type has no "cuda.".
    Only inside the functions of TYPE_CHECK_SITES is a CPU tensor's .type() rewritten to its CUDA name."""
    _wrap_sites(TYPE_CHECK_SITES, lambda: _cuda_type_names(CUDA_TYPE_NAMES))


# Where Megatron calls `tensor.cuda()` on the CPU training path. Inside these functions Tensor.cuda returns the
# tensor unchanged (it is already on the only device there is):
#   LanguageModule.setup_embeddings_and_output_layer   tied embeddings with pipeline parallelism: the last stage's
#                                                      copy of the word embeddings is all-reduced from the first
#   DistributedOptimizer.get_parameter_state_dp_zero   saving optimizer state ('fully_reshardable' checkpoints)
#                                                      gathers each DP shard on DP rank 0 from a .cuda() copy
TENSOR_CUDA_SITES = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "get_parameter_state_dp_zero"),
)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    orig = torch.Tensor.cuda

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.Tensor.cuda = cuda
    try:
        yield
    finally:
        torch.Tensor.cuda = orig


def _wrap_sites(sites, context):
    """Run each (module, class or None, function) of `sites` inside `context()`; keeps static/class methods."""
    for module_name, owner_name, attr in sites:
        try:
            mod = importlib.import_module(module_name)
        except ImportError:
            continue  # not every Megatron version has every module
        owner = getattr(mod, owner_name, None) if owner_name else mod
        if owner is None:
            continue
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            patched = type(raw)(_within(raw.__func__, context))
        else:
            patched = _within(raw, context)
        setattr(owner, attr, patched)


def _within(fn, context):
    if getattr(fn, "_mcore_rl_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    wrapped._mcore_rl_cpu = True
    return wrapped


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


def _cpu_split_sizes(orig):
    """The alltoall MoE dispatcher hands its split sizes to all_to_all_single as numpy arrays, made by
    maybe_move_tensor_to_cpu(..., as_numpy=True) when it copies them off the GPU; for a tensor already on the CPU that
    function returns the tensor itself, which all_to_all_single's binding rejects (TypeError: incompatible function
    arguments). This stand-in returns a numpy copy there too."""
    if getattr(orig, "_mcore_rl_cpu", False):
        return orig

    @functools.wraps(orig)
    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._mcore_rl_cpu = True
    return move


def _uneven_gather(orig):
    """Megatron's all-gather along the first dimension with per-rank sizes (output_split_sizes: the MoE alltoall
    dispatcher gathers routed tokens over the expert tensor-parallel group) calls torch.distributed.all_gather with
    tensors of different sizes, which gloo refuses ('invalid tensor size'). Stand-in: pad every rank's part to the
    largest, gather equal parts, drop the padding. Equal splits go to Megatron's own code."""
    if getattr(orig, "_mcore_rl_cpu", False):
        return orig

    @functools.wraps(orig)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or input_.is_cuda:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        rows = max(sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    gather._mcore_rl_cpu = True
    return gather


def _uneven_reduce_scatter(orig):
    """The reverse of _uneven_gather (input_split_sizes: the dispatcher's combine step): torch.distributed.
    reduce_scatter with a list of parts, which gloo does not implement. Stand-in: all-reduce the whole tensor and
    keep this rank's rows (more traffic, same sums)."""
    if getattr(orig, "_mcore_rl_cpu", False):
        return orig

    @functools.wraps(orig)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or input_.is_cuda:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[:group.rank()])
        return total[start:start + sizes[group.rank()]].clone()

    reduce_scatter._mcore_rl_cpu = True
    return reduce_scatter


# Module-level functions replaced by a CPU stand-in: (module, attribute, maker of the stand-in from the original).
# Callers inside the module look the name up at call time, so replacing the module attribute reaches them.
FUNCTION_SITES = (
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _cpu_split_sizes),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _uneven_gather),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", _uneven_reduce_scatter),
)


def _patch_functions():
    for module_name, attr, make in FUNCTION_SITES:
        try:
            mod = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(mod, attr):
            setattr(mod, attr, make(getattr(mod, attr)))


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
    _wrap_sites(TENSOR_CUDA_SITES, _tensor_cuda_is_identity)
    _patch_functions()
    _applied = True
    return True
