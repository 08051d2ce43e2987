"""Optimizer and learning-rate schedule.

Owns: building the optimizer named in the config, and the LR schedule (linear
warmup, then linear or cosine decay to ``min_lr_ratio``, or constant). Both are
torch objects whose ``state_dict`` the checkpoint saves as is.

Never: step them (train.py does) or touch parameters.
"""

from __future__ import annotations

import math

import torch

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    if opt.name not in _OPTIMIZERS:
        raise ValueError(f"optimizer.name {opt.name!r}: choose one of {sorted(_OPTIMIZERS)}")
    if opt.name == "SGD":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    # foreach=True: one fused kernel per group, and the same arithmetic on every run.
    return _OPTIMIZERS[opt.name](
        model.parameters(),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        foreach=True,
    )


def lr_factor(step: int, warmup: int, total: int, decay_type: str, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_type == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay_type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


class _Schedule:
    """A picklable LR lambda (a closure would not survive a checkpoint of its config)."""

    def __init__(self, warmup: int, total: int, decay_type: str, min_ratio: float):
        self.args = (warmup, total, decay_type, min_ratio)

    def __call__(self, step: int) -> float:
        return lr_factor(step, *self.args)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    sched = cfg.lr_scheduler
    fn = _Schedule(sched.warmup_steps, cfg.training.steps, sched.decay_type, sched.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
