"""Broken steps and loss spikes: what a step's loss and gradient norm say before its update.

Owns: the verdict on each step (``SpikeGuard.decide``, called by the step between the
gradient norm and the optimizer's update), made on the device: a non-finite loss or
gradient norm drops the update on every rank, and ``training.max_bad_steps`` dropped
steps in a row (broken, or spikes under ``on_spike skip_step``: a loss that moved for
good would be skipped for ever) stop the job in one line; the spike check (a trailing
window of ``training.spike_window`` applied steps, a z-score of ``training.spike_sigma``
once the window is full, and optional absolute bounds), and what a spike does
(``training.on_spike``: log, skip the step, or have the loop rewind); what the host
learns of each verdict, and when (``learn``); the guard's checkpointed state (the window
and the counters), so a resumed run checks as the uninterrupted one; and the test-only
fault hook (``FAULT_ENV``).

On the device, no host read: the window is a ``[2, spike_window]`` float64 tensor (losses,
norms; a fixed size, shifted in where a step is applied) with its fill count, the counters
a float64 vector; the verdict is a bool tensor the step hands to the optimizer
(step.update_unless_dropped: a fused optimizer's ``found_inf``). The host learns each
verdict, a float64 vector (``RECORD``), from a copy started with it
(``to("cpu", non_blocking=True)``: pinned memory and an event on a GPU; the tensor itself
on a CPU): a step later, once the next step's work is queued, without waiting for the
device; at once where it reads the device anyway (a log line stacks it with what it
logs) or must know before going on (a save, a stop). In time for its log line, the
``bad_steps`` count and a rewind: the step trained meanwhile, on the weights the dropped
update left, is undone by the rewind's load with the rest (so the lag costs a step of
compute, not exactness: the checkpoint is still at least ``rewind_steps`` before the
spike, and the skip, to the spike plus ``skip_after``, is the one an uninterrupted skip
list gives); ``max_bad_steps`` stops the job a step later (nothing is saved between:
a save learns first).

Agreement: the ranks decide alike without a collective of their own for the non-finite
case. A rank whose loss so far is not finite multiplies its last micro-batch's loss by
NaN (by 1.0 otherwise, which changes no bit), so its gradients are NaN; the gradient
reduction that already runs spreads them, and the gradient norm every rank computes is
NaN on every rank. The spike check reads the loss averaged over the ranks (an 8-byte
all-reduce on the training group, only with a spike check on: the device's stream
waits for it, not the host), and the gradient norm, the same on every rank.

A dropped step: the data is consumed (the loader moved on), the step counter and the
LR schedule advance as for any step, and the weights and the optimizer's moments and
step count stay as they were.

Cost: no device-to-host read on a step that logs nothing (none of its own on a log
step: its verdict rides in the log line's one read; a save reads the verdict and the
state, one read each); about 40 small device ops per step (0.35 ms of host time on a
CPU, 1.3 % of the debug model's step; launches on a GPU); the all-reduce above; the
window's O(spike_window) arithmetic on the device. Under pipeline parallelism it runs
on the host, where the pipeline hands it the loss and the norm (parallel/pipeline.py's
reads). The z-score sums each row in its order (float64): a verdict within an ulp of
``spike_sigma`` may differ from the host's exact sum of before, never between ranks.

Never: step the optimizer, pull batches, choose or load checkpoints (the loop rewinds
through the checkpoint manager), or write metrics files.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


# One step's verdict as the host learns it: a float64 vector (its counts are exact
# below 2**53), copied to the host in one piece.
RECORD = ("loss", "grad_norm", "broken", "why", "z", "applied", "bad_in_row",
          "spikes_in_row", "bad_steps", "spikes")  # fmt: skip
# ``why``: what made the step a spike (0: nothing), in the order the checks are tried.
NO_SPIKE, MAX_LOSS, MAX_GRAD_NORM, Z_LOSS, Z_NORM = range(5)


@dataclass
class _Queued:
    """A verdict the host has not learned yet."""

    step: int
    record: torch.Tensor  # RECORD, on the device
    host: torch.Tensor  # its copy on the host, started with it (on a CPU, the same tensor)
    copied: object  # the copy's CUDA event (None on a CPU)
    batches: list[dict]  # this rank's spans, for the log line

    def read(self, blocking: bool) -> list[float]:
        if blocking:  # the step's own, at once: a sync on a GPU
            return self.record.tolist()
        if self.copied is not None:  # queued a step ago: done, or nearly, by now
            self.copied.synchronize()
        return self.host.tolist()


class SpikeGuard(Adapter):
    """The verdict on each step, made on the device; what the host learns of it (a step
    later, or at once where it reads anyway); the checkpointed state (the window, the
    counters)."""

    data_only = True

    def __init__(self, cfg, dims, train_state):
        t = cfg.training
        self.dims, self.train_state = dims, train_state
        self.max_bad_steps, self.window_size, self.sigma = (
            t.max_bad_steps, t.spike_window, t.spike_sigma)  # fmt: skip
        self.max_loss, self.max_grad_norm = t.spike_max_loss, t.spike_max_grad_norm
        self.on_spike = t.on_spike
        self.detects = t.spike_window > 0 or t.spike_max_loss > 0 or t.spike_max_grad_norm > 0
        # Under pipeline parallelism the loss and the norm reach every stage as host
        # tensors (parallel/pipeline.py reads them for its gloo group): decided there, no
        # round trip; the fused optimizer takes the flag to its device itself. (The
        # string "cpu" names the host; a torch.device, where training computes.)
        self.device = "cpu" if dims.pp > 1 else dims.device
        # On the device, where the steps decide: the window of the last applied steps'
        # values (row 0 losses, row 1 gradient norms; oldest first, its last ``_filled``
        # columns steps) and the counters (bad_in_row, spikes_in_row, bad_steps, spikes).
        self._window = torch.zeros(2, max(1, self.window_size), dtype=torch.float64,
                                   device=self.device)  # fmt: skip
        self._filled = torch.zeros((), dtype=torch.float64, device=self.device)
        self._counters = torch.zeros(4, dtype=torch.float64, device=self.device)
        self._queued: deque[_Queued] = deque()
        # On the host: what it has learned, as of step ``learned_step``.
        self.learned_step = 0
        self.bad_in_row = 0  # steps dropped in a row (broken, or skip_step spikes)
        self.spikes_in_row = False  # some of them were spikes
        # Events since the run began (kept across a rewind; saved with each checkpoint).
        self._counts = {"bad_steps": 0, "spikes": 0, "rewinds": 0}
        self.verdict = "apply"  # the last learned step's: apply | skip | rewind
        self.last_event: dict | None = None  # the last learned step's spike or broken step
        self.events: list[dict] = []  # those not yet written (``take_events``)
        self.rewind_at: int | None = None  # a spike under on_spike rewind, to act on
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

    # ---- the verdict, on the device -----------------------------------------------------
    def decide(self, loss: torch.Tensor, grad_norm: torch.Tensor, batches: list[dict]):
        """Whether to apply this step's update: a bool tensor on the device, for the
        optimizer as it is (no host read). The verdict is queued for the host, its copy
        to the host started (``learn`` reads it)."""
        step = self.next_step
        self.faults.pop(step, None)  # a fault fires once per process (a rewind retakes the step)
        value = loss.detach().to(self.device, torch.float64, copy=True).reshape(())
        if self.detects and self.dims.world_size > 1 and dist.is_initialized():
            # The mean over the ranks, on the training group: the stream waits, not the host.
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            # mutant guard-sum-not-mean: `value / self.dims.world_size` -> `value`; test/test_spikes.py::test_two_ranks_whose_losses_differ_reach_one_verdict
            value = value / self.dims.world_size
        norm = grad_norm.detach().to(self.device, torch.float64).reshape(())
        stats = torch.stack([value, norm])
        # The norm is the same on every rank, and so is the loss where it is the mean over
        # the ranks (with a spike check); a rank's own loss alone would not be.
        finite = torch.isfinite(stats)
        broken = ~(finite.all() if self.detects else finite[1])
        why, z = self._spike(stats)
        spike = (why > 0) & ~broken
        applied = ~broken if self.on_spike == "log" else ~broken & ~spike
        bad, in_row, bad_steps, spikes = self._counters.unbind()
        if self.on_spike == "skip_step":  # a skipped spike counts in a row, as a broken step
            bad = torch.where(broken | spike, bad + 1, torch.where(applied, 0.0, bad))
            in_row = torch.where(spike, 1.0, torch.where(applied, 0.0, in_row))
        else:  # a rewind's spike leaves them (the rewind loads them)
            bad = torch.where(broken, bad + 1, torch.where(applied, 0.0, bad))
            in_row = torch.where(applied, 0.0, in_row)
        self._counters = torch.stack([bad, in_row, bad_steps + broken, spikes + spike])
        if self.window_size:  # the applied step's values join the window (a spike under log too)
            shifted = torch.cat([self._window[:, 1:], stats[:, None]], 1)
            self._window = torch.where(applied, shifted, self._window)
            grown = (self._filled + 1).clamp(max=self.window_size)
            self._filled = torch.where(applied, grown, self._filled)
        flags = torch.stack([broken.to(torch.float64), why, z, applied.to(torch.float64)])
        record = torch.cat([stats, flags, self._counters])  # RECORD's order
        copied = None
        host = record.to("cpu", non_blocking=True)  # pinned memory on a GPU
        if record.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        spans = [{"spans": b.get("spans", [])} for b in batches]
        self._queued.append(_Queued(step, record, host, copied, spans))
        return applied

    def _spike(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Why a step of ``stats`` (loss, norm) is a spike (``why``, 0: it is not) and the
        z-score that made it one, on the device; the checks are tried in the order of the
        codes. The z-score: how many (population) standard deviations above the window's
        mean (float64, each row summed in its order; 0 for a row without spread)."""
        why = torch.zeros((), dtype=torch.float64, device=self.device)
        z = why
        if self.window_size:
            mean = self._window.mean(1)
            std = (self._window - mean[:, None]).square().mean(1).sqrt()
            scores = torch.where(std > 0, (stats - mean) / std, 0.0)
            # mutant guard-checks-while-filling: `(self._filled >= self.window_size)` -> `(self._filled >= 0)`; test/test_spikes.py::test_a_spike_is_seen_after_the_window_fills
            over = (scores > self.sigma) & (self._filled >= self.window_size)
            why = torch.where(over[1], float(Z_NORM), why)
            why = torch.where(over[0], float(Z_LOSS), why)
            z = torch.where(over[0], scores[0], scores[1])
        if self.max_grad_norm:
            why = torch.where(stats[1] > self.max_grad_norm, float(MAX_GRAD_NORM), why)
        if self.max_loss:
            why = torch.where(stats[0] > self.max_loss, float(MAX_LOSS), why)
        return why, z

    # ---- what the host learns -----------------------------------------------------------
    def newest(self, step: int) -> torch.Tensor | None:
        """Step ``step``'s verdict (RECORD, on the device) if the host has not learned it:
        for a caller that reads the device anyway (a log line) to read with its own."""
        last = self._queued[-1] if self._queued else None
        return last.record if last is not None and last.step == step else None

    def learn(self, step: int, now: bool = False, newest: list[float] | None = None):
        """Learn the verdicts of the steps before ``step`` from their copies (started a
        step ago: no wait for the device on this step's work) and, ``now``, ``step``'s
        own: ``newest`` (what a caller read with its own values) or a blocking read (a
        save or a stop is next: one sync). Logs each broken step and spike; stops at a
        spike under on_spike rewind (``rewind_at``: the loop rewinds) or at
        max_bad_steps in a row (``check_bad_steps`` raises), forgetting the later
        verdicts (steps the rewind undoes, or that never count)."""
        while self._queued and self._queued[0].step <= step - (not now):
            queued = self._queued.popleft()
            own = now and queued.step == step
            values = newest if own and newest is not None else queued.read(blocking=own)
            if self._learn(queued.step, dict(zip(RECORD, values)), queued.batches):
                self._queued.clear()

    def _learn(self, step: int, r: dict, batches: list[dict]) -> bool:
        """One verdict; True where it stops the steps after it (a rewind, or the stop)."""
        self.learned_step = step
        self.bad_in_row, self.spikes_in_row = int(r["bad_in_row"]), bool(r["spikes_in_row"])
        self._counts.update(bad_steps=int(r["bad_steps"]), spikes=int(r["spikes"]))
        value, norm = r["loss"], r["grad_norm"]
        self.last_event = None
        if r["broken"]:
            self.verdict = "skip"
            self.last_event = {"step": step, "kind": "non-finite", "loss": value,
                               "grad_norm": norm, "action": "skip"}  # fmt: skip
            logger.warning(
                "step %d: loss %s, gradient norm %s: its update is dropped on every rank (%d in "
                "a row; training.max_bad_steps %d); this rank's documents: %s",
                step, value, norm, self.bad_in_row, self.max_bad_steps, documents_of(batches),
            )  # fmt: skip
        elif r["why"]:
            why = self._why(int(r["why"]), value, norm, r["z"])
            self.verdict = {"log": "apply", "skip_step": "skip", "rewind": "rewind"}[self.on_spike]
            said = {"apply": "logged (training.on_spike log)", "skip": "its update is dropped",
                    "rewind": "rewinding"}[self.verdict]  # fmt: skip
            self.last_event = {"step": step, "kind": "spike", "why": why, "loss": value,
                               "grad_norm": norm, "action": self.verdict}  # fmt: skip
            logger.warning("step %d: loss spike: %s; %s; this rank's documents: %s",
                           step, why, said, documents_of(batches))  # fmt: skip
        else:
            self.verdict = "apply"
        if self.last_event is not None:
            self.events.append(self.last_event)
        if self.verdict == "rewind":
            self.rewind_at = step
            return True
        return self.bad_in_row >= self.max_bad_steps

    def _why(self, code: int, loss: float, norm: float, z: float) -> str:
        if code == MAX_LOSS:
            return f"loss {loss:.4f} > training.spike_max_loss {self.max_loss:g}"
        if code == MAX_GRAD_NORM:
            return f"gradient norm {norm:.4f} > training.spike_max_grad_norm {self.max_grad_norm:g}"
        name, value = ("loss", loss) if code == Z_LOSS else ("gradient norm", norm)
        return (f"{name} {value:.4f} is {z:.1f} sigma above the mean of the last "
                f"{self.window_size} steps (training.spike_sigma {self.sigma:g})")  # fmt: skip

    def take_events(self) -> list[dict]:
        """The broken steps and spikes learned since the last call, in order."""
        events, self.events = self.events, []
        return events

    def check_bad_steps(self):
        """Stop the job (every rank alike: the verdicts agree) after max_bad_steps in a row."""
        if self.bad_in_row >= self.max_bad_steps:
            step = self.learned_step
            what = ("were dropped, broken or spikes under training.on_spike skip_step"
                    if self.spikes_in_row else "had a non-finite loss or gradient norm")  # fmt: skip
            raise TrainingError(
                f"steps {step - self.bad_in_row + 1}-{step} {what} ({self.bad_in_row} in a "
                f"row, training.max_bad_steps "
                f"{self.max_bad_steps}); none was applied, the weights are step "
                f"{step - self.bad_in_row}'s: lower --optimizer.lr or raise warmup, or resume "
                "from an earlier checkpoint with --training.skip_steps"
            )

    # ---- the counters -------------------------------------------------------------------
    @property
    def counts(self) -> dict:
        """Events since the run began, as the host last learned them."""
        return dict(self._counts)

    @counts.setter
    def counts(self, counts: dict):
        """Set on the host and the device alike (after a load: a rewind, a resume)."""
        self._counts = {name: int(counts.get(name, 0)) for name in self._counts}
        learned = torch.tensor([self._counts["bad_steps"], self._counts["spikes"]],
                               dtype=torch.float64)  # fmt: skip
        self._counters = torch.cat([self._counters[:2], learned.to(self.device)])

    def count_rewinds(self, recorded: list[dict]):
        """Counters from the rewinds' records (checkpoint/rewinds.py) where they are ahead
        of the loaded checkpoint's (a requeue between a rewind and the next save): the
        counters only grow, so the larger is the job's."""
        counts = self.counts
        for record in recorded:
            for name, value in record.items():
                if name in counts:
                    # mutant guard-counters-overwritten: `max(counts[name], value)` -> `value`; test/test_spikes.py::test_the_rewinds_records_raise_the_loaded_counters_and_never_lower_them
                    counts[name] = max(counts[name], value)
        self.counts = counts

    def metrics(self) -> dict:
        """The counters, for the step's metrics."""
        return self.counts

    @property
    def losses(self) -> list[float]:
        """The window's losses, oldest first (a host read: for tests)."""
        return self._read_state()[0]

    def _read_state(self) -> tuple[list[float], list[float], list[float]]:
        """The device's state as of the last step decided, in one read: the window's
        losses and gradient norms, oldest first, and the counters."""
        size = self.window_size
        values = torch.cat([self._filled.reshape(1), self._counters, self._window[0],
                            self._window[1]]).tolist()  # fmt: skip
        n = int(values[0])
        rows = [values[5 : 5 + max(1, size)], values[5 + max(1, size) :]]
        losses, norms = [row[len(row) - n :] for row in rows] if size and n else ([], [])
        return losses, norms, values[1:5]

    # ---- checkpointed state -------------------------------------------------------------
    def state_dict(self) -> dict:
        # The device's state (one read: a save's sync), the same on every rank (DCP keeps
        # one copy); JSON floats read back bit-exact.
        losses, grad_norms, (bad_in_row, spikes_in_row, bad_steps, spikes) = self._read_state()
        counts = {"bad_steps": int(bad_steps), "spikes": int(spikes),
                  "rewinds": self._counts["rewinds"]}  # fmt: skip
        return {"state": to_tensor({"losses": losses, "grad_norms": grad_norms,
                                    "bad_in_row": int(bad_in_row), "counts": counts,
                                    "spikes_in_row": bool(spikes_in_row)})}  # fmt: skip

    def load_targets(self, saved: Saved) -> dict | None:
        if "state" not in saved.entries:
            return None
        return {"state": empty_like_saved(saved.entries["state"])}

    def load_state_dict(self, state_dict: dict):
        saved = from_tensor(state_dict["state"])
        size = self.window_size
        losses = [float(v) for v in saved["losses"]][-size:] if size else []
        norms = [float(v) for v in saved["grad_norms"]][-size:] if size else []
        window = torch.zeros(2, max(1, size), dtype=torch.float64)
        if losses:
            window[:, size - len(losses) :] = torch.tensor([losses, norms], dtype=torch.float64)
        self._window = window.to(self.device)
        self._filled = torch.tensor(float(len(losses)), dtype=torch.float64, device=self.device)
        self.bad_in_row = int(saved["bad_in_row"])
        self.spikes_in_row = bool(saved.get("spikes_in_row", False))
        # mutant guard-row-restored-as-0: `[self.bad_in_row, self.spikes_in_row, 0, 0]` -> `[0, self.spikes_in_row, 0, 0]`; test/test_spikes.py::test_a_guard_loaded_in_a_run_of_dropped_steps_stops_when_the_uninterrupted_one_does
        self._counters = torch.tensor([self.bad_in_row, self.spikes_in_row, 0, 0],
                                      dtype=torch.float64, device=self.device)  # fmt: skip
        self.counts = {k: int(v) for k, v in saved["counts"].items()}
        # A new timeline: the verdicts not learned belong to steps it undoes.
        self._queued.clear()
        self.verdict, self.last_event, self.events, self.rewind_at = "apply", None, [], None
