"""Megatron DDP wrapping, the Megatron optimizer (Adam, fp32 master weights) and its LR schedule; optimizer-state
offload to host memory for colocated rollouts.

Gradients: DDP accumulates into an fp32 buffer (grad_reduce_in_fp32) and, because the engine sets
`calculate_per_token_loss=True` on the model config, SUMS them over data-parallel ranks instead of averaging
(the loss function's contributions are already normalised globally: see forward_backward.py).
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mcore_rl.config.optim import OptimConfig
from mcore_rl.engine.fast_optim import use_fused_adam


def wrap_ddp(chunks: list, optim: OptimConfig) -> list[DistributedDataParallel]:
    """Wrap model chunks in Megatron DDP (one grad buffer per chunk) and make DP replicas start equal."""
    config = chunks[0].config
    # Sum (do not average) gradients over DP and micro batches: the loss function's contributions carry the
    # global normalisation. DDP reads this flag when it builds its buckets, so it is set before wrapping.
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=optim.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        average_in_collective=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        # Megatron buckets only the first chunk (others reduce in one bucket each), as in its training loop.
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                      disable_bucketing=i > 0)
        ddp.broadcast_params()
        wrapped.append(ddp)
    return wrapped


def megatron_optimizer_config(optim: OptimConfig, model_config) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        # Megatron computes the grad norm only while clipping; an infinite threshold reports it without clipping.
        clip_grad=optim.clip_grad if optim.clip_grad > 0 else float("inf"),
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        decoupled_weight_decay=True,
    )


def fast_optimizer_enabled(optim: OptimConfig, device: torch.device) -> bool:
    """OptimConfig.fast_optimizer resolved for a model on `device` (auto = on GPUs)."""
    return optim.fast_optimizer == "on" or (optim.fast_optimizer == "auto" and device.type == "cuda")


def build_optimizer(ddp_chunks: list, optim: OptimConfig):
    config = ddp_chunks[0].config
    optimizer = get_megatron_optimizer(megatron_optimizer_config(optim, config), ddp_chunks)
    if fast_optimizer_enabled(optim, next(ddp_chunks[0].parameters()).device):
        use_fused_adam(getattr(opt, "optimizer", None) for opt in inner_optimizers(optimizer))
    # fp16 loss scaling multiplies the loss before backward; a no-op scale of 1 for bf16 / fp32.
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(optimizer, optim: OptimConfig) -> OptimizerParamScheduler:
    """Linear warmup, then constant / cosine / linear decay (formula in config/optim.py)."""
    decay_steps = optim.lr_decay_steps if optim.lr_decay_steps is not None else optim.lr_warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        # The config in hand decides the schedule's shape; a checkpoint only restores the step count.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers under a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _master_params(opt) -> list[torch.Tensor]:
    """fp32 master copies that are separate tensors (bf16 / fp16 models). With fp32 weights the optimizer's
    parameters are views of the model weights, which stay where they are."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group if p is not None]


def move_optimizer_state(optimizer, device: torch.device | str) -> int:
    """Move Adam's moments (and separate fp32 master weights) to `device`; returns bytes moved.

    Tensors are moved in place (`.data` for parameters, dict entries for state), so the optimizer keeps working
    once they are back on the training device. On a CPU-only machine moving to "cpu" is a no-op.
    """
    device = torch.device(device)
    moved = 0
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                    state[key] = value.to(device, non_blocking=True)
                    moved += value.numel() * value.element_size()
        for p in _master_params(opt):
            if p.device != device:
                moved += p.numel() * p.element_size()
                p.data = p.data.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved
