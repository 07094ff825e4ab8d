"""Forward (and backward) over a list of micro batches through Megatron's pipeline schedules.

`forward_backward` runs `megatron.core.pipeline_parallel.get_forward_backward_func()` (no pipelining, 1F1B or
interleaved 1F1B, chosen from the parallel state), turns the model output of each micro batch into per-token
tensors (logprobs [+ entropy] for an LM, values for a critic; alignment in logprobs.py) and hands them, with the
micro batch, to the caller's loss function:

    loss_fn(outputs: dict[str, Tensor], micro_batch: MicroBatch) -> (loss: 0-dim Tensor, metrics: dict[str, Tensor])

Loss normalisation (exact under micro-batching, DP and PP). Every value loss_fn returns is a *contribution*:
the engine divides it by `normalizer` (default 1) and SUMS it over the micro batches of this call and over the
data-parallel ranks. Gradients are the gradients of that same sum: Megatron neither divides by the number of
micro batches nor averages over DP here (calculate_per_token_loss=True and a finalize step that does not
rescale). So for a token-mean over the whole mini-batch either

* return sum(per_token_loss * mask) and pass normalizer = the mini-batch's total mask count over all micro
  batches and DP ranks (`global_count(micro_batches, "loss_mask")` computes it), or
* return the already normalised contribution (mcore_rl.algorithms.aggregation.aggregate_loss with
  global_num_tokens=...) and leave normalizer at 1.

The reported `loss` and `metrics` are those sums, identical on every rank. Tensor-parallel ranks compute the
same loss (the log-probs are already reduced over TP); they are not summed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from mcore_rl.engine.batching import MicroBatch, pad_micro_batch, to_device
from mcore_rl.engine.logprobs import align_to_tokens, next_token_targets, vocab_parallel_logprobs
from mcore_rl.models import lm_head

if TYPE_CHECKING:
    from mcore_rl.models.builder import ModelInfo
    from mcore_rl.models.moe import RouterHooks

ROUTES = "routed_experts"
"""Micro-batch field of per-token expert routes ([b, s, num_layers, topk]) that routing replay feeds the routers."""

LossFn = Callable[[dict, MicroBatch], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass
class ForwardBackwardResult:
    loss: float
    """Sum over micro batches and DP ranks of loss_fn's loss / normalizer (0.0 without a loss_fn)."""
    metrics: dict[str, float]
    """Same sum for each metric loss_fn returned (each divided by normalizer too)."""
    outputs: list[dict[str, torch.Tensor]] | None
    """With collect_outputs: per micro batch, the detached per-token outputs (layout of its input_ids). On the
    last pipeline stage, or on every rank with broadcast_outputs."""
    pending: tuple | None = None
    """With defer_scalars: the device-side sums not yet read into `loss` / `metrics` (see resolve)."""

    def resolve(self) -> "ForwardBackwardResult":
        """Read deferred loss / metrics from the device (one host sync; collective over pipeline stages)."""
        if self.pending is not None:
            self.loss, self.metrics = _share_scalars(*self.pending)
            self.pending = None
        return self


