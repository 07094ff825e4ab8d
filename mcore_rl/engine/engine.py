"""TrainEngine: one Megatron model (actor, critic or frozen reference) with its optimizer, in one object.

    layout = mcore_rl.parallel.initialize(parallel, hf)
    engine = TrainEngine(hf, model_cfg, parallel, OptimConfig(lr=1e-6))      # optim=None: forward only
    mbs = make_micro_batches(sequences, max_tokens=4096, multiple_of=engine.micro_batch_multiple)
    old = engine.compute_logprobs(mbs)          # per micro batch {"logprobs": [b, s] or [1, t]}, every rank
    step = engine.train_step(mbs, loss_fn, normalizer=global_count(mbs))     # zero grads, fwd/bwd, step
    engine.save_checkpoint(dir); engine.load_checkpoint(dir)

See forward_backward.py for the loss function contract and how losses are normalised.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.optim import OptimConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.engine import checkpoint as ckpt
from mcore_rl.engine.batching import MicroBatch
from mcore_rl.engine.forward_backward import ForwardBackwardResult, LossFn, configure_model_config, forward_backward
from mcore_rl.engine.fast_optim import foreach_fallbacks
from mcore_rl.engine.optimizer import (build_optimizer, build_scheduler, fast_optimizer_enabled, inner_optimizers,
                                       move_optimizer_state, wrap_ddp)

if TYPE_CHECKING:
    from mcore_rl.models.builder import BuiltModel

logger = logging.getLogger(__name__)


@dataclass
class TaskGrad:
    """One objective of a multi-objective update (TrainEngine.multi_objective_step)."""

    micro_batches: Sequence[MicroBatch]
    loss_fn: LossFn
    coefficient: float = 1.0
    """The objective's clipped gradient is multiplied by this before the objectives are summed."""
    clip_grad: float = 0.0
    """Clip this objective's gradient norm (over all shards) to this first; 0 = no clipping."""
    temperature: float = 1.0
    """Log-probs of this objective are taken under logits / temperature."""
    with_entropy: bool = False


@dataclass
class TaskGradResult:
    loss: float
    metrics: dict[str, float]
    grad_norm: float
    """Norm of this objective's gradient alone, before its clipping."""
    clip_coef: float
    """min(1, clip_grad / grad_norm): the factor its clipping applied (1.0 without clipping)."""


@dataclass
class StepResult:
    loss: float
    """Sum of the loss contributions (forward_backward.py); the mini-batch loss with correct normalisation."""
    metrics: dict[str, float]
    grad_norm: float
    """Global gradient norm before clipping (over all shards)."""
    lr: float
    """Learning rate the step used."""
    update_successful: bool
    """False when the update was skipped: fp16 loss scaling found inf / nan gradients, or (nonfinite) the
    gradient norm was inf or nan."""
    nonfinite: bool = False
    """The gradient norm was inf or nan (a diverged loss, not fp16 overflow): the update was not applied, so the
    weights and the optimizer state are those before it. The trainer decides what follows (trainer.on_nonfinite)."""


