"""Optimizer and learning-rate schedule.

Owns: building the optimizer named in the config, and the LR schedule (linear
warmup, then linear or cosine decay to ``min_lr_ratio``, or constant). The schedule
is a function of the step and the config; its checkpointed state is the step count
alone, so a resume with a new ``optimizer.lr``, ``lr_scheduler.*`` or
``training.steps`` follows the new config from the resumed step on.

Never: step them (train.py does) or touch parameters.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config import ConfigError

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    if opt.name not in _OPTIMIZERS:
        raise ConfigError(f"optimizer.name {opt.name!r}: choose one of {sorted(_OPTIMIZERS)}")
    if opt.name == "SGD":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    # fused=True: one kernel for the whole update of every parameter (CPU and CUDA,
    # sharded DTensors included), the same arithmetic on every run. foreach on CPU is a
    # loop of seven ops per parameter: 15 ms of a 1.45 s step of the 7 M-parameter
    # benchmark model against 6 ms fused (scripts/benchmarks/bench_step.py).
    return _OPTIMIZERS[opt.name](
        model.parameters(),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        fused=True,
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


class LRSchedule(Stateful):
    """Sets every param group's ``lr`` to ``peak_lr * lr_factor(step, ...)``.

    Its state is ``{"step": n}``: the peak LR and the shape come from the config of
    the run that loads it, never from the checkpoint.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup: int, total: int,
                 decay_type: str, min_ratio: float):  # fmt: skip
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.shape = (warmup, total, decay_type, min_ratio)
        self.step_count = 0
        self._apply()

    def _apply(self):
        lr = self.peak_lr * lr_factor(self.step_count, *self.shape)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_last_lr(self) -> list[float]:
        """The LR of each param group for the coming optimizer step."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self):
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, state_dict: dict):
        self.step_count = int(state_dict["step"])
        self._apply()


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> LRSchedule:
    sched = cfg.lr_scheduler
    return LRSchedule(optimizer, cfg.optimizer.lr, sched.warmup_steps, cfg.training.steps,
                      sched.decay_type, sched.min_lr_ratio)  # fmt: skip
