"""Rollout: how the SGLang engine runs (in-process or as an HTTP server), its hardware settings, sampling defaults,
and the time limits that turn a stuck engine into an error. Consumed by `mcore_rl.rollout.RolloutEngine`;
conf/rollout/{cpu,gpu,server}.yaml are the Hydra groups.

Fields left None mean "pick for the hardware": on a machine without CUDA the CPU settings SGLang needs
(torch_native attention, pytorch sampling, no CUDA graphs, no overlap scheduler, no grammar backend), on GPUs
SGLang's own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES = ("engine", "server")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Our names (as in model.dtype) and SGLang's, both accepted; "auto" keeps the checkpoint's dtype.
DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
          "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass
class RolloutConfig:
    mode: str = "engine"
    """engine: sglang.Engine inside this process (its scheduler runs in child processes; colocated training).
    server: an HTTP server, launched here as `python -m sglang.launch_server`, or an existing one (server_url)."""
    server_url: str | None = None
    """With mode=server: attach to this running server (http://host:port) instead of launching one."""
    model_path: str = ""
    """HF checkpoint folder SGLang loads at start; empty = the trainer passes model.path."""
    skip_tokenizer_init: bool = True
    """Token ids in and out, no tokenizer in SGLang. Set false for stop strings (they need SGLang's detokenizer);
    responses then also carry response_text."""
    device: str = "auto"
    """auto: cuda when available, else cpu."""
    dtype: str = "auto"
    """Weights/compute dtype in SGLang: auto (the checkpoint's), fp32, bf16, fp16."""
    tp_size: int = 1
    """Tensor parallel size of the SGLang engine (GPUs it uses)."""
    base_gpu_id: int = 0
    """First GPU the engine uses (colocated: usually 0; disaggregated: the first GPU after the trainer's)."""
    attention_backend: str | None = None
    """None or auto: torch_native on CPU; on a GPU fa3 where sgl_kernel ships its FA3 kernels and the GPU is a
    Hopper (H100/H200: about 40% faster decoding than triton there), else triton. Any SGLang backend name is
    passed through (triton, fa3, flashinfer, torch_native, ...)."""
    sampling_backend: str | None = None
    """None: pytorch on CPU, SGLang's default on GPU."""
    grammar_backend: str | None = None
    """None: "none" on CPU (no grammar backend), SGLang's default on GPU."""
    disable_cuda_graph: bool | None = None
    """None: true on CPU, false on GPU."""
    disable_overlap_schedule: bool | None = None
    """None: true on CPU (the overlap scheduler needs CUDA streams), false on GPU."""
    sleep_on_idle: bool | None = None
    """None: true on CPU, where an idle SGLang scheduler would otherwise keep a core busy (while the trainer
    runs, colocated); SGLang's default (false) on GPU."""
    mem_fraction_static: float | None = None
    """Fraction of device memory for weights + KV cache; None = SGLang's default."""
    max_total_tokens: int | None = None
    """KV cache size in tokens; None = derived from mem_fraction_static. CPU configs set it to bound RAM use."""
    enable_memory_saver: bool = False
    """Colocated on GPUs: lets release_memory() actually free the engine's GPU memory (needs the
    torch_memory_saver package; unavailable on CPU, where release/resume are accepted but free nothing)."""
    release_while_training: bool | None = None
    """Colocated: release the engine's weights and KV cache after each step's rollouts and take them back before
    the weight sync, so the update gets that memory. None: on when enable_memory_saver (which makes the release
    free GPU memory) and trainer.rollout_mode=sync; the other modes generate while the step trains. true without
    the memory saver runs the same calls and frees nothing (CPU)."""
    context_length: int | None = None
    """Longest prompt + response; None = the checkpoint's max_position_embeddings."""
    random_seed: int = 0
    """Seeds SGLang's sampling: each sample's seed is a hash of (random_seed, its group_id, its index in the group,
    and for agent trajectories the turn) (mcore_rl/rollout/seeds.py). The trainer's seed is parallel.seed, the
    prompt order's data.seed."""
    deterministic: bool | None = None
    """Sample each request with its own seed (SGLang's enable_deterministic_inference), so a resumed run draws the
    same samples as an uninterrupted one and two runs with the same seeds are equal (docs/reliability.md, "Exact
    resume"). Off: SGLang's one global sampling RNG, which a restarted engine restarts. None: on for CPU (its cost
    there: no radix cache, so each sample runs its prompt's prefill), off on GPU (where SGLang also switches to
    batch-invariant kernels, about a third slower). An attached server (server_url) must be launched with
    --enable-deterministic-inference for it."""
    host: str = "127.0.0.1"
    """Server mode: address the launched server binds to."""
    port: int | None = None
    """Server mode: port of the launched server; None picks a free one."""
    log_level: str | None = None
    """SGLang's log level (debug, info, warning, error); info shows where a slow start or a stuck request is.
    None: in a training run, follows logger.level (error at info, info at verbose); used alone, warning."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: start SGLang with enable_return_routed_experts and return, with every sample,
    the experts each layer routed each token to (Sample.routed_experts). Set by the trainer from
    model.moe_routing_replay; an attached server (server_url) must have been launched with
    --enable-return-routed-experts."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Further sglang ServerArgs fields passed as they are (e.g. cuda_graph_max_bs, chunked_prefill_size)."""

    startup_timeout_s: float = 600.0
    """Starting the engine (imports, weight loading, warm-up) longer than this raises RolloutEngineError."""
    request_timeout_s: float = 1800.0
    """One generate() call or weight update longer than this is aborted and raises RolloutEngineError."""
    request_batch_size: int = 64
    """Samples per request sent to SGLang; a generate() call is split into requests of this size."""
    max_concurrent_requests: int = 8
    """Requests in flight at once; SGLang batches across them."""
    show_progress: bool = True
    """tqdm bar over requests when a generate() call has more than one."""

    # Sampling defaults; generate() takes per-call overrides. Samples per prompt: algorithm.n_samples_per_prompt.
    temperature: float = 1.0
    """Sampling temperature (>= 0; 0 = greedy). The trainer scores tokens under logits / temperature, the
    distribution sampled from (plain log-softmax when 0), so the PPO ratio compares like with like."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens with this much probability, in (0, 1]; 1 = off."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1: no top-k."""
    max_new_tokens: int = 256
    """Longest response, in tokens. Also the constant length L of actor.loss_agg_mode=seq-mean-token-sum-norm and
    the end of the DAPO overlong ramp (algorithm.overlong_buffer)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (besides the tokenizer's EOS, unless ignore_eos)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; need skip_tokenizer_init=false."""
    ignore_eos: bool = False
    """Keep generating past the tokenizer's EOS, to max_new_tokens or a stop (benchmarks of fixed length)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rollout.mode must be one of {MODES}, got {self.mode!r}")
        if self.server_url is not None and self.mode != "server":
            raise ValueError(f"rollout.server_url ({self.server_url!r}) attaches to a running server and needs "
                             f"rollout.mode=server, got mode={self.mode!r}")
        if self.device not in DEVICES:
            raise ValueError(f"rollout.device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tp_size < 1:
            raise ValueError(f"rollout.tp_size must be >= 1, got {self.tp_size}")
        if self.log_level is not None and self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"rollout.log_level must be one of {LOG_LEVELS} or null, got {self.log_level!r}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"rollout.port must be in 1..65535 or null (pick a free port), got {self.port}")
        for name in ("startup_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("request_batch_size", "max_concurrent_requests", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"rollout.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if isinstance(self.stop, str):
            raise ValueError(f"rollout.stop must be a list of strings, got the string {self.stop!r}; "
                             f"write stop=[{self.stop!r}]")
        if self.stop and self.skip_tokenizer_init:
            raise ValueError(f"rollout.stop ({list(self.stop)}) needs SGLang's tokenizer: set "
                             "rollout.skip_tokenizer_init=false, or use rollout.stop_token_ids")
        if self.enable_memory_saver and self.device == "cpu":
            raise ValueError("rollout.enable_memory_saver=true needs CUDA (torch_memory_saver); set it false on CPU")
        reserved = set(self.extra_args) & {"model_path", "skip_tokenizer_init", "device", "host", "port"}
        if reserved:
            raise ValueError(f"rollout.extra_args must not set {sorted(reserved)}: use the rollout.* fields")
