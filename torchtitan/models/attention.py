"""Attention kernels for causal and document (block-causal) masks: sdpa, flex, varlen.

Owns: which backends exist and where each can run (`choose_backend`,
`backend_problem`), the job's choice (`attention_backend`: ``auto`` resolved for the
device) and its check before anything is built (`check_config`, run by
torchtitan.config.validate: one ConfigError if it cannot train on this machine), the
per-batch mask each backend reads (`document_mask`, built once per batch from the
batch's ``document_ids`` and shared by every layer), and the attention call itself
(`attend`), from queries, keys and values laid out ``[B, T, heads, head_dim]`` to
``[B, T, heads * head_dim]``.

- ``sdpa``: ``F.scaled_dot_product_attention``, causal over each row; with documents,
  one causal call per document (a Python loop), so a document's result is the same
  computation, bit for bit, wherever it sits. Runs everywhere; the only one with
  attention dropout. Cost grows with the number of documents per batch (one kernel
  launch each): fine on CPU, slow on a GPU with short documents.
- ``flex``: ``flex_attention`` with a ``BlockMask`` from ``create_block_mask``
  (causal, and same document), one fused kernel per layer; compiled on CUDA, eager on
  CPU, where torch 2.13 has its forward but no backward (CPU: evaluation only).
- ``varlen``: ``varlen_attn`` (FlashAttention's variable-length kernel) over the
  batch flattened to ``[B * T, heads, head_dim]`` with cumulative sequence lengths;
  CUDA, bfloat16 or float16 only.

Never: project, rotate or mix heads (the model's Attention module does), read the
config beyond the model's attention settings, dropout and the compute precision, or move a batch's tokens (the document ids are read where they are: from the
host, the sdpa and varlen layouts need no device sync).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torchtitan import parallel
from torchtitan.config.errors import ConfigError

BACKENDS = ("sdpa", "flex", "varlen")


class DocumentLengths(NamedTuple):
    """sdpa's mask: per row, the lengths of its documents (summing to T)."""

    lengths: list[list[int]]


class VarlenLayout(NamedTuple):
    """varlen's mask: the flattened batch's document boundaries, ``[0, ..., B * T]``
    (int32, on the device), and the longest document."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


# ---- where each backend runs --------------------------------------------------------


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:  # torch < 2.9
        return False
    return True


def choose_backend(
    requested: str, mask: str, device_type: str, dtype: torch.dtype, dropout: float
) -> str:
    """The backend ``requested`` names, or for ``auto`` the fastest present: sdpa for
    plain causal attention (torch picks its flash/cuDNN kernel itself) and on CPU; on
    CUDA for documents, varlen where it can run (bf16/fp16, no dropout), else flex
    (no dropout), else sdpa."""
    if requested != "auto":
        return requested
    if device_type != "cuda" or mask == "causal" or dropout > 0:
        return "sdpa"
    if varlen_available() and dtype in (torch.bfloat16, torch.float16):
        return "varlen"
    return "flex"


def backend_problem(
    backend: str, mask: str, device_type: str, dtype: torch.dtype, dropout: float, compile: bool
) -> str | None:
    """Why ``backend`` cannot train here, as one line naming the key and the fix; None
    if it can."""
    if backend in ("flex", "varlen") and dropout > 0:
        return (
            f"model.dropout {dropout} with model.attention_backend {backend}: only sdpa has "
            "attention dropout; set model.dropout 0 or model.attention_backend sdpa"
        )
    if backend == "flex" and device_type != "cuda":
        return (
            f"model.attention_backend flex cannot train on CPU: torch {torch.__version__} "
            "has FlexAttention's forward there but no backward; use sdpa on CPU (or auto)"
        )
    if backend == "varlen":
        if device_type != "cuda":
            return (
                "model.attention_backend varlen needs a CUDA GPU (FlashAttention's varlen "
                "kernel); use sdpa on CPU (or auto)"
            )
        if not varlen_available():
            return (
                f"model.attention_backend varlen needs torch.nn.attention.varlen (torch >= "
                f"2.9), not in torch {torch.__version__}; use flex or sdpa"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            return (
                f"model.attention_backend varlen computes in bfloat16 or float16, not "
                f"{str(dtype).removeprefix('torch.')}; set training.mixed_precision_param "
                "bfloat16, or use flex or sdpa"
            )
    if backend == "sdpa" and compile and mask == "block_causal":
        return (
            "training.compile with model.attention_mask block_causal and "
            "model.attention_backend sdpa would recompile for every batch's document "
            "layout; use model.attention_backend flex or varlen, or turn compile off"
        )
    return None


def attention_backend(cfg, device_type: str) -> str:
    """model.attention_backend with ``auto`` resolved for training on ``device_type``."""
    m = cfg.model
    dtype = parallel.compute_dtype(cfg, torch.device(device_type))
    return choose_backend(m.attention_backend, m.attention_mask, device_type, dtype, m.dropout)


def check_config(cfg) -> None:
    """One ConfigError if the attention settings cannot train on this machine's device."""
    device, m = parallel.device_type(), cfg.model
    problem = backend_problem(
        attention_backend(cfg, device), m.attention_mask, device,
        parallel.compute_dtype(cfg, torch.device(device)), m.dropout, cfg.training.compile,
    )  # fmt: skip
    if problem:
        raise ConfigError(problem)


