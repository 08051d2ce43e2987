"""One optimizer step over micro-batches, and the held-out loss, for a built model.

Owns: the loss of one batch (inputs to the device, block-causal positions and document
ids, the labels that count under ``training.mask_document_boundaries``, autocast where
FSDP does not cast), gradient accumulation with the loss scaled so that the gradient is
the one big batch's (normalized by the labels that count over all micro-batches and
ranks when boundaries are masked), clipping and the optimizer and schedule step
(`TrainStep`); the validation pass over held-out data (`Validator`); and the
throughput figures logged with them (tokens/s per rank, MFU).

Never: pull training batches (the loop hands them over, so what a step consumed is
what the checkpoint records), save checkpoints, or write logs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchtitan import parallel, tensor_parallel
from torchtitan.data import build_dataloader

logger = logging.getLogger("torchtitan")

# Dense bf16 peak TFLOP/s of one device, from the vendor datasheets (half the
# with-sparsity figure where only that is given), keyed by the model tokens of
# torch.cuda.get_device_name(): "NVIDIA A100-SXM4-80GB" has the tokens NVIDIA, A100,
# SXM4, 80GB. Tokens match whole, so an L40 is not an L4 and an RTX A1000 not an A100;
# the key with the most tokens wins, so an H100 NVL or PCIe is not read as the SXM part
# that a bare H100 names.
PEAK_BF16_TFLOPS = {
    ("H100",): 989.5,  # SXM5, which reports itself as "H100 80GB HBM3"
    ("H100", "PCIE"): 756.0,
    ("H100", "NVL"): 835.5,
    ("H200",): 989.5,
    ("H200", "NVL"): 835.5,
    ("GH200",): 989.5,
    ("A100",): 312.0,  # SXM4 and PCIe alike
    ("A10",): 125.0,
    ("A10G",): 125.0,
    ("L40S",): 362.05,
    ("L40",): 181.05,
    ("L4",): 121.0,
}


def peak_tflops(cfg, device: torch.device) -> float:
    """metrics.peak_tflops, else the known figure of this GPU; 0 when unknown (no MFU)."""
    if cfg.metrics.peak_tflops > 0:
        return cfg.metrics.peak_tflops
    if device.type != "cuda":
        return 0.0
    return device_peak_tflops(torch.cuda.get_device_name(device))


def device_peak_tflops(name: str) -> float:
    """The PEAK_BF16_TFLOPS entry of the most specific key all of whose tokens are in
    ``name``; 0 for a device not in the table."""
    tokens = set(re.split(r"[\s_-]+", name.upper()))
    keys = [key for key in PEAK_BF16_TFLOPS if tokens.issuperset(key)]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] if keys else 0.0


# The label value F.cross_entropy ignores (its default ignore_index).
IGNORE_INDEX = -100


# The fp32 log-probabilities of one cross-entropy call stay under this many bytes: the
# loss runs over chunks of rows. On CPU a chunk then stays under glibc's mmap threshold
# (32 MiB at most), so its buffers come from the heap and are reused every step instead
# of being mapped and zero-filled afresh (8 K page faults per 32 MiB: 1.2 % of the
# benchmark step); on a GPU it bounds the fp32 copy of bf16 logits (a 128 K vocabulary
# at 64 K tokens would be 33 GB at once).
LOSS_CHUNK_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}


def _cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str, chunk_bytes: int
) -> torch.Tensor:
    """Summed, or averaged over the labels that count, next-token loss of [B, T, V] logits."""
    flat, target = logits.flatten(0, 1), labels.flatten()
    rows = max(1, chunk_bytes // (4 * flat.shape[1]))
    total = sum(
        F.cross_entropy(part.float(), part_target, reduction="sum")
        for part, part_target in zip(flat.split(rows), target.split(rows))
    )
    if reduction == "sum":
        return total
    return total / (target != IGNORE_INDEX).sum()


class BatchLoss:
    """The next-token loss of one batch, as training and validation both compute it."""

    def __init__(self, cfg, model: torch.nn.Module, dims: parallel.ParallelDims):
        self.model = model
        self.device = dims.device
        self.world_size = dims.world_size
        self.block_causal = cfg.model.attention_mask == "block_causal"
        self.mask_boundaries = cfg.training.mask_document_boundaries
        dtype = parallel.compute_dtype(cfg, dims.device)
        # FSDP casts parameters itself (MixedPrecisionPolicy); elsewhere autocast does.
        self.autocast = dtype != torch.float32 and not parallel.is_fsdp(model)
        self.dtype = dtype
        # Loss parallel: cross-entropy over vocabulary-sharded logits, in its context,
        # over the whole batch at once (the row chunks are for plain tensors).
        self.context = lambda: tensor_parallel.loss_context(model)
        self.loss_parallel = getattr(model, "loss_parallel", False)
        self.chunk_bytes = LOSS_CHUNK_BYTES.get(dims.device.type, LOSS_CHUNK_BYTES["cuda"])
        if self.loss_parallel:
            self.chunk_bytes = 1 << 62
        compiled = cfg.training.compile and not self.loss_parallel
        self.cross_entropy = torch.compile(_cross_entropy) if compiled else _cross_entropy

    def counted(self, batch: dict) -> int:
        """How many of the batch's labels count (read on the host: no device sync)."""
        if not self.mask_boundaries:
            return batch["label"].numel()
        return int((batch["label_document_ids"] == batch["document_ids"]).sum())

    def labels(self, batch: dict) -> torch.Tensor:
        """The batch's labels (on the host), those that do not count set to be ignored."""
        if not self.mask_boundaries:
            return batch["label"]
        # A document's last token predicting the next document's first: no signal.
        crossing = batch["label_document_ids"] != batch["document_ids"]
        return batch["label"].masked_fill(crossing, IGNORE_INDEX)

    def __call__(self, batch: dict, normalizer: float | None = None) -> torch.Tensor:
        """The mean loss over the labels that count; with ``normalizer``, their summed
        loss divided by it."""
        inputs = batch["input"].to(self.device, non_blocking=True)
        labels = self.labels(batch).to(self.device, non_blocking=True)
        autocast = (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.autocast
            else contextlib.nullcontext()
        )
        with autocast:
            if self.block_causal:
                # The document ids stay on the host: the sdpa and varlen masks are
                # computed there without a device sync (flex moves them itself).
                positions = batch["positions"].to(self.device, non_blocking=True)
                logits = self.model(inputs, positions, batch["document_ids"])
            else:
                logits = self.model(inputs)
        if normalizer is None:
            return self.cross_entropy(logits, labels, "mean", self.chunk_bytes)
        return self.cross_entropy(logits, labels, "sum", self.chunk_bytes) / normalizer