def unwrap(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _finalize_without_rescale(model, num_tokens=None, **kwargs):
    # The schedule passes the token count returned by the loss function; contributions are already
    # normalised, so the grads are only synchronised, never divided.
    return finalize_model_grads(model, None, **kwargs)


def configure_model_config(config, ddp_chunks: Sequence | None, interleaved: bool = False) -> None:
    """Hooks Megatron's schedules read from the model config (set once, by the engine)."""
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = _finalize_without_rescale
    if interleaved:
        # With two pipeline stages, a stage's previous and next rank are the same peer; in one batched p2p call
        # (and in the shape exchange of variable_seq_lengths, always batched) the activation and the gradient
        # sent to that peer can then be received in each other's place. The interleaved schedule therefore
        # runs with fixed shapes (forward_backward pads the micro batches to one shape) and unbatched p2p,
        # which uses a separate communicator per direction for two stages.
        config.variable_seq_lengths = False
        config.batch_p2p_comm = False
    if ddp_chunks:
        no_sync = [c.no_sync for c in ddp_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync


def per_token_outputs(output: torch.Tensor, mb: MicroBatch, info: ModelInfo, *, temperature: float = 1.0,
                      with_entropy: bool = False, positions=None) -> dict[str, torch.Tensor]:
    """The model's last-stage output for one micro batch -> per-token tensors aligned with mb.input_ids.

    info: the built model's ModelInfo. positions: lm_head.positions(...) when the model computed logits only there
    (output [1, n, V/tp]); the results are scattered back to the micro batch's layout, 0 elsewhere."""
    if info.is_critic:
        values = output.squeeze(-1).float()  # [b, s, 1] -> [b, s]
        return {"values": align_to_tokens(values, mb.valid_mask, mb.seq_starts if mb.packed else None)}
    targets = next_token_targets(mb.input_ids)
    if positions is not None:
        rows, empty = positions
        targets = targets[rows].unsqueeze(0)
    logprobs, entropy = vocab_parallel_logprobs(
        output, targets, info.vocab_size, temperature=temperature,
        with_entropy=with_entropy, group=parallel_state.get_tensor_model_parallel_group(),
    )
    if positions is not None:
        logprobs = lm_head.scatter(logprobs[0], rows, mb.input_ids.shape, empty)
        if with_entropy:
            entropy = lm_head.scatter(entropy[0], rows, mb.input_ids.shape, empty)
    starts = mb.seq_starts if mb.packed else None
    out = {"logprobs": align_to_tokens(logprobs, mb.valid_mask, starts)}
    if with_entropy:
        out["entropy"] = align_to_tokens(entropy, mb.valid_mask, starts)
    return out


def _check_num_micro_batches(n: int, num_chunks: int) -> None:
    if n == 0:
        raise ValueError("forward_backward needs at least one micro batch on every rank")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if num_chunks > 1 and n % pp:
        raise ValueError(
            f"the interleaved pipeline schedule (parallel.vpp={num_chunks}) needs the number of micro batches "
            f"({n}) to be a multiple of parallel.pp ({pp}); pass multiple_of={pp} to make_micro_batches"
        )


def forward_backward(chunks: Sequence, micro_batches: Sequence[MicroBatch], loss_fn: LossFn | None, *,
                     info: ModelInfo, logit_rows: lm_head.LogitRows | None = None, forward_only: bool = False,
                     normalizer: float | torch.Tensor = 1.0, temperature: float = 1.0, with_entropy: bool = False,
                     collect_outputs: bool = False, broadcast_outputs: bool = False,
                     defer_scalars: bool = False, router_hooks: RouterHooks | None = None) -> ForwardBackwardResult:
    """Run the pipeline schedule over `micro_batches` on this rank's model chunks (DDP-wrapped or not).

    info, logit_rows, router_hooks: the built model's (models/builder.BuiltModel). Without logit_rows the output
    layer runs at every position, whatever info.lm_head says. With router_hooks (MoE models), micro batches that
    carry a "routed_experts" field are routed along those routes when the model replays routes
    (model.moe_routing_replay), and training passes accumulate router statistics (RouterHooks.collect).

    Gradients accumulate into the DDP grad buffers (zero them before a new step: TrainEngine does). With
    forward_only, no graph is kept. Every rank of a pipeline / tensor-parallel group must pass the same micro
    batches; data-parallel ranks pass their own (their numbers may differ). With defer_scalars, `loss` and
    `metrics` stay on the device until `result.resolve()` (which every rank must call), so the caller can queue
    more GPU work (the optimizer step) before the host waits for them.
    """
    chunks = list(chunks)
    models = [unwrap(c) for c in chunks]
    n = len(micro_batches)
    _check_num_micro_batches(n, len(chunks))
    if not forward_only and loss_fn is None:
        raise ValueError("a backward pass needs a loss_fn")
    normalizer = float(normalizer)
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    device = next(models[0].parameters()).device
    outputs: list = [None] * n
    losses: list[torch.Tensor] = []
    metric_values: dict[str, list[torch.Tensor]] = {}

    def loss_func(index: int, mb: MicroBatch, positions, output: torch.Tensor):
        per_token = per_token_outputs(output, mb, info, temperature=temperature, with_entropy=with_entropy,
                                      positions=positions)
        if collect_outputs:
            outputs[index] = {k: v.detach() for k, v in per_token.items()}
        zero_tokens = torch.zeros((), dtype=torch.int, device=output.device)
        if loss_fn is None:
            return output.new_zeros((), dtype=torch.float32), zero_tokens, {}
        loss, metrics = loss_fn(per_token, mb)
        loss = loss / normalizer
        losses.append(loss.detach().float())
        for key, value in (metrics or {}).items():
            value = torch.as_tensor(value, device=device).detach().float()
            metric_values.setdefault(key, []).append(value / normalizer)
        return loss, zero_tokens, {}

    def forward_step(data_iterator, model):
        index, mb = next(data_iterator)
        # logits only where the loss mask reads them (models/lm_head.py)
        positions = logit_positions[index] if lm_head.selects_rows(unwrap(model), mode) else None
        with contextlib.ExitStack() as scope:
            if positions is not None:
                scope.enter_context(logit_rows.selecting(positions[0]))
            if router_hooks is not None:
                scope.enter_context(router_hooks.micro_batch(mb.fields.get(ROUTES), mb.valid_mask,
                                                             measure=not forward_only))
            extra = {} if padding[index] is None else {"padding_mask": _stage_padding(unwrap(model), padding[index])}
            output = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                           packed_seq_params=mb.packed_seq_params, **extra)
        return output, partial(loss_func, index, mb, positions)

    caller_shapes = [mb.input_ids.shape for mb in micro_batches]
    if len(chunks) > 1:  # the interleaved schedule exchanges fixed shapes (configure_model_config)
        rows = max(s[0] for s in caller_shapes)
        length = max(s[1] for s in caller_shapes)
        micro_batches = [pad_micro_batch(mb, length, rows) for mb in micro_batches]
    # Every micro batch moves to the device before the schedule starts: a copy from pageable host memory waits
    # for the stream to drain, so moving each one as its forward begins would stall the host once per micro batch
    # behind the previous one's queued kernels. The logit positions (models/lm_head.py) are found on the host.
    mode = info.lm_head if logit_rows is not None else "all"
    selects = any(lm_head.selects_rows(m, mode) for m in models)
    logit_positions = []  # None for a micro batch without a loss mask: every position then
    # MoE routers leave padding out of the load-balancing and z losses (Megatron's padding_mask: True on padding)
    padding: list[torch.Tensor | None] = []
    for mb in micro_batches:
        found = mb.logit_positions() if selects and "loss_mask" in mb.fields else None
        mb.to(device)
        logit_positions.append(None if found is None else (tuple(to_device(p, device) for p in found[0]), found[1]))
        padded = router_hooks is not None and mb.num_tokens < mb.input_ids.numel()
        padding.append(~mb.valid_mask if padded else None)
    # Each chunk walks through all micro batches in order; the schedule interleaves the chunks.
    iterators = [iter(list(enumerate(micro_batches))) for _ in chunks]
    for c in chunks:
        c.train(not forward_only)
    if router_hooks is not None:
        router_hooks.begin_pass()
    with contextlib.ExitStack() as scope:
        if not forward_only and router_hooks is not None and router_hooks.has_losses:
            # the routers' aux and z losses as token means over this pass (one host sync; MoE with those losses)
            scope.enter_context(router_hooks.token_mean(max(global_count(micro_batches, None), 1.0)))
        _run_schedule(chunks, micro_batches, iterators, forward_step, forward_only)
    if router_hooks is not None:
        router_hooks.end_pass()
    pending = _sum_scalars(losses, metric_values, device)
    loss, metrics = (float("nan"), {}) if defer_scalars else _share_scalars(*pending)
    if collect_outputs and broadcast_outputs:
        outputs = _broadcast_outputs(outputs, micro_batches, info.is_critic, with_entropy, device)
    if collect_outputs and len(chunks) > 1:
        outputs = [None if out is None else {k: v[:shape[0], :shape[1]] for k, v in out.items()}
                   for out, shape in zip(outputs, caller_shapes)]
    return ForwardBackwardResult(loss, metrics, outputs if collect_outputs else None,
                                 pending if defer_scalars else None)


def _run_schedule(chunks, micro_batches, iterators, forward_step, forward_only: bool) -> None:
    with torch.no_grad() if forward_only else torch.enable_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.input_ids.size(1) for mb in micro_batches),  # p2p shapes are exchanged anyway
            micro_batch_size=max(mb.input_ids.size(0) for mb in micro_batches),
            forward_only=forward_only,
        )


