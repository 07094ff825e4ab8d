"""OptimConfig validation and the learning-rate schedule (Megatron's OptimizerParamScheduler) step by step."""

import math
from dataclasses import dataclass

import pytest
import torch

from mcore_rl.config.optim import OptimConfig
from mcore_rl.engine.optimizer import build_scheduler, megatron_optimizer_config


def lrs(cfg: OptimConfig, steps: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def test_constant_without_warmup():
    assert lrs(OptimConfig(lr=1e-3), 3) == [1e-3] * 3


def test_linear_warmup_then_constant():
    # step k < warmup: init + (lr - init) * k / warmup (Megatron's convention: step 0 runs at init)
    got = lrs(OptimConfig(lr=1e-3, lr_warmup_steps=4, lr_warmup_init=0.0), 6)
    assert got == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3], rel=1e-12)


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_warmup_init=1e-4, lr_decay_style="cosine",
                      lr_decay_steps=6)
    got = lrs(cfg, 8)
    cosine = [1e-4 + 0.5 * (1 + math.cos(math.pi * (k - 2) / 4)) * 9e-4 for k in range(2, 7)]
    assert got == pytest.approx([1e-4, 5.5e-4] + cosine + [1e-4], rel=1e-12)


def test_linear_decay():
    got = lrs(OptimConfig(lr=1e-3, min_lr=0.0, lr_decay_style="linear", lr_decay_steps=4), 5)
    assert got == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0], abs=1e-15)


def test_megatron_config_mapping():
    @dataclass
    class FakeModelConfig:
        bf16: bool = True
        fp16: bool = False
        params_dtype: torch.dtype = torch.bfloat16

    cfg = OptimConfig(lr=2e-6, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-5, clip_grad=0.0)
    m = megatron_optimizer_config(cfg, FakeModelConfig())
    assert (m.optimizer, m.lr, m.weight_decay, m.adam_beta1, m.adam_beta2, m.adam_eps) == \
        ("adam", 2e-6, 0.1, 0.8, 0.95, 1e-5)
    assert m.bf16 and m.use_distributed_optimizer and m.decoupled_weight_decay
    assert m.clip_grad == float("inf")  # clip_grad=0 reports the norm without clipping


def test_actor_and_critic_are_optimizer_configs():
    """One optimizer config: the actor's and critic's run configs are OptimConfigs, so every optimizer field is
    settable as actor.<field>, their errors name the section the user wrote, and a decay schedule may leave its
    length to the trainer."""
    from mcore_rl.config.rl import ActorConfig, CriticConfig

    actor = ActorConfig(lr=3e-6, lr_warmup_init=1e-6, use_distributed_optimizer=False, grad_reduce_in_fp32=False,
                        lr_decay_style="cosine")
    assert isinstance(actor, OptimConfig) and actor.lr_decay_steps is None
    assert (actor.lr_warmup_init, actor.use_distributed_optimizer, actor.grad_reduce_in_fp32) == (1e-6, False, False)
    with pytest.raises(ValueError, match=r"^actor.min_lr \(1.0\) must be in \[0, lr"):
        ActorConfig(lr=1e-3, min_lr=1.0)
    with pytest.raises(ValueError, match=r"^critic.adam_eps must be positive"):
        CriticConfig(adam_eps=0.0)
    with pytest.raises(ValueError, match=r"optim.lr_decay_style=cosine needs optim.lr_decay_steps"):
        OptimConfig(lr=1e-3, lr_decay_style="cosine")


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), "optim.lr must be positive, got 0.0"),
    (dict(lr=1e-3, min_lr=1e-2), r"optim.min_lr \(0.01\) must be in \[0, lr \(0.001\)\]"),
    (dict(weight_decay=-1.0), "optim.weight_decay must be >= 0, got -1.0"),
    (dict(adam_beta2=1.0), r"optim.adam_beta2 must be in \[0, 1\), got 1.0"),
    (dict(adam_eps=0.0), "optim.adam_eps must be positive, got 0.0"),
    (dict(clip_grad=-1.0), r"optim.clip_grad must be >= 0 \(0 disables clipping\), got -1.0"),
    (dict(lr_warmup_steps=-1), "optim.lr_warmup_steps must be >= 0, got -1"),
    (dict(lr=1e-3, lr_warmup_init=1.0), r"optim.lr_warmup_init \(1.0\) must be in \[0, lr \(0.001\)\]"),
    (dict(lr_decay_style="step"), "optim.lr_decay_style must be one of"),
    (dict(lr_decay_style="cosine"), "optim.lr_decay_style=cosine needs optim.lr_decay_steps"),
    (dict(lr_decay_style="cosine", lr_decay_steps=3, lr_warmup_steps=3),
     r"optim.lr_decay_steps \(3\) must be larger than optim.lr_warmup_steps \(3\)"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)
