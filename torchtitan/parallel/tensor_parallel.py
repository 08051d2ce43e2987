"""Tensor parallelism for the Llama model: the plan, and dropout randomness under it.

Owns: the TP plan over the ``tp`` dimension of the mesh (attention's wq/wk/wv and the
feed-forward's w1/w3 column-wise, wo/w2 row-wise; the embedding row-wise and the output
column-wise over the vocabulary; sequence parallel on the norms; loss parallel on
vocabulary-sharded logits, optional), attention's local head counts, the check that a
model splits over the TP degree, and which dropout draws TP peers must share.

Randomness. Dropout draws from torch's global generators. An activation every TP peer
holds whole (the residual stream without sequence parallel) must be dropped alike on
every peer, or the peers' copies of it diverge: train.py seeds the global generators by
the data-parallel rank, so a TP group shares one stream, and the checkpoint keeps it
per DP rank. An activation each peer holds a different part of (its attention heads;
its chunk of the sequence under SP) must be dropped independently, or every part
repeats one mask: those draws run in ``PerRankDraws``, whose generator is seeded from
one draw of the shared stream and the TP rank. It has no state of its own, so there is
nothing more to checkpoint, and activation recomputation, which replays the shared
stream, replays it too.

Cost per transformer block and micro-batch: with SP, two all-gathers and two
reduce-scatters of the activations (B x T x dim) over the TP group; without, two
all-reduces. Memory per rank: 1/tp of every matrix; activations 1/tp with SP.

Never: build or initialize the model, choose the mesh (parallel.py), or shard over the
data-parallel ranks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan.config import ConfigError


def check_fits(args, tp: int, seq_len: int, sequence_parallel: bool, flavor: str):
    """One-line ConfigError unless every split dimension of the model divides by ``tp``."""
    if tp == 1:
        return
    key = f"parallelism.tensor_parallel_degree {tp}"
    for what, size in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("feed-forward hidden size", args.hidden_dim),
    ):
        if size % tp:
            sizes = (args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size)
            fits = [d for d in range(1, args.n_kv_heads + 1) if all(s % d == 0 for s in sizes)]
            raise ConfigError(
                f"{key} does not divide the {what} {size} of model flavor {flavor!r}; use a "
                f"degree among {fits}"
            )
    if args.vocab_size % tp:
        raise ConfigError(
            f"{key} does not divide the tokenizer's vocabulary {args.vocab_size} (the "
            "embedding and output are split over it); use a degree that divides it, or a "
            f"tokenizer (model.tokenizer_path) whose vocabulary is a multiple of {tp}"
        )
    if sequence_parallel and seq_len % tp:
        raise ConfigError(
            f"training.seq_len {seq_len} is not a multiple of {key} (sequence parallel splits "
            "each sequence over the TP ranks); use a multiple of it, or "
            "--parallelism.sequence_parallel false"
        )


def apply(model: nn.Module, tp_mesh, sequence_parallel: bool, with_loss_parallel: bool):
    """Split ``model`` (on meta, before FSDP) over ``tp_mesh`` in place.

    The residual stream between blocks is sharded by sequence (SP) or replicated; each
    block gathers it whole for attention and the feed-forward, whose matrices hold
    1/tp of the heads and of the hidden units.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        model.seq_shards = tp_mesh.size()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if with_loss_parallel else Replicate(),
            use_local_output=not with_loss_parallel,
        ),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    elif model.norm is not None:
        replicate(model.norm, tp_mesh)
    # A pipeline stage holds the embeddings, or the norm and output, or neither.
    top = {name: plan for name, plan in top.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, top)
    tp = tp_mesh.size()
    draws = PerRankDraws(tp_mesh.get_local_rank(), tp_mesh.device_type)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(  # (x, rotation, document mask)
                input_layouts=(seq, None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        else:
            replicate(block.attention_norm, tp_mesh)
            replicate(block.ffn_norm, tp_mesh)
        parallelize_module(block, tp_mesh, plan)
        attention = block.attention
        # The projections now produce this rank's heads only.
        attention.n_heads //= tp
        attention.n_kv_heads //= tp
        attention.heads_rng = draws
        # Without SP the block outputs are whole on every peer: the shared stream.
        attention.output_rng = draws if sequence_parallel else None
        block.feed_forward.output_rng = draws if sequence_parallel else None
    model.loss_parallel = with_loss_parallel


def replicate(module: nn.Module, tp_mesh):
    """Keep ``module``'s parameters whole on every TP rank, as replicated DTensors.

    Without sequence parallel the norms need no split, but as plain tensors they would
    sit on another mesh than every other parameter after FSDP, and the gradient norm
    (one reduction over all parameters) refuses mixed meshes. The module computes on
    replicated DTensors and hands on a plain tensor, as the rest of the block expects.
    """
    distribute_module(
        module,
        tp_mesh,
        input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        ),
        output_fn=lambda mod, output, mesh: output.to_local(),
    )


def loss_context(model: nn.Module):
    """The context the loss and its backward run in: loss parallel when the model's logits
    are vocabulary-sharded DTensors, else nothing."""
    inner = getattr(model, "module", model)
    return loss_parallel() if getattr(inner, "loss_parallel", False) else contextlib.nullcontext()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss parallel) as a plain tensor; others unchanged."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class PerRankDraws:
    """A context in which the global generators draw a stream of this TP rank's own.

    Entering draws one number from the shared stream (the same on every TP peer, and
    replayed by activation recomputation) and seeds the CPU generator (and the current
    CUDA device's) from it and the TP rank; leaving restores the shared stream as if
    the region had drawn nothing. Cost: one 8-byte draw, one seed and a save/restore of
    the generator states (~5 KB on CPU) per entry.
    """

    def __init__(self, tp_rank: int, device_type: str):
        self.tp_rank = tp_rank
        self.cuda = device_type == "cuda"

    @contextlib.contextmanager
    def __call__(self):
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        seed = (base + (self.tp_rank + 1) * 0x9E3779B97F4A7C15) % 2**63
        devices = [torch.cuda.current_device()] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            if self.cuda:
                torch.cuda.manual_seed(seed)  # the current device only
            yield
