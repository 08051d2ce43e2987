"""Optimizer and learning-rate schedule.

Owns: building the optimizer named in the config (Muon, with AdamW for what is not a
hidden matrix: muon.py, ``build_muon``), and the LR schedule: linear
warmup, then a decay to ``min_lr_ratio`` (linear, cosine, or 1-sqrt) or none
(constant). The decay follows the warmup, or, warmup-stable-decay (WSD), holds the peak
LR and decays over the last ``lr_scheduler.decay_steps`` (or ``decay_ratio`` of
``training.steps``) only: a cooldown branched from a stable run's checkpoint
(``checkpoint.branch_from``) then trains exactly as a run that had its schedule from
step 0. The schedule is a function of the step and the config; its checkpointed state
is the step count alone, so a resume with a new ``optimizer.lr``, ``lr_scheduler.*`` or
``training.steps`` follows the new config from the resumed step on. The rules between
its settings are ``check_config``'s.

Cost: O(1) per step (one float per param group); no state grows with the run.

Never: step them (train.py does) or touch parameters.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config import ConfigError
from torchtitan.muon import Muon

_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
               "Muon": Muon}  # fmt: skip


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    if opt.name not in _OPTIMIZERS:
        raise ConfigError(f"optimizer.name {opt.name!r}: choose one of {sorted(_OPTIMIZERS)}")
    if opt.name == "Muon":
        return build_muon(model, opt)
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


def build_muon(model: torch.nn.Module, opt) -> Muon:
    """Muon from the ``optimizer`` section: ``lr``, ``weight_decay`` and the ``muon_*``
    fields for the hidden matrices; ``muon_adamw_lr`` (0: ``lr``),
    ``muon_adamw_weight_decay`` (negative: ``weight_decay``), ``beta1``, ``beta2`` and
    ``eps`` for the AdamW part."""
    return Muon(
        model.named_parameters(),
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        momentum=opt.muon_momentum,
        nesterov=opt.muon_nesterov,
        ns_coefficients=(opt.muon_ns_a, opt.muon_ns_b, opt.muon_ns_c),
        ns_steps=opt.muon_ns_steps,
        eps=opt.muon_eps,
        adjust_lr_fn=opt.muon_adjust_lr,
        adamw_lr=opt.muon_adamw_lr or opt.lr,
        adamw_weight_decay=(
            opt.weight_decay if opt.muon_adamw_weight_decay < 0 else opt.muon_adamw_weight_decay
        ),
        betas=(opt.beta1, opt.beta2),
        adamw_eps=opt.eps,
    )


# The decay's shapes: the fraction of (peak - min) left at progress p in [0, 1].
DECAYS = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),  # "1-sqrt" (Hägele et al. 2024), for cooldowns
}


def decay_length(sched, steps: int) -> int:
    """The WSD decay's steps: ``lr_scheduler.decay_steps``, else ``decay_ratio`` of
    ``steps`` rounded to the nearest step; 0 where neither is set (the decay, if any,
    follows the warmup)."""
    return sched.decay_steps or round(sched.decay_ratio * steps)


def lr_factor(step: int, warmup: int, total: int, decay_type: str, min_ratio: float,
              decay_steps: int = 0) -> float:  # fmt: skip
    """Multiplier of the base LR at optimizer step ``step`` (0-based: training step
    ``step + 1``).

    Warmup: ``(step + 1) / (warmup + 1)``. Without ``decay_steps`` the decay spans
    ``warmup .. total`` (progress ``(step - warmup) / (total - warmup)``: its first step
    at the peak; kept as it was, so that running jobs resume on their curve). With
    ``decay_steps`` N (WSD): the peak until step ``total - N``, then N decayed steps with
    progress ``(step - (total - N) + 1) / N``: the first below the peak, the last at
    ``min_ratio`` exactly; i.e. training steps ``total - N + 1 .. total`` decay.
    Cost: O(1)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_type == "constant":
        return 1.0
    if decay_steps > 0:
        # mutant wsd-decay-a-step-late: `step - (total - decay_steps) + 1` -> `step - (total - decay_steps)`; test/test_wsd.py::test_wsd_warmup_stable_then_decay_to_the_minimum_at_the_last_step
        done = step - (total - decay_steps) + 1  # decayed steps, this one included
        if done <= 0:
            return 1.0  # the stable phase
        progress = min(1.0, done / decay_steps)
    elif total <= warmup:
        return 1.0
    else:
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * DECAYS[decay_type](progress)


def check_config(cfg) -> None:
    """The rules between the schedule's settings, raised as one ConfigError."""
    s, steps = cfg.lr_scheduler, cfg.training.steps
    if s.decay_ratio and s.decay_steps:
        raise ConfigError(
            f"lr_scheduler.decay_ratio {s.decay_ratio:g} and lr_scheduler.decay_steps "
            f"{s.decay_steps} are both set; set only one (the decay's share of "
            "training.steps, or its length in steps)"
        )
    if not (s.decay_ratio or s.decay_steps):
        return
    key = "lr_scheduler.decay_steps" if s.decay_steps else "lr_scheduler.decay_ratio"
    value = s.decay_steps or s.decay_ratio
    if s.decay_type == "constant":
        raise ConfigError(
            f"{key} {value:g} with lr_scheduler.decay_type 'constant': nothing decays; "
            "choose decay_type linear, cosine or sqrt, or drop the option"
        )
    n = decay_length(s, steps)
    if n == 0:
        raise ConfigError(
            f"lr_scheduler.decay_ratio {s.decay_ratio:g} of training.steps {steps} rounds to "
            "0 steps; raise it, or set lr_scheduler.decay_steps"
        )
    if n > steps - s.warmup_steps:
        raise ConfigError(
            f"{key} {value:g} ({n} steps) overlaps the warmup: training.steps {steps} less "
            f"lr_scheduler.warmup_steps {s.warmup_steps} leaves {steps - s.warmup_steps}; "
            "lower it, lower the warmup or raise training.steps"
        )


class LRSchedule(Stateful):
    """Sets every param group's ``lr`` to ``peak_lr * lr_factor(step, ...)``.

    Its state is ``{"step": n}``: the peak LR and the shape come from the config of
    the run that loads it, never from the checkpoint. A param group holding a
    ``peak_lr`` (Muon's, set from the config by ``build_muon``) is scaled from that one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup: int, total: int,
                 decay_type: str, min_ratio: float, decay_steps: int = 0):  # fmt: skip
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.shape = (warmup, total, decay_type, min_ratio, decay_steps)
        self.step_count = 0
        self._apply()

    def _apply(self):
        factor = lr_factor(self.step_count, *self.shape)
        for group in self.optimizer.param_groups:
            # A group with a peak of its own (Muon's AdamW part) is scaled alike.
            group["lr"] = group.get("peak_lr", self.peak_lr) * factor

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
    sched, steps = cfg.lr_scheduler, cfg.training.steps
    return LRSchedule(optimizer, cfg.optimizer.lr, sched.warmup_steps, steps, sched.decay_type,
                      sched.min_lr_ratio, decay_length(sched, steps))  # fmt: skip