def _stage_padding(model, padding: torch.Tensor) -> torch.Tensor:
    """The padding mask [b, s] as this pipeline stage's model call takes it. The first stage takes the full mask
    and scatters it over the sequence-parallel ranks itself; later stages pass it to their routers as it is, so
    with sequence parallelism they get this tensor-parallel rank's slice of s here."""
    if getattr(model, "pre_process", True) or not model.config.sequence_parallel:
        return padding
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunk = padding.size(1) // tp
    rank = parallel_state.get_tensor_model_parallel_rank()
    return padding[:, rank * chunk:(rank + 1) * chunk]


def _sum_scalars(losses, metric_values, device) -> tuple[torch.Tensor | None, list[str]]:
    """Sum over micro batches and DP ranks, on the device (last pipeline stage; None elsewhere)."""
    keys = sorted(metric_values)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None, keys
    vec = torch.stack([torch.stack(losses).sum() if losses else torch.zeros((), device=device)]
                      + [torch.stack(metric_values[k]).sum() for k in keys])
    dp_group = parallel_state.get_data_parallel_group()
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(vec, group=dp_group)
    return vec, keys


def _share_scalars(vec: torch.Tensor | None, keys: list[str]) -> tuple[float, dict[str, float]]:
    """The sums as floats on every pipeline stage: one host sync."""
    if vec is not None:
        values = vec.tolist()
        packet = [(values[0], dict(zip(keys, values[1:])))]
    else:
        packet = [None]
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.is_initialized() and dist.get_world_size(pp_group) > 1:
        dist.broadcast_object_list(packet, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=pp_group)
    return packet[0]


def _broadcast_outputs(outputs, micro_batches, is_critic: bool, with_entropy, device):
    """Send the last stage's per-token outputs to every pipeline stage (shapes come from the micro batches)."""
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if not dist.is_initialized() or dist.get_world_size(pp_group) == 1:
        return outputs
    keys = ["values"] if is_critic else (
        ["logprobs", "entropy"] if with_entropy else ["logprobs"])
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    result = []
    for out, mb in zip(outputs, micro_batches):
        if not last:
            out = {k: torch.empty(mb.input_ids.shape, dtype=torch.float32, device=device) for k in keys}
        for k in keys:
            dist.broadcast(out[k], src=src, group=pp_group)
        result.append(out)
    return result


def global_count(micro_batches: Sequence[MicroBatch], key: str | None = "loss_mask") -> float:
    """Sum of `key` over these micro batches and all data-parallel ranks (each rank passes its own): the
    normalizer of a token-mean over the mini-batch. With key=None, counts real tokens. One host sync."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    parts = [mb.fields[key].sum().to(device, torch.float64) if key is not None
             else torch.tensor(float(mb.num_tokens), dtype=torch.float64, device=device) for mb in micro_batches]
    total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized():
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return float(total.item())
