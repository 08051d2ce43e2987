"""Broken steps and loss spikes: what a step's loss and gradient norm say before its update.

Owns: the verdict on each step (``SpikeGuard.decide``, called by the step between the
gradient norm and the optimizer's update): a non-finite loss or gradient norm drops the
update on every rank, and ``training.max_bad_steps`` dropped steps in a row (broken, or
spikes under ``on_spike skip_step``: a loss that moved for good would be skipped for
ever) stop the job in one line; the spike check (a trailing window of ``training.spike_window`` applied
steps, a z-score of ``training.spike_sigma`` once the window is full, and optional
absolute bounds), and what a spike does (``training.on_spike``: log, skip the step,
or have the loop rewind); the guard's checkpointed state (the window and the counters),
so a resumed run checks as the uninterrupted one; and the test-only fault hook
(``FAULT_ENV``).

Agreement: the ranks decide alike without a collective of their own for the non-finite
case. A rank whose loss so far is not finite multiplies its last micro-batch's loss by
NaN (by 1.0 otherwise, which changes no bit), so its gradients are NaN; the gradient
reduction that already runs spreads them, and the gradient norm every rank computes is
NaN on every rank. The spike check reads the loss averaged over the ranks (one
8-byte all-reduce per step, only with a spike check on), and the gradient norm, the
same on every rank.

A dropped step: the data is consumed (the loader moved on), the step counter and the
LR schedule advance as for any step, and the weights and the optimizer's moments and
step count stay as they were.

Cost: one device-to-host read of the loss and of the gradient norm per step (a sync on
a GPU), O(spike_window) arithmetic on the host, and the all-reduce above.

Never: step the optimizer, pull batches, choose or load checkpoints (the loop rewinds
through the checkpoint manager), or write metrics files.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from torchtitan import parallel
from torchtitan.checkpoint.entries import empty_like_saved, from_tensor, to_tensor
from torchtitan.checkpoint.stateful import Adapter, Saved
from torchtitan.config import ConfigError

logger = logging.getLogger("torchtitan")

# Test-only: ``step:kind[@rank],...`` makes chosen steps broken on cue, since CPU training
# does not spike by itself. Kinds: ``nan``/``inf`` (loss and gradients), ``xK`` (loss and
# gradients times K: a spike), ``nan_value`` (the loss this rank reports is NaN, its
# gradients are not: what the agreement must spread), ``nan_grad`` (a gradient is NaN,
# the loss is not: what a peer's NaN looks like after the reduction). ``@rank``: on that
# global rank only. Each fires once per process: the step retaken after a rewind is
# clean, and a relaunch fires it again (the same run, killed and requeued).
FAULT_ENV = "TORCHTITAN_TEST_FAULT"


class TrainingError(RuntimeError):
    """The run cannot train on (diverged, or spikes past the rewinds allowed): one line."""


def check_config(cfg) -> None:
    t = cfg.training
    detects = t.spike_window > 0 or t.spike_max_loss > 0 or t.spike_max_grad_norm > 0
    if t.on_spike != "log" and not detects:
        raise ConfigError(
            f"training.on_spike {t.on_spike!r} with no spike check (training.spike_window 0, "
            "no spike_max_loss or spike_max_grad_norm); set one of them, or on_spike log"
        )
    if t.on_spike == "rewind" and cfg.fault_tolerance.enable:
        # The replica groups would have to load one checkpoint together, inside a quorum,
        # while torchft heals a group from a live peer's weights, not from a folder.
        raise ConfigError(
            "training.on_spike rewind is not available with fault_tolerance.enable (the "
            "replica groups would have to reload one checkpoint together); use on_spike "
            "skip_step, whose verdict the groups share through the committed gradients"
        )
    if t.on_spike == "rewind" and not cfg.checkpoint.enable_checkpoint:
        raise ConfigError(
            "training.on_spike rewind reloads a checkpoint, but checkpoint.enable_checkpoint "
            "is false; set --checkpoint.enable_checkpoint (and checkpoint.interval or "
            "local_interval to space the rewind points)"
        )


def parse_faults(text: str, rank: int) -> dict[int, str]:
    """{step: kind} of ``FAULT_ENV`` for this rank."""
    faults = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        spec, _, only = part.partition("@")
        step, _, kind = spec.partition(":")
        if only and int(only) != rank:
            continue
        faults[int(step)] = kind
    return faults


def _z_score(window: list[float], value: float) -> float:
    """How many (population) standard deviations ``value`` lies above the window's mean;
    0 for a window without spread."""
    n = len(window)
    mean = math.fsum(window) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in window) / n)
    return (value - mean) / std if std > 0 else 0.0


def documents_of(batches: list[dict], most: int = 6) -> str:
    """The documents of a rank's batches, ``source:doc_id``, in order, each once; the
    first ``most`` and how many more (the provenance files hold them all)."""
    seen: dict[str, None] = {}
    for batch in batches:
        for spans in batch.get("spans", []):
            for source, doc_id, *_ in spans:
                seen.setdefault(f"{source}:{doc_id}")
    names = list(seen)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class SpikeGuard(Adapter):
    """The verdict on each step, and its checkpointed state (the window, the counters)."""

    data_only = True

    def __init__(self, cfg, dims, train_state):
        t = cfg.training
        self.dims, self.train_state = dims, train_state
        self.max_bad_steps, self.window_size, self.sigma = (
            t.max_bad_steps, t.spike_window, t.spike_sigma)  # fmt: skip
        self.max_loss, self.max_grad_norm = t.spike_max_loss, t.spike_max_grad_norm
        self.on_spike = t.on_spike
        self.detects = t.spike_window > 0 or t.spike_max_loss > 0 or t.spike_max_grad_norm > 0
        self.losses: list[float] = []  # the window: the last applied steps' values
        self.grad_norms: list[float] = []
        self.bad_in_row = 0  # steps dropped in a row (broken, or skip_step spikes)
        self.spikes_in_row = False  # some of them were spikes
        # Events since the run began (kept across a rewind; saved with each checkpoint).
        self.counts = {"bad_steps": 0, "spikes": 0, "rewinds": 0}
        self.verdict = "apply"  # the last step's: apply | skip | rewind
        self.last_event: dict | None = None  # the last step's spike or broken step
        self.faults = parse_faults(os.environ.get(FAULT_ENV, ""), dims.rank)

    @property
    def next_step(self) -> int:
        """The training step being taken (the train state counts those done)."""
        return self.train_state.step + 1

    # ---- the test-only fault hook -------------------------------------------------------
    def faulted_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss as the fault hook makes it at this step (as is without one)."""
        kind = self.faults.get(self.next_step)
        if kind in ("nan", "inf"):
            return loss * float(kind)
        if kind == "nan_value":  # the value NaN, the gradient that of the loss
            return loss + (torch.full_like(loss, float("nan")) - loss.detach())
        if kind and kind.startswith("x"):
            return loss * float(kind[1:])
        return loss

    def faulted_gradients(self, model: torch.nn.Module):
        if self.faults.get(self.next_step) == "nan_grad":
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")

    # ---- the agreement ------------------------------------------------------------------
    @staticmethod
    def poisoned(loss: torch.Tensor, so_far: torch.Tensor) -> torch.Tensor:
        """The last micro-batch's ``loss``, times NaN where this rank's loss ``so_far`` is
        not finite (times 1.0, no bit changed, where it is): its gradients carry the
        verdict through the gradient reduction to every rank. No device sync."""
        if hasattr(loss, "to_local"):  # a DTensor (loss parallel): its peers agree already
            return loss
        return loss * torch.where(torch.isfinite(so_far), 1.0, float("nan")).to(loss.dtype)

    # ---- the verdict --------------------------------------------------------------------
    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor, batches: list[dict]) -> bool:
        """Whether to apply this step's update; sets ``verdict`` (apply, skip, rewind)."""
        step = self.next_step
        self.faults.pop(step, None)  # a fault fires once per process (a rewind retakes the step)
        norm = float(grad_norm)
        value = parallel.mean_on_control(self.dims, float(loss)) if self.detects else float(loss)
        self.last_event = None
        # The norm is the same on every rank, and so is the loss where it is the mean over
        # the ranks (with a spike check); a rank's own loss alone would not be.
        if not math.isfinite(norm) or (self.detects and not math.isfinite(value)):
            self.bad_in_row += 1
            self.counts["bad_steps"] += 1
            self.verdict = "skip"
            self.last_event = {"step": step, "kind": "non-finite", "loss": value,
                               "grad_norm": norm, "action": "skip"}  # fmt: skip
            logger.warning(
                "step %d: loss %s, gradient norm %s: its update is dropped on every rank (%d in "
                "a row; training.max_bad_steps %d); this rank's documents: %s",
                step, value, norm, self.bad_in_row, self.max_bad_steps, documents_of(batches),
            )  # fmt: skip
            return False
        why = self._spike(value, norm)
        self.verdict = "apply" if why is None else {"log": "apply", "skip_step": "skip",
                                                    "rewind": "rewind"}[self.on_spike]  # fmt: skip
        if self.verdict == "skip":
            self.bad_in_row += 1
            self.spikes_in_row = True
        elif self.verdict == "apply":
            self.bad_in_row, self.spikes_in_row = 0, False
        if why is None:
            self._remember(value, norm)
            return True
        self.counts["spikes"] += 1
        if self.verdict == "apply":  # the run trains on it: the window holds it too
            self._remember(value, norm)
        said = {"apply": "logged (training.on_spike log)", "skip": "its update is dropped",
                "rewind": "rewinding"}[self.verdict]  # fmt: skip
        self.last_event = {"step": step, "kind": "spike", "why": why, "loss": value,
                           "grad_norm": norm, "action": self.verdict}  # fmt: skip
        logger.warning("step %d: loss spike: %s; %s; this rank's documents: %s",
                       step, why, said, documents_of(batches))  # fmt: skip
        return self.verdict == "apply"

    def _spike(self, loss: float, norm: float) -> str | None:
        """Why this step is a spike, or None."""
        if self.max_loss and loss > self.max_loss:
            return f"loss {loss:.4f} > training.spike_max_loss {self.max_loss:g}"
        if self.max_grad_norm and norm > self.max_grad_norm:
            return f"gradient norm {norm:.4f} > training.spike_max_grad_norm {self.max_grad_norm:g}"
        if self.window_size and len(self.losses) >= self.window_size:
            for name, value, window in (("loss", loss, self.losses),
                                        ("gradient norm", norm, self.grad_norms)):  # fmt: skip
                z = _z_score(window, value)
                if z > self.sigma:
                    return (f"{name} {value:.4f} is {z:.1f} sigma above the mean of the last "
                            f"{len(window)} steps (training.spike_sigma {self.sigma:g})")  # fmt: skip
        return None

    def _remember(self, loss: float, norm: float):
        if self.window_size:
            self.losses = (self.losses + [loss])[-self.window_size :]
            self.grad_norms = (self.grad_norms + [norm])[-self.window_size :]

    def check_bad_steps(self):
        """Stop the job (every rank alike: the verdicts agree) after max_bad_steps in a row."""
        if self.bad_in_row >= self.max_bad_steps:
            step = self.train_state.step
            what = ("were dropped, broken or spikes under training.on_spike skip_step"
                    if self.spikes_in_row else "had a non-finite loss or gradient norm")  # fmt: skip
            raise TrainingError(
                f"steps {step - self.bad_in_row + 1}-{step} {what} ({self.bad_in_row} in a "
                f"row, training.max_bad_steps "
                f"{self.max_bad_steps}); none was applied, the weights are step "
                f"{step - self.bad_in_row}'s: lower --optimizer.lr or raise warmup, or resume "
                "from an earlier checkpoint with --training.skip_steps"
            )

    def count_rewinds(self, recorded: list[dict]):
        """Counters from the rewinds' records (checkpoint/rewinds.py) where they are ahead
        of the loaded checkpoint's (a requeue between a rewind and the next save): the
        counters only grow, so the larger is the job's."""
        for counts in recorded:
            for name, value in counts.items():
                if name in self.counts:
                    self.counts[name] = max(self.counts[name], value)

    def metrics(self) -> dict:
        """The counters, for the step's metrics."""
        return dict(self.counts)

    # ---- checkpointed state -------------------------------------------------------------
    def state_dict(self) -> dict:
        # The same on every rank (DCP keeps one copy); JSON floats read back bit-exact.
        return {"state": to_tensor({"losses": self.losses, "grad_norms": self.grad_norms,
                                    "bad_in_row": self.bad_in_row, "counts": self.counts,
                                    "spikes_in_row": self.spikes_in_row})}  # fmt: skip

    def load_targets(self, saved: Saved) -> dict | None:
        if "state" not in saved.entries:
            return None
        return {"state": empty_like_saved(saved.entries["state"])}

    def load_state_dict(self, state_dict: dict):
        saved = from_tensor(state_dict["state"])
        self.losses = (
            [float(v) for v in saved["losses"]][-self.window_size :] if self.window_size else []
        )
        self.grad_norms = (
            [float(v) for v in saved["grad_norms"]][-self.window_size :] if self.window_size else []
        )
        self.bad_in_row = int(saved["bad_in_row"])
        self.spikes_in_row = bool(saved.get("spikes_in_row", False))
        self.counts = {k: int(v) for k, v in saved["counts"].items()}