# ---- the mask of one batch ----------------------------------------------------------


def segment_lengths(document_ids: torch.Tensor) -> list[list[int]]:
    """Per row of ``document_ids`` [B, T]: the lengths of its runs of equal ids."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in document_ids]


def document_mask(
    backend: str,
    batch: int,
    seq_len: int,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
):
    """What ``attend`` reads for one batch, shared by all layers: causal over whole rows
    without ``document_ids``, else causal within each run of equal ids of a row.

    Cost: O(B x T) on the host for sdpa and varlen (no device sync when the ids are on
    the host), one ``create_block_mask`` for flex (compiled on CUDA: O(B x T^2 / 128^2)
    blocks, no dense mask).
    """
    if backend == "sdpa":
        if document_ids is None:
            return None
        return DocumentLengths(segment_lengths(document_ids.cpu()))
    if backend == "varlen":
        if document_ids is None:
            lengths = [[seq_len]] * batch
        else:
            lengths = segment_lengths(document_ids.cpu())
        flat = [n for row in lengths for n in row]
        cu_seqlens = torch.zeros(len(flat) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(flat, dtype=torch.int32), 0, out=cu_seqlens[1:])
        return VarlenLayout(cu_seqlens.to(device, non_blocking=True), max(flat))
    if backend == "flex":
        return _block_mask(batch, seq_len, device, document_ids)
    raise ValueError(f"unknown attention backend {backend!r}: choose one of {BACKENDS}")


def _block_mask(batch: int, seq_len: int, device: torch.device, document_ids):
    from torch.nn.attention.flex_attention import create_block_mask

    if document_ids is None:

        def mask_mod(b, h, q, kv):
            return q >= kv

        rows = None  # the same mask for every row
    else:
        ids = document_ids.to(device, non_blocking=True)

        def mask_mod(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv])

        rows = batch
    # Compiled on CUDA so that no dense [B, T, T] mask is ever built; eager on CPU.
    return create_block_mask(
        mask_mod, rows, None, seq_len, seq_len, device=device, _compile=device.type == "cuda"
    )


# ---- attention ----------------------------------------------------------------------


def attend(q, k, v, mask, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of ``q`` [B, T, H, D] over ``k``, ``v`` [B, T, H_kv, D] under
    ``mask`` (from `document_mask`; None: whole rows with sdpa) -> [B, T, H * D]."""
    B, T, H, D = q.shape
    gqa = k.shape[2] != H
    if isinstance(mask, VarlenLayout):
        y = _varlen(q.reshape(B * T, H, D), k.flatten(0, 1), v.flatten(0, 1), mask, gqa)
        return y.view(B, T, H * D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
    if mask is None:
        y = _sdpa(q, k, v, dropout_p, gqa)
    elif isinstance(mask, DocumentLengths):
        # One causal attention per document: a document's result is the same
        # computation wherever it sits in the sequence (bit for bit).
        rows = []
        for b, lengths in enumerate(mask.lengths):
            starts = [0, *itertools.accumulate(lengths)]
            rows.append(torch.cat([
                _sdpa(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], dropout_p, gqa)
                for s, e in zip(starts, starts[1:])
            ], dim=2))  # fmt: skip
        y = torch.cat(rows)
    else:  # a flex BlockMask
        y = _flex(q, k, v, mask, gqa)
    return y.transpose(1, 2).reshape(B, T, H * D)


def _sdpa(q, k, v, dropout_p: float, gqa: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
    )


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Unfused (eager) flex attention materializes the [T, T] scores: compiled it is
    # one fused kernel. Shapes are static per run (seq_len is fixed).
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, block_mask, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():  # inside a compiled block: fused with the rest
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if q.is_cuda:
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    with warnings.catch_warnings():
        # CPU runs it eagerly on purpose (forward only, small shapes): no need to be told.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _varlen(q, k, v, layout: VarlenLayout, gqa: bool) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    # num_splits=1: no split-KV, so a document's output does not depend on the longest
    # document of the batch (FlashAttention's batch invariance); ROCm refuses the option.
    splits = {} if torch.version.hip else {"num_splits": 1}
    return varlen_attn(
        q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, layout.max_seqlen,
        window_size=(-1, 0), enable_gqa=gqa, **splits,
    )  # fmt: skip
