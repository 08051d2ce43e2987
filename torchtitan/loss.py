"""The next-token loss of one batch, as training and validation both compute it.

Owns: the inputs moved to the device (``DeviceCopies``: pinned host memory and
non-blocking copies on a stream of their own, a step's micro-batches all issued when it
starts), block-causal positions and document ids, the labels that count under
``training.mask_document_boundaries``, autocast where FSDP does not cast, and the
cross-entropy over row chunks (``BatchLoss``).

Never: step the optimizer, pull batches, or write logs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from torchtitan import parallel
from torchtitan.parallel import tensor_parallel

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


class DeviceCopies:
    """A batch's tensors on their way to the device, without the host waiting.

    On a GPU each tensor the device computes with is copied into pinned (page-locked)
    host memory, then to the device with ``non_blocking`` on a copy stream of its own; the
    compute stream waits for that stream (an event, not the host), and each copy is
    marked used by the compute stream so its memory is not reused before the step is
    done with it. A step issues its micro-batches' copies when it starts (``TrainStep``):
    every copy after the first is on its way while the micro-batches before it run
    forward and backward, and since a step that logs nothing never waits for the device
    (harness/syncs.py), the host starts step N+1, and its copies, while the device still
    runs step N's backward. A pageable host tensor would instead be staged by the driver
    with the host blocked until the copy is done.

    On a CPU the tensors are the device's already: nothing is copied.

    Cost: per micro-batch one host copy into pinned memory (B x T x 8 bytes per tensor:
    256 KB for 16 x 2048 tokens, microseconds) and one asynchronous device copy; pinned
    buffers come from torch's caching host allocator, reused once their copy is done.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, tensors: dict) -> dict:
        """``tensors`` (host) on the device: copies issued, the compute stream ordered
        after them."""
        if self.stream is None:
            return {k: t.to(self.device) for k, t in tensors.items()}
        compute = torch.cuda.current_stream(self.device)
        pinned = {k: t if t.is_pinned() else t.pin_memory() for k, t in tensors.items()}
        with torch.cuda.stream(self.stream):
            sent = {k: t.to(self.device, non_blocking=True) for k, t in pinned.items()}
        compute.wait_stream(self.stream)
        for t in sent.values():
            t.record_stream(compute)
        return sent


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
        self.copies = DeviceCopies(self.device)
        self.cross_entropy = (torch.compile(_cross_entropy, backend=cfg.training.compile_backend,
                                            fullgraph=True) if compiled else _cross_entropy)  # fmt: skip

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

    def send(self, batch: dict) -> dict:
        """``batch`` with its ``sent`` key: the input, the labels that count and the
        positions (block-causal) on their way to the device (``DeviceCopies``). The host
        keeps its own tensors: what it reads (document ids, the labels that count) it
        reads there, without a sync."""
        host = {"input": batch["input"], "label": self.labels(batch)}
        if self.block_causal:
            host["positions"] = batch["positions"]
        return {**batch, "sent": self.copies(host)}

    def __call__(self, batch: dict, normalizer: float | None = None) -> torch.Tensor:
        """The mean loss over the labels that count; with ``normalizer``, their summed
        loss divided by it. The device's copies are ``send``'s, sent now if not yet."""
        sent = (batch if "sent" in batch else self.send(batch))["sent"]
        inputs, labels = sent["input"], sent["label"]
        autocast = (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.autocast
            else contextlib.nullcontext()
        )
        with autocast:
            if self.block_causal:
                # The document ids stay on the host: the sdpa and varlen masks are
                # computed there without a device sync (flex moves them itself).
                logits = self.model(inputs, sent["positions"], batch["document_ids"])
            else:
                logits = self.model(inputs)
        if normalizer is None:
            loss = self.cross_entropy(logits, labels, "mean", self.chunk_bytes)
        else:
            loss = self.cross_entropy(logits, labels, "sum", self.chunk_bytes) / normalizer
        # A mixture of experts' sequence-level balance loss (moe_aux_loss_weight > 0).
        inner = getattr(self.model, "module", self.model)
        aux = inner.aux_loss() if hasattr(inner, "aux_loss") else None
        return loss if aux is None else loss + aux
