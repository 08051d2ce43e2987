"""The next-token loss of one batch, as training and validation both compute it.

Owns: the inputs moved to the device, block-causal positions and document ids, the
labels that count under ``training.mask_document_boundaries``, autocast where FSDP does
not cast, and the cross-entropy over row chunks (``BatchLoss``).

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
            loss = self.cross_entropy(logits, labels, "mean", self.chunk_bytes)
        else:
            loss = self.cross_entropy(logits, labels, "sum", self.chunk_bytes) / normalizer
        # A mixture of experts' sequence-level balance loss (moe_aux_loss_weight > 0).
        inner = getattr(self.model, "module", self.model)
        aux = inner.aux_loss() if hasattr(inner, "aux_loss") else None
        return loss if aux is None else loss + aux
