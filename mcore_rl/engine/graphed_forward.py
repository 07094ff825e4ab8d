"""Forward-only log-prob passes replayed from CUDA graphs (ModelConfig.forward_cuda_graphs).

Why: the reference and old log-prob passes do no backward and little GPU work, so on a GPU they run at the speed of
the host that launches their kernels. At Qwen2.5-0.5B dims on an H100 the e2e step's reference forward took 0.16 s
for 0.06 s of kernels (docs/performance.md, "the e2e step profiled"). A CUDA graph launches the whole pass at once.

How: a graph replays fixed shapes and fixed addresses, so each packed micro batch is laid onto a static `Shape`:

    tokens   T: the pack's length, rounded up to a bucket (four per octave); the tail is padding
    slots    S: the number of sequence bounds in cu_seqlens (power of two); unused slots repeat the last bound,
                which makes empty sequences
    max_len  L: a bound on every sequence's length (power of two); the padding is cut into pieces of at most L
    rows     R: the positions whose next token is in the loss mask (every position without one), padded with
                position 0, rounded up like T

and copied into static device buffers; the graph runs the model (embedding, layers, final norm: Megatron's GPTModel
with its output layer skipped), keeps the R rows, and computes their log-probs (and entropies) with the output layer
in chunks of `head_rows`, so the logits of only one chunk exist at a time. Each micro batch has its own shape (one
shape shared by a call's micro batches padded a 5k-token remainder to 16k on the H100 and cancelled the gain). One
graph per (shape, temperature, entropy), captured the second time its shape comes. Graphs share one memory pool and
are dropped when the weights move (their addresses are checked each call) or when `release()` is called (before the
rollout engine takes the memory back, say).

What it needs: a CUDA device, one pipeline stage and one model chunk, a dense language model (MoE dispatch reads
token counts on the host; critics are not graphed), SDPA attention with packed micro batches (the flash varlen
kernel: models/attention.py), no sequence parallelism. `unsupported()` says which one is missing; the engine then
runs the eager path. With capture=False the same static layout runs eagerly (any device): that is what the CPU tests
compare against the eager path, since capture itself needs a GPU.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core import parallel_state, tensor_parallel

from mcore_rl.engine.batching import MicroBatch, to_device
from mcore_rl.engine.logprobs import align_to_tokens, vocab_parallel_logprobs
from mcore_rl.models import lm_head

MIN_TOKENS = 256
MIN_SLOTS = 16
MIN_MAX_LEN = 64
MAX_GRAPHS = 8


@dataclass(frozen=True)
class Shape:
    tokens: int
    slots: int
    max_len: int
    rows: int


def bucket(n: int, per_octave: int = 4, minimum: int = MIN_TOKENS) -> int:
    """n rounded up to the next of `per_octave` evenly spaced sizes in its octave (at least `minimum`): padding
    costs at most 1/per_octave of the work, and a run meets few distinct sizes."""
    n = max(n, minimum)
    step = max(1, (1 << (n - 1).bit_length()) // (2 * per_octave))
    return -(-n // step) * step


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def static_shape(lengths: Sequence[int], length: int, rows: int) -> Shape:
    """The shape of a packed micro batch: its sequences' `lengths`, its row `length` (>= their sum), its number
    of logit `rows`."""
    tokens = bucket(length)
    max_len = _pow2(max(lengths), MIN_MAX_LEN)
    if max_len >= tokens:
        # RoPE reads frequencies of the pack's length as per-token ones (models/rope.py); keep them per sequence
        max_len = tokens + 1
    pieces = len(lengths) + -(-(tokens - sum(lengths)) // max_len)
    return Shape(tokens, _pow2(pieces, MIN_SLOTS), max_len, bucket(rows, minimum=64))


def static_bounds(lengths: Sequence[int], shape: Shape) -> list[int]:
    """cu_seqlens of `lengths` laid onto `shape`: the sequences, the padding in pieces of at most max_len, then the
    last bound repeated (empty sequences) up to shape.slots + 1 entries."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    while bounds[-1] < shape.tokens:
        bounds.append(min(bounds[-1] + shape.max_len, shape.tokens))
    if len(bounds) > shape.slots + 1:
        raise AssertionError(f"{len(bounds) - 1} pieces do not fit {shape.slots} slots")
    return bounds + [shape.tokens] * (shape.slots + 1 - len(bounds))