class TrainStep:
    """Forward and backward over a step's micro-batches, then one optimizer update."""

    def __init__(self, cfg, model, optimizer, scheduler, loss: BatchLoss, before_update: Callable,
                 commit: Callable | None = None):  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
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
        for i, batch in enumerate(batches):
            with parallel.gradient_sync(self.model, enabled=i == len(batches) - 1):
                with self.loss.context():
                    if normalizer is None:
                        loss = self.loss(batch) * batch.get("loss_weight", 1 / len(batches))
                    else:
                        loss = self.loss(batch, normalizer)
                    loss.backward()
            total += tensor_parallel.local_value(loss.detach())
        if self.commit is not None and not self.commit(total):
            self.optimizer.zero_grad(set_to_none=True)  # not committed: nothing was updated
            return None, None, None
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.max_norm, foreach=True
        )
        self.before_update()
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        return total, grad_norm, lr


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
                 pipeline, dims: parallel.ParallelDims, feed):  # fmt: skip
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
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
        return (
            self.loss.cross_entropy(logits, labels, reduction, self.loss.chunk_bytes) / self._scale
        )

    def __call__(self, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor, float]:
        from torchtitan import pipeline as pp

        pl = self.pipeline
        sequences = self.feed.last_global_batch // self.dp_world
        count = pp.micro_batches(sequences, pl.microbatch_size, len(pl.stages) * pl.pp,
                                 pl.schedule)  # fmt: skip
        labels = inputs = None
        counted = 0
        if pl.first:
            inputs = torch.cat([b["input"] for b in batches]).to(self.device)
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
            runner.step(target=labels.to(self.device), losses=losses, return_outputs=False)
        else:
            runner.step(return_outputs=False)
        total = (
            torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        )
        loss = pp.from_last(pl, total)
        grad_norm = pp.clip_grad_norm(list(self.model.parameters()), self.max_norm, pl)
        self.before_update()
        self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, lr


class Validator:
    """The loss on held-out data: the same first ``validation.steps`` batches every time.

    Each pass rewinds its own loader to the start, runs the model in eval mode (no
    dropout) without gradients, and touches neither the training loader nor any RNG,
    so a resumed run logs the same validation losses as an uninterrupted one.
    """

    def __init__(self, cfg, tokenizer, dims: parallel.ParallelDims, loss: BatchLoss):
        v = cfg.validation
        held_out = copy.deepcopy(cfg)
        t = held_out.training
        t.dataset, t.dataset_path, t.datasets = v.dataset, v.dataset_path, []
        t.dataset_config, t.dataset_split = v.dataset_config, v.dataset_split
        # Fixed data, read in order by the main process: nothing random, nothing that
        # depends on the training stream.
        t.shuffle, t.num_workers = False, 0
        t.global_batch_size, t.batch_size_schedule = 0, ""  # one micro-batch per rank
        self.loader = build_dataloader(held_out, tokenizer, dims.dp_rank, dims.dp_world)
        self.freq, self.steps = v.freq, v.steps
        self.loss = loss
        self.dims = dims

    def due(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> float:
        """The mean loss over every rank's ``validation.steps`` batches.

        Cost: steps x (one forward of a batch); the loader seeks to the start, O(1)."""
        self.loader.seek()
        model.eval()
        try:
            with self.loss.context():
                total = sum(
                    tensor_parallel.local_value(self.loss(next(self.loader)))
                    for _ in range(self.steps)
                )
        finally:
            model.train()
        return parallel.mean_over_ranks(total / self.steps)