class TrainEngine:
    """This rank's model chunks, wrapped for training when `optim` is given.

    hf: HF config.json as a dict; value_head=True builds a critic (outputs "values" instead of "logprobs").
    model: a BuiltModel built (and loaded) by the caller with models.build_model, instead of building it here.
    Parallel state must be initialised (mcore_rl.parallel.initialize). Weights are random: load an HF
    checkpoint with mcore_rl.bridge into `model_chunks` (then call reload_master_weights, which matters for bf16)
    or a Megatron checkpoint with load_checkpoint.
    """

    def __init__(self, hf: dict, model_cfg: ModelConfig, parallel: ParallelConfig,
                 optim: OptimConfig | None = None, *, value_head: bool = False, model: BuiltModel | None = None):
        from megatron.core import parallel_state

        from mcore_rl.models.builder import build_model

        self.parallel = parallel
        self.optim_cfg = optim
        built = model if model is not None else build_model(hf, model_cfg, parallel, value_head)
        self.model_chunks = built.chunks
        self.model_info = built.info
        """What forward_backward and the bridge need to know about the model (is_critic, vocab_size, lm_head)."""
        self.logit_rows = built.logit_rows
        self.router_hooks = built.router_hooks
        """MoE models: routing replay and router statistics (models/moe.RouterHooks); None for dense models."""
        self.config = self.model_chunks[0].config
        self.device = next(self.model_chunks[0].parameters()).device
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.fast_optimizer = optim is not None and fast_optimizer_enabled(optim, self.device)
        if optim is not None:
            self.chunks = wrap_ddp(self.model_chunks, optim)
            self.optimizer = build_optimizer(self.chunks, optim)
            self.scheduler = build_scheduler(self.optimizer, optim)
        else:
            self.chunks = list(self.model_chunks)
            self.optimizer = self.scheduler = None
            for p in (p for c in self.model_chunks for p in c.parameters()):
                p.requires_grad_(False)
        configure_model_config(self.config, self.chunks if optim is not None else None,
                               interleaved=len(self.model_chunks) > 1)
        self.num_steps = 0
        self.lr_multiplier = 1.0
        self.graphed = None
        """engine/graphed_forward.GraphedForward with model.forward_cuda_graphs on / static, else None."""
        self.graphs_off_reason: str | None = None
        """Why model.forward_cuda_graphs on / static left the forward passes eager (None when it did not)."""
        graphs = model_cfg.forward_cuda_graphs
        if graphs == "on" and self.device.type != "cuda":
            self.graphs_off_reason = "no CUDA device"
            logger.info("model.forward_cuda_graphs=on: no CUDA device, eager forward passes")
        elif graphs != "off":
            from mcore_rl.engine.graphed_forward import GraphedForward, unsupported

            reason = ("the interleaved pipeline schedule" if len(self.model_chunks) > 1 else
                      unsupported(self.model_chunks[0], self.model_info, self.router_hooks))
            if reason is None:
                self.graphed = GraphedForward(self.model_chunks[0], self.model_info, capture=graphs == "on")
            else:
                self.graphs_off_reason = reason
                logger.info("model.forward_cuda_graphs=%s: eager forward passes (%s)", graphs, reason)

    @property
    def is_critic(self) -> bool:
        return self.model_info.is_critic

    @property
    def micro_batch_multiple(self) -> int:
        """The number of micro batches must be a multiple of this (the interleaved schedule needs pp)."""
        return self.pp_size if len(self.model_chunks) > 1 else 1

    @property
    def sequence_multiple(self) -> int:
        """A micro batch's sequence dimension must be a multiple of this: the TP size under sequence parallelism
        (each TP rank holds one slice of it between the tensor-parallel regions), else 1."""
        return self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1

    # -- forward / backward -------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn | None, *,
                         forward_only: bool = False, normalizer: float = 1.0, temperature: float = 1.0,
                         with_entropy: bool = False, collect_outputs: bool = False,
                         broadcast_outputs: bool = False) -> ForwardBackwardResult:
        """One pass over the micro batches; gradients accumulate (see zero_grad). Contract in forward_backward.py."""
        if not forward_only and self.optimizer is None:
            raise ValueError("this engine was built without an optimizer (optim=None): use forward_only=True")
        return forward_backward(self.chunks, micro_batches, loss_fn, info=self.model_info,
                                logit_rows=self.logit_rows, router_hooks=self.router_hooks,
                                forward_only=forward_only, normalizer=normalizer, temperature=temperature,
                                with_entropy=with_entropy,
                                collect_outputs=collect_outputs, broadcast_outputs=broadcast_outputs)

    def compute_logprobs(self, micro_batches: Sequence[MicroBatch], *, temperature: float = 1.0,
                         with_entropy: bool = False) -> list[dict[str, torch.Tensor]]:
        """Per micro batch {"logprobs": ..., ["entropy": ...]} (layout of its input_ids), on every rank.

        With model.lm_head = loss_tokens (the default) and a "loss_mask" field, only the loss mask's tokens get
        values (the rest are 0); micro batches without a loss mask get every position's."""
        if self.is_critic:
            raise ValueError("compute_logprobs needs a language model; this engine is a critic (compute_values)")
        if self.graphed is not None and all(mb.packed for mb in micro_batches):  # graphs replay packed layouts
            return self.graphed.compute_logprobs(
                micro_batches, lambda mbs: self.forward_backward(
                    mbs, None, forward_only=True, temperature=temperature, with_entropy=with_entropy,
                    collect_outputs=True, broadcast_outputs=True).outputs,
                temperature=temperature, with_entropy=with_entropy)
        return self.forward_backward(micro_batches, None, forward_only=True, temperature=temperature,
                                     with_entropy=with_entropy, collect_outputs=True,
                                     broadcast_outputs=True).outputs

    def compute_values(self, micro_batches: Sequence[MicroBatch]) -> list[dict[str, torch.Tensor]]:
        """Per micro batch {"values": ...} (layout of its input_ids), on every rank."""
        if not self.is_critic:
            raise ValueError("compute_values needs a critic (build the engine with value_head=True)")
        return self.forward_backward(micro_batches, None, forward_only=True, collect_outputs=True,
                                     broadcast_outputs=True).outputs

    def moe_metrics(self) -> dict[str, float]:
        """Router statistics of the training passes since the last call (moe/aux_loss, moe/z_loss,
        moe/load_imbalance, moe/load_imbalance_max; docs/moe.md), then reset; {} for a dense model. Collective:
        every rank calls it (once a step: one all-reduce and one host sync)."""
        return {} if self.router_hooks is None else self.router_hooks.collect(self.device)

    # -- optimizer --------------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[bool, float, float]:
        """Clip, step, advance the LR schedule. Returns (update_successful, grad_norm, lr used). A gradient whose
        norm is inf or nan is never applied (update_successful False, the norm returned): one such step would
        turn every weight into nan. The norm is the one host sync of the step (Megatron's clipping needs it too),
        and it is global (reduced over every shard), so every rank skips alike."""
        success, grad_norm, lr, _ = self._optimizer_step()
        return success, grad_norm, lr

    def _optimizer_step(self) -> tuple[bool, float, float, bool]:
        """optimizer_step's (update_successful, grad_norm, lr) and whether the norm was non-finite."""
        lr = self.lr
        with foreach_fallbacks(self.fast_optimizer):
            if self.optimizer.prepare_grads():  # fp16 loss scaling found inf / nan: its scaler skips the step
                return False, float("nan"), lr, False
            grad_norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(grad_norm):
                return False, grad_norm, lr, True
            self._clip_all(self.optim_cfg.clip_grad, grad_norm)
            success = bool(self.optimizer.step_with_ready_grads())
        if success:
            self._advance_schedule()
        return success, grad_norm, lr, False

    def _advance_schedule(self) -> None:
        self.scheduler.step(increment=1)
        self.num_steps += 1
        self.set_lr_multiplier(self.lr_multiplier)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr_multiplier(self, multiplier: float) -> None:
        """Scale the schedule's learning rate by `multiplier` from now on (e.g. a KL monitor's decay). The
        schedule itself is unchanged; the multiplier is the caller's state to checkpoint and set again."""
        if not multiplier >= 0:
            raise ValueError(f"lr multiplier must be >= 0, got {multiplier}")
        self.lr_multiplier = float(multiplier)
        for group in self.optimizer.param_groups:
            group["lr"] = self.scheduler.get_lr(group) * self.lr_multiplier

    def _main_params(self) -> list[torch.Tensor]:
        return [p for opt in inner_optimizers(self.optimizer) for p in opt.get_parameters()]

    @torch.no_grad()
    def _clip_all(self, max_norm: float, total_norm: float) -> None:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        params = [p for p in self._main_params() if p.grad is not None]
        if params and max_norm > 0 and math.isfinite(max_norm):
            clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm)

    def multi_objective_step(self, tasks: Sequence[TaskGrad]) -> tuple[StepResult, list[TaskGradResult]]:
        """One optimizer update from several objectives, each clipped on its own before they are combined:

            g = sum_k c_k * min(1, clip_k / |g_k|) * g_k,   then the optimizer's global clip, then Adam

        where g_k is objective k's full gradient (its own forward/backward, reduced over data-parallel ranks)
        and |g_k| its global norm over all TP / PP / DP shards (Megatron's grad-norm rules: tensor-parallel
        duplicates and shared embeddings counted once). Memory: one extra fp32 copy of this rank's share of
        the main gradients while objectives accumulate (none for a single objective). fp16 overflow in any
        objective skips the update, as in train_step.
        """
        if self.optimizer is None:
            raise ValueError("this engine was built without an optimizer (optim=None)")
        if not tasks:
            raise ValueError("multi_objective_step needs at least one objective")
        with foreach_fallbacks(self.fast_optimizer):
            return self._multi_objective_step(tasks)

    def _multi_objective_step(self, tasks: Sequence[TaskGrad]) -> tuple[StepResult, list[TaskGradResult]]:
        lr = self.lr
        acc: list[torch.Tensor] | None = None
        results, overflow = [], False
        for k, task in enumerate(tasks):
            self.zero_grad()
            fb = self.forward_backward(task.micro_batches, task.loss_fn, temperature=task.temperature,
                                       with_entropy=task.with_entropy)
            overflow |= bool(self.optimizer.prepare_grads())
            norm = float(self.optimizer.get_grad_norm())
            clip = min(1.0, task.clip_grad / (norm + 1e-6)) if task.clip_grad > 0 else 1.0
            scale = task.coefficient * clip
            grads = [p.grad for p in self._main_params()]
            with torch.no_grad():
                if k < len(tasks) - 1:  # the live gradients are zeroed by the next objective's pass: keep a copy
                    if acc is None:
                        acc = [g * scale if g is not None else None for g in grads]
                    else:
                        for a, g in zip(acc, grads):
                            if g is not None:
                                a.add_(g, alpha=scale)
                else:  # the last objective's gradients stay where the optimizer reads them
                    for i, g in enumerate(grads):
                        if g is not None:
                            g.mul_(scale)
                            if acc is not None:
                                g.add_(acc[i])
            results.append(TaskGradResult(fb.loss, fb.metrics, norm, clip))
        del acc
        if overflow:
            return StepResult(sum(r.loss for r in results), {}, float("nan"), lr, False), results
        total = float(self.optimizer.get_grad_norm())
        if not math.isfinite(total):  # never applied (optimizer_step)
            return StepResult(sum(r.loss for r in results), {}, total, lr, False, nonfinite=True), results
        self._clip_all(self.optim_cfg.clip_grad, total)
        success = bool(self.optimizer.step_with_ready_grads())
        if success:
            self._advance_schedule()
        metrics: dict[str, float] = {}
        for r in results:
            for key, v in r.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + v
        return StepResult(sum(r.loss for r in results), metrics, total, lr, success), results

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, normalizer: float = 1.0,
                   temperature: float = 1.0, with_entropy: bool = False) -> StepResult:
        """zero_grad + forward_backward + optimizer_step: one optimizer update from one mini-batch."""
        self.zero_grad()
        # The loss and metrics are read from the device after the optimizer step is queued, not before it: the
        # host then prepares the step while the backward pass still runs.
        fb = forward_backward(self.chunks, micro_batches, loss_fn, info=self.model_info, logit_rows=self.logit_rows,
                              router_hooks=self.router_hooks, normalizer=normalizer, temperature=temperature,
                              with_entropy=with_entropy, defer_scalars=True)
        success, grad_norm, lr, nonfinite = self._optimizer_step()
        fb.resolve()
        return StepResult(fb.loss, fb.metrics, grad_norm, lr, success, nonfinite)

    def reload_master_weights(self) -> None:
        """Copy the model weights into the optimizer's fp32 master weights. Call after writing weights into
        `model_chunks` behind the optimizer's back (e.g. mcore_rl.bridge loading an HF checkpoint into a bf16
        engine); with fp32 weights the master weights are the model weights and this is a no-op."""
        if self.optimizer is not None:
            for opt in inner_optimizers(self.optimizer):
                opt.reload_model_params()

    def offload_optimizer(self) -> None:
        """Move Adam state (and bf16 models' fp32 master weights) to host memory; no-op move on CPU."""
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, "cpu")

    def onload_optimizer(self) -> None:
        """Bring the optimizer state back to the training device."""
        if self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)

    # -- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, path, extra: dict | None = None, reshardable: bool = False):
        """Collective. Model + optimizer + scheduler (+ `extra`, e.g. the trainer's step) to `path`, atomically.
        reshardable: the optimizer state in the slower format that loads at any layout; False (default): the
        per-rank format, which loads at the same TP / PP / EP layout and any DP size (engine/checkpoint.py)."""
        extra = dict(extra or {}, engine_num_steps=self.num_steps)
        self._init_optimizer_state()
        return ckpt.save(path, self.model_chunks, self.optimizer, self.scheduler, extra, reshardable=reshardable)

    def _init_optimizer_state(self) -> None:
        """Adam's state (zero moments at step 0) where no update has created it yet: a checkpoint saved before
        any update was applied (each one skipped as non-finite) needs it, since Megatron's optimizer state dict
        reads every parameter's step."""
        if self.optimizer is None:
            return
        for opt in inner_optimizers(self.optimizer):
            inner = opt.optimizer
            params = [p for g in inner.param_groups for p in g["params"]]
            if not params or all(len(inner.state[p]) for p in params):
                continue
            opt.init_state_fn(inner, opt.config)
            for g in inner.param_groups:
                on_device = g.get("fused") or g.get("capturable")  # torch keeps `step` with the parameter then
                for p in g["params"]:
                    if "step" not in inner.state[p]:
                        inner.state[p]["step"] = torch.zeros((), dtype=torch.float32,
                                                             device=p.device if on_device else "cpu")

    def load_checkpoint(self, path, load_optimizer: bool = True) -> dict:
        """Collective. Load into this engine (build it fresh first); returns the `extra` dict saved with it."""
        with_opt = load_optimizer and self.optimizer is not None
        extra = ckpt.load(path, self.model_chunks, self.optimizer if with_opt else None,
                          self.scheduler if with_opt else None)
        if with_opt:
            self.num_steps = int(extra.get("engine_num_steps", 0))
        else:
            self.reload_master_weights()
        return extra