def unsupported(model, info, router_hooks=None) -> str | None:
    """Why `model` (this rank's only chunk, unwrapped) cannot run its log-prob passes from graphs; None if it can.
    Fixed for a built model (the engine asks once); padded micro batches are refused per call (`compute_logprobs`
    callers check `mb.packed`)."""
    from mcore_rl.models.attention import SDPAttention

    if info.is_critic:
        return "critics are not graphed"
    if router_hooks is not None:
        return "mixture-of-experts dispatch reads token counts on the host"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return "pipeline parallelism"
    if model.config.sequence_parallel:
        return "sequence parallelism"
    cores = [m for m in model.modules() if type(m).__name__ in ("SDPAttention", "TEDotProductAttention",
                                                                   "DotProductAttention")]
    if not cores or not all(isinstance(m, SDPAttention) and m.window is None and m.packed_impl in ("auto", "varlen")
                            for m in cores):
        return "attention other than SDPA with the varlen kernel (model.attention=sdpa, packed_attention=auto)"
    return None


@contextlib.contextmanager
def _no_rng_fork():
    """Megatron forks its CUDA RNG state around attention and (with sequence parallelism) the layers: reading a
    generator's state is illegal while capturing. A forward pass in eval mode draws nothing, so the fork is a no-op
    there and is skipped."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


@contextlib.contextmanager
def _hidden_states_only(model):
    """GPTModel returns the final hidden states (after the final norm) instead of logits."""
    before, model.post_process = model.post_process, False
    try:
        yield
    finally:
        model.post_process = before


class _Static:
    """The device buffers one shape's graph reads and writes."""

    def __init__(self, shape: Shape, device):
        from megatron.core.packed_seq_params import PackedSeqParams

        from mcore_rl.models.attention import static_layout

        self.ids = torch.zeros(1, shape.tokens, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, shape.tokens, dtype=torch.long, device=device)
        self.cu = torch.tensor(static_bounds([], shape), dtype=torch.int32, device=device)
        self.rows = torch.zeros(shape.rows, dtype=torch.long, device=device)
        self.params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu,
                                      max_seqlen_q=shape.max_len, max_seqlen_kv=shape.max_len)
        if device.type == "cuda":  # the attention reads no bounds on the host (models/attention.py)
            self.params._mcore_rl_layout = static_layout(self.cu, shape.tokens, shape.max_len)
        self.out: dict[str, torch.Tensor] | None = None

    def fill(self, mb: MicroBatch, bounds: torch.Tensor, rows: torch.Tensor) -> None:
        t = mb.input_ids.size(1)
        self.ids[:, :t].copy_(mb.input_ids)
        self.ids[:, t:].zero_()
        self.pos[:, :t].copy_(mb.position_ids)
        self.pos[:, t:].zero_()
        self.cu.copy_(bounds)
        self.rows.zero_()
        self.rows[:rows.numel()].copy_(rows)


