"""Logits only where a loss reads them (ModelConfig.lm_head = "loss_tokens", the default).

RL and DPO losses read log-probs and entropies only at response tokens, the entries of a micro batch's
`loss_mask`. Every other position (the prompt, padding) still costs the output layer's matmul and a pass of the
log-softmax over the whole vocabulary, and its row of logits is the largest activation of the step: at Qwen2.5-0.5B
dims the output layer is about a quarter of a forward pass's FLOPs. So the engine hands the model, per micro batch,
the positions whose *next* token is in the loss mask (`positions`) through a `LogitRows` it owns, and a pre-hook on
the output layer (`install`) keeps only those rows of the final hidden states: the logits come out as [1, n, V/tp]
instead of [b, s, V/tp].
`scatter` puts the per-position results back into the micro batch's [b, s] layout, zeros elsewhere, before the
usual alignment (engine/logprobs.py). Gradients are those of the full computation: the rows left out feed no loss.

With sequence parallelism the output layer's input is this rank's slice of the sequence, which the layer
all-gathers itself; there the hook stays off and the layer runs at every position (sequence parallelism needs
Transformer Engine or apex norms, which the CPU tests cannot run, so a gather-then-select path would be untested).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

MODES = ("loss_tokens", "all")


def effective_mode(mode: str, *, is_critic: bool, sequence_parallel: bool) -> str:
    """The mode a model built with ModelConfig.lm_head=`mode` runs: "all" for a critic (its value head reads every
    position) and with sequence parallelism (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"model.lm_head must be one of {MODES}, got {mode!r}")
    return "all" if is_critic or sequence_parallel else mode


class LogitRows:
    """The positions the hooked output layers keep in the current forward call (None: every position).

    One per built model, owned by its engine: `install` hooks the output layer to read it, and the engine sets it
    around each forward call of a last-stage chunk (`selecting`)."""

    def __init__(self):
        self.rows: tuple[Tensor, Tensor] | None = None

    @contextmanager
    def selecting(self, rows: tuple[Tensor, Tensor] | None):
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None


def install(model, logit_rows: LogitRows) -> None:
    """Hook the output layer of `model` (the last-stage GPTModel chunk of a language model whose effective mode
    is loss_tokens) to keep only the rows `logit_rows` holds during a call."""
    layer = model.output_layer

    def keep_rows(module, args, kwargs):
        rows = logit_rows.rows
        if rows is None:
            return None
        b, s = rows
        hidden = args[0]  # [s, b, h] -> [n, 1, h]
        # index_select, not hidden[s, b]: its backward is an index_add (the rows are distinct), where advanced
        # indexing's is an accumulating index_put, which sorts the indices on GPUs
        kept = hidden.reshape(-1, hidden.size(-1)).index_select(0, s * hidden.size(1) + b)
        return (kept.unsqueeze(1),) + tuple(args[1:]), kwargs

    layer.register_forward_pre_hook(keep_rows, with_kwargs=True)


def selects_rows(model, mode: str) -> bool:
    """True when `model` (an unwrapped chunk of a model whose effective mode is `mode`) is the last stage, which
    computes logits only at the positions it is handed."""
    return mode == "loss_tokens" and model.post_process


def positions(loss_mask: Tensor) -> tuple[tuple[Tensor, Tensor], bool]:
    """((rows, cols), empty) of the positions whose next token is in `loss_mask` ([b, s]): position p predicts
    token p + 1. A micro batch without loss tokens keeps position (0, 0) so the layer still runs (`empty` True:
    `scatter` then drops it)."""
    need = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    need[..., :-1] = loss_mask[..., 1:] != 0
    rows, cols = need.nonzero(as_tuple=True)
    if rows.numel() == 0:
        zero = torch.zeros(1, dtype=torch.long, device=loss_mask.device)
        return (zero, zero.clone()), True
    return (rows, cols), False


def scatter(values: Tensor, rows: tuple[Tensor, Tensor], shape, empty: bool = False) -> Tensor:
    """Per-position values [n] back into a [b, s] tensor (0 elsewhere); differentiable in `values`."""
    if empty:
        values = values * 0
    out = torch.zeros(tuple(shape), dtype=values.dtype, device=values.device)
    return out.index_put(rows, values)
