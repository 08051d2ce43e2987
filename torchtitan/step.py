"""One optimizer step over micro-batches, for a built model.

Owns: gradient accumulation with the loss (loss.py) scaled so that the gradient is the
one big batch's (normalized by the labels that count over all micro-batches and ranks
when boundaries are masked), clipping, the guard's verdict on the update (spikes.py: a broken step or a spike
is not applied, by a device flag: no host read) and the optimizer and schedule step (`TrainStep`), and the same under pipeline parallelism (`PipelineStep`).

Never: pull training batches (the loop hands them over, so what a step consumed is
what the checkpoint records), save checkpoints, or write logs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan import parallel
from torchtitan.loss import BatchLoss
from torchtitan.parallel import tensor_parallel

__all__ = ["BatchLoss", "PipelineStep", "TrainStep"]  # BatchLoss: loss.py's, as before


# The environment variable that runs a training's steady steps (neither logging nor
# saving) under torch.cuda.set_sync_debug_mode ("warn" or "error"): train.sync_debug.
SYNC_DEBUG_ENV = "TORCHTITAN_SYNC_DEBUG"


class TrainStep:
    """Forward and backward over a step's micro-batches, then one optimizer update."""

    def __init__(self, cfg, model, optimizer, scheduler, loss: BatchLoss, before_update: Callable,
                 commit: Callable | None = None, guard=None):  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # spikes.SpikeGuard: whether the update is applied (a broken step or a spike is not).
        self.guard = guard
        self.loss = loss
        self.max_norm = cfg.training.max_norm
        self.before_update = before_update  # e.g. wait for an async save's staging copy
        # Fault tolerance (fault_tolerance.ReplicaGroup.commit): averages the gradients
        # and the loss over the replica groups; False drops the step.
        self.commit = commit

    def __call__(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(mean loss over the micro-batches, gradient norm, lr used) of one step; all
        None when ``commit`` dropped it.

        Each micro-batch's mean loss is scaled by its ``loss_weight`` (ranks x its
        sequences / the global batch; the loader sets it), so the gradient averaged over
        the ranks is that of the mean over the whole global batch, however unevenly its
        sequences fell on ranks and micro-batches.
        With document boundaries masked, micro-batches hold different numbers of labels
        that count: each one's summed loss is divided by the count over all micro-batches
        and ranks (one all-reduce of an integer per step), times the ranks that the
        gradient reduction averages over, so the gradient is that of the mean over every
        label that counts in the global batch, however it is split.
        """
        normalizer = None
        if self.loss.mask_boundaries:
            counted = parallel.sum_over_ranks(sum(self.loss.counted(b) for b in batches))
            normalizer = max(1, counted) / self.loss.world_size
        total = torch.zeros((), device=self.loss.device)
        guard = self.guard
        # Every micro-batch's copies to the device issued now: each on its way while the
        # ones before it run (loss.DeviceCopies).
        batches = [self.loss.send(b) for b in batches]
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with parallel.gradient_sync(self.model, enabled=last):
                with self.loss.context():
                    if normalizer is None:
                        loss = self.loss(batch) * batch.get("loss_weight", 1 / len(batches))
                    else:
                        loss = self.loss(batch, normalizer)
                    if guard is not None:
                        loss = guard.faulted_loss(loss)
                        if last:  # a rank's non-finite loss reaches every rank (spikes.py)
                            so_far = total + tensor_parallel.local_value(loss.detach())
                            loss = guard.poisoned(loss, so_far)
                    loss.backward()
            total += tensor_parallel.local_value(loss.detach())
        if self.commit is not None and not self.commit(total):
            self.optimizer.zero_grad(set_to_none=True)  # not committed: nothing was updated
            forget_expert_loads(self.model)
            return None, None, None
        if guard is not None:
            guard.faulted_gradients(self.model)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.max_norm, foreach=True
        )
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        ok = None if guard is None else guard.decide(total, grad_norm, batches)
        self.before_update()
        update_unless_dropped(self.optimizer, ok)
        # mutant dropped-step-moves-experts: `balance_experts(self.model, ok)` -> `balance_experts(self.model)`; test/models/test_moe.py::test_a_dropped_step_leaves_the_balancing_state_where_it_was
        balance_experts(self.model, ok)  # the experts' bias moves with an applied step only
        # A dropped step still counts: the schedule moves on with the step counter and the
        # data (spikes.py).
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, grad_norm, lr


def update_unless_dropped(optimizer: torch.optim.Optimizer, ok: torch.Tensor | bool | None):
    """``optimizer.step()`` where the guard's device flag ``ok`` holds (None or True:
    always), and where it does not, weights, moments and step count left exactly as they
    were, without a host read. A fused optimizer (optim.py builds AdamW and Adam fused)
    takes it as ``found_inf``, GradScaler's way: its kernel returns before touching a
    weight or a moment, and the step count, +1 then -found_inf, is exact; cost: none (a
    first step dropped creates the moments, zeros at step 0, as an applied one would
    before its update). Another (SGD): apply, then ``torch.where(ok, new, old)`` over the
    parameters and the tensors of the state it had; cost: a copy of both per step."""
    if ok is None or ok is True:
        optimizer.step()
        return
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = (~ok).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = [(t, t.detach().clone()) for p in params
              for t in (p, *(v for v in optimizer.state.get(p, {}).values()
                             if isinstance(v, torch.Tensor)))]  # fmt: skip
    had = {(id(p), k) for p in params for k in optimizer.state.get(p, {})}
    optimizer.step()
    with torch.no_grad():
        for t, old in before:
            t.copy_(torch.where(ok, t, old))
        # State the step created (a first step: Muon's momentum, its AdamW part's moments
        # and step) goes back to what creating it gives, zeros, where the step is dropped:
        # a NaN kept there would poison every later step.
        for p in params:
            for k, v in optimizer.state.get(p, {}).items():
                if (id(p), k) not in had and isinstance(v, torch.Tensor):
                    v.copy_(torch.where(ok, v, torch.zeros_like(v)))


def balance_experts(model: torch.nn.Module, ok: torch.Tensor | None = None):
    """A mixture of experts' balancing update, after the optimizer step: each layer's
    tokens per expert in this step, summed over all ranks (every rank is a data-parallel
    rank: MoE refuses TP and PP), given to every rank's model alike, so every rank's bias
    stays the same; zeros where the guard's ``ok`` drops the step (the bias and the
    counts move by exactly 0; its log line shows no load). Nothing for a dense model.
    Cost: one all-reduce of layers x experts integers per step."""
    inner = getattr(model, "module", model)  # DDP's
    loads = inner.expert_loads() if hasattr(inner, "expert_loads") else None
    if loads is not None:
        loads = parallel.sum_tensor_over_ranks(loads)
        inner.balance_experts(loads if ok is None else loads * ok)


def forget_expert_loads(model: torch.nn.Module):
    inner = getattr(model, "module", model)
    if hasattr(inner, "forget_expert_loads"):
        inner.forget_expert_loads()


class PipelineStep:
    """One optimizer step under pipeline parallelism (pipeline.py): the schedule runs the
    step's micro-batches through the stages; the loss is computed on the last stage and
    given to every stage; the gradients of all stages are clipped together.

    The first stage joins the loader's micro-batches into the data-parallel rank's batch
    of the step, which the schedule cuts into ``pipeline_parallel_microbatch_size``
    sequences each; the labels (masked where boundaries are) go to the last stage. Each
    micro-batch's mean loss is weighted 1 / micro-batches, so the gradient is that of the
    batch's mean, as without a pipeline; with document boundaries masked, its summed
    loss is divided by the labels that count over all data-parallel ranks (one
    all-reduce of an integer, as ``TrainStep``).
    """

    def __init__(self, cfg, model, optimizer, scheduler, loss: BatchLoss, before_update: Callable,
                 pipeline, dims: parallel.ParallelDims, feed, guard=None):  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.guard = guard
        self.loss, self.pipeline, self.feed = loss, pipeline, feed
        self.max_norm = cfg.training.max_norm
        self.before_update = before_update
        self.seq_len, self.dp_world = cfg.training.seq_len, dims.dp_world
        self.device = dims.device
        self._scale = 1.0  # the loss of a micro-batch is divided by it (set per step)
        self._summed = False

    def micro_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, weighted for the step."""
        reduction = "sum" if self._summed else "mean"
        loss = (
            self.loss.cross_entropy(logits, labels, reduction, self.loss.chunk_bytes) / self._scale
        )
        # The test-only fault hook, as TrainStep's: here, where the loss is made (the last
        # stage); every stage then holds the faulted loss (from_last) and the gradients it
        # sent back, so the guard's verdict is the same on every stage.
        return loss if self.guard is None else self.guard.faulted_loss(loss)

    def __call__(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, float]:
        from torchtitan.parallel import pipeline as pp

        pl = self.pipeline
        sequences = self.feed.last_global_batch // self.dp_world
        count = pp.micro_batches(sequences, pl.microbatch_size, len(pl.stages) * pl.pp,
                                 pl.schedule)  # fmt: skip
        labels = inputs = None
        counted = 0
        if pl.first:
            inputs = self.loss.copies({"input": torch.cat([b["input"] for b in batches])})["input"]
            labels = torch.cat([self.loss.labels(b) for b in batches]).to(torch.int64)
            counted = sum(self.loss.counted(b) for b in batches)
        labels = pp.send_to_last(pl, labels, (sequences, self.seq_len), torch.int64)
        self._summed = self.loss.mask_boundaries
        if self._summed:  # every rank takes part; only first stages count their labels
            self._scale = max(1, parallel.sum_over_ranks(counted)) / self.dp_world
        else:
            self._scale = float(count)
        runner = pl.runner(count, self.micro_loss)
        losses: list[torch.Tensor] = []
        if pl.first:
            runner.step(inputs, return_outputs=False)
        elif pl.last:
            target = self.loss.copies({"label": labels})["label"]
            runner.step(target=target, losses=losses, return_outputs=False)
        else:
            runner.step(return_outputs=False)
        total = (
            torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        )
        loss = pp.from_last(pl, total)
        if self.guard is not None:  # a stage's planted NaN gradient: in the norm of all stages
            self.guard.faulted_gradients(self.model)
        grad_norm = pp.clip_grad_norm(list(self.model.parameters()), self.max_norm, pl)
        lr = self.scheduler.get_last_lr()[0]
        # Every stage holds the last stage's loss and the norm over all stages: they agree.
        ok = None if self.guard is None else self.guard.decide(loss, grad_norm, batches)
        self.before_update()
        update_unless_dropped(self.optimizer, ok)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, lr