class GraphedForward:
    """Log-prob passes of one engine's model through static shapes, captured as CUDA graphs (capture=True) or run
    eagerly on the same layout (capture=False)."""

    def __init__(self, chunk, info, *, capture: bool = True, head_rows: int = 4096):
        from mcore_rl.engine.forward_backward import unwrap

        self.model = unwrap(chunk)
        self.info = info
        self.capture = capture
        self.head_rows = head_rows
        self.graphs: OrderedDict = OrderedDict()
        self.pool = None
        self.weights_key = None
        self.num_captures = 0
        self.seen: dict = {}
        """How often each shape not captured yet has been met."""

    def release(self) -> None:
        """Drop every graph and its memory pool."""
        self.graphs.clear()
        self.pool = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _weights(self) -> tuple:
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def compute_logprobs(self, micro_batches: Sequence[MicroBatch], eager, *, temperature: float = 1.0,
                         with_entropy: bool = False) -> list[dict[str, torch.Tensor]]:
        """TrainEngine.compute_logprobs's result for packed micro batches (same layout, 0 off the loss mask).

        Each micro batch gets its own shape. With capture, a shape is captured the second time it is seen (a run's
        shapes recur from step to step; a one-off one would cost a capture, about three forward passes, for one
        replay); until then `eager(micro_batches)` (the engine's own forward pass) computes it."""
        device = next(self.model.parameters()).device
        keys, inputs = [], []
        for mb in micro_batches:  # positions and shapes on the host, before anything is queued on the device
            if "loss_mask" in mb.fields and self.info.lm_head == "loss_tokens":
                (_, cols), empty = mb.logit_positions()
                cols = cols[:0] if empty else cols
            else:
                cols = torch.arange(mb.input_ids.size(1))
            shape = static_shape(mb.seq_lengths, mb.input_ids.size(1), max(len(cols), 1))
            keys.append((shape, float(temperature), bool(with_entropy)))
            inputs.append((torch.tensor(static_bounds(mb.seq_lengths, shape), dtype=torch.int32), cols))
        if self.capture:
            weights = self._weights()
            if weights != self.weights_key:
                self.release()
                self.weights_key = weights
        results: list = [None] * len(micro_batches)
        if len(self.seen) > 4096:  # a long run's one-off shapes
            self.seen.clear()
        later = []
        for i, key in enumerate(keys):
            if self.capture and key not in self.graphs and self.seen.get(key, 0) < 1:
                self.seen[key] = self.seen.get(key, 0) + 1
                later.append(i)
        if later:
            for i, out in zip(later, eager([micro_batches[i] for i in later])):
                results[i] = out
        self.model.eval()
        for i, (mb, key, (bounds, cols)) in enumerate(zip(micro_batches, keys, inputs)):
            if results[i] is not None:
                continue
            mb.to(device)
            bounds, cols = to_device(bounds, device), to_device(cols, device)  # no host wait on queued replays
            # Eagerly, fresh buffers per micro batch: the attention and RoPE cache what they derive from cu_seqlens
            # by the tensor's identity. A graph computes those inside the capture, so its buffers are reused.
            static = self._static(key, device)
            static.fill(mb, bounds, cols)
            if self.capture:
                self.graphs[key][1].replay()
                out = {k: v.clone() for k, v in static.out.items()}
            else:
                out = self._forward(static, key[0], temperature, with_entropy)
            results[i] = self._scatter(out, mb, cols)
        return results

    def _static(self, key, device) -> _Static:
        shape, temperature, with_entropy = key
        if not self.capture:
            return _Static(shape, device)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key][0]
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        static = _Static(shape, device)  # its bounds (padding pieces only) make a valid pack for the warm-up
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisations and compilations happen outside the capture
            for _ in range(2):
                self._forward(static, shape, temperature, with_entropy)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        from mcore_rl.models import rope

        rope.clear_cache()  # a cached cos / sin from the warm-up would be baked in as a constant
        # thread_local: the trainer's other threads (watchdog, asynchronous rollouts) may touch CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static.out = self._forward(static, shape, temperature, with_entropy)
        rope.clear_cache()
        self.graphs[key] = (static, graph)
        self.num_captures += 1
        return static

    @torch.no_grad()
    def _forward(self, static: _Static, shape: Shape, temperature: float, with_entropy: bool) -> dict:
        model = self.model
        with _no_rng_fork(), _hidden_states_only(model):
            hidden = model(input_ids=static.ids, position_ids=static.pos, attention_mask=None,
                           packed_seq_params=static.params)  # [T, 1, h]
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, static.rows)
        targets = torch.roll(static.ids[0], -1).index_select(0, static.rows)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        group = parallel_state.get_tensor_model_parallel_group()
        logprobs, entropies = [], []
        for start in range(0, shape.rows, self.head_rows):
            part = hidden[start:start + self.head_rows].unsqueeze(1)
            logits, _ = model.output_layer(part, weight=weight)  # [n, 1, V / tp]
            lp, ent = vocab_parallel_logprobs(logits, targets[start:start + self.head_rows].unsqueeze(1),
                                              self.info.vocab_size, temperature=temperature,
                                              with_entropy=with_entropy, group=group)
            logprobs.append(lp[:, 0])
            if with_entropy:
                entropies.append(ent[:, 0])
        out = {"logprobs": torch.cat(logprobs)}
        if with_entropy:
            out["entropy"] = torch.cat(entropies)
        return out

    @staticmethod
    def _scatter(out: dict, mb: MicroBatch, cols: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row results -> the micro batch's [1, t] layout, aligned to tokens (engine/logprobs.py)."""
        rows = (torch.zeros_like(cols), cols)
        return {key: align_to_tokens(lm_head.scatter(values[:cols.numel()], rows, mb.input_ids.shape), mb.valid_mask,
                                     mb.seq_starts)
                for key, values in out.items()}
