"""Applying parallelism and its companions to a model built on the meta device: tensor
parallel (``tensor_parallel.py`` holds the plan), FSDP2 or HSDP with mixed precision,
or DDP, gradient sync during accumulation, activation checkpointing and per-block
compilation, then materialization.

Never: define or build the model, or choose the layout (groups.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config import ConfigError
from torchtitan.parallel.groups import ParallelDims


def parallelize(model: nn.Module, cfg, dims: ParallelDims, roots: list | None = None) -> nn.Module:
    """Turn a model built on the meta device into the training model on this rank:
    tensor parallel, activation checkpointing, compilation, FSDP2/HSDP (or DDP), then
    materialization.

    Each rank allocates and initializes only what it holds (``init_weights`` draws a
    shard exactly as the whole tensor would be drawn): O(own shard) memory and time
    per rank under FSDP and TP, and the same weights on any layout.

    ``roots``: under pipeline parallelism, the stage modules (pipeline.py) that share
    ``model``'s parts; each becomes the FSDP root over what it runs, and ``model`` holds
    them all (the names a checkpoint uses) without being wrapped itself.
    """
    if dims.tp > 1:
        from torchtitan.parallel import tensor_parallel

        p = cfg.parallelism
        tensor_parallel.apply(model, dims.mesh["tp"], p.sequence_parallel, p.loss_parallel)
    experts = set()
    if dims.ep > 1:
        from torchtitan.parallel import expert_parallel

        experts = expert_parallel.apply(model, dims.mesh["dp_shard"])
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_every)
    if cfg.training.compile:
        apply_compile(model, cfg.training.compile_backend)
    fsdp = uses_fsdp(cfg.training.data_parallel, dims)
    if fsdp:
        reduce_dtype = getattr(torch, cfg.training.mixed_precision_reduce)
        apply_fsdp(model, compute_dtype(cfg, dims.device), reduce_dtype, data_parallel_mesh(dims),
                   roots, ignored=experts)  # fmt: skip
    model.to_empty(device=dims.device)
    model.init_weights(cfg.training.seed)
    return model if fsdp else apply_ddp(model, dims)


def data_parallel_mesh(dims: ParallelDims):
    """FSDP's mesh: the shard dimension, or (replicate, shard) for HSDP; None: all ranks."""
    if dims.mesh is None:
        return None
    return dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.mesh["dp_shard"]


def compute_dtype(cfg, device: torch.device) -> torch.dtype:
    """The dtype of forward and backward compute (training.mixed_precision_param)."""
    name = cfg.training.mixed_precision_param
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def uses_fsdp(mode: str, dims: ParallelDims) -> bool:
    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"training.data_parallel {mode!r}: choose 'fsdp' or 'ddp'")
    return mode == "fsdp" and dist.is_initialized()


def apply_fsdp(model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype, mesh=None,
               roots: list | None = None, ignored: set | None = None):  # fmt: skip
    """Shard with FSDP2 per transformer block and at the root (or at each of ``roots``,
    the pipeline stages), in place (works on meta), over ``mesh`` (default: all ranks; a
    2-D (replicate, shard) mesh is HSDP). ``ignored``: parameters FSDP leaves alone (the
    experts under expert parallelism, sharded by expert already).

    Parameters stay float32 and sharded; each block's are gathered in ``param_dtype``
    for compute, and gradients are reduce-scattered in ``reduce_dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block's inputs arrive in param_dtype from the bf16 embedding already; casting them
    # would also cast the fp32 RoPE tables passed alongside, and RoPE rotates in fp32.
    block_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    ignored = ignored or None
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=block_policy, ignored_params=ignored)
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def apply_ddp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Replicate with DDP (the parameters must be materialized); one process: unchanged.

    The gradient buckets keep one layout for the process's life. By default DDP puts
    every gradient in one bucket for the first step and re-buckets them, in the order
    they became ready, after it: a resumed process's first step then sums the gradients
    in buckets the uninterrupted run no longer used, and at 3 ranks or more (the ring
    adds a bucket's chunks starting at different ranks, ``(a + b) + c`` against ``a + (b
    + c)``) a resume drifted by ulps from its first step (found by the fault campaign:
    DDP on 3 ranks, resumed at step 5). ``find_unused_parameters`` is the switch that
    keeps the first layout (DDP never rebuilds with it). Cost: one walk of the autograd
    graph per step (DDP's search for unused parameters; microseconds a node) and the
    first layout's buckets (25 MiB, the first 1 MiB) instead of the ready-order ones."""
    if not dist.is_initialized() or dims.world_size == 1:
        return model
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    device_ids = [dims.device.index] if dims.device.type == "cuda" else None
    # It says, at the first step, that no parameter was unused: known, and not the point.
    warnings.filterwarnings("ignore", message="find_unused_parameters=True was specified")
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "reshard")  # what fully_shard adds to a module's class


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's backward: DDP skips its all-reduce until the last
    one. FSDP reduce-scatters every micro-batch: holding unsharded gradients instead
    would cost O(model) memory per rank, the thing sharding is there to avoid."""
    if not enabled and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int):
    """Recompute the activations of every block (full) or of blocks 0, k, 2k, ...
    (selective, k = every) in the backward pass instead of keeping them."""
    if mode not in ("none", "full", "selective"):
        raise ConfigError(f"activation_checkpoint.mode {mode!r}: choose none, full or selective")
    for i, block in enumerate(model.layers.values()):
        block.recompute = mode == "full" or (mode == "selective" and i % every == 0)


# Each compiled region whole: a graph break raises (dynamo names its cause) rather than
# splitting the region into pieces with eager code between them.
FULLGRAPH = True


def apply_compile(model: nn.Module, backend: str = "inductor"):
    """torch.compile each block's computation (parameter names are unchanged, and FSDP's
    hooks stay outside the compiled region), each region ``fullgraph``.

    An MoE block is compiled around its expert dispatch: the attention sublayer with the
    feed-forward's norm, the router and the shared expert are compiled regions; the
    dispatch between them (the sort by expert, the group sizes read on the host, the
    grouped matmuls, the all-to-alls) runs eager. Its group sizes change every step:
    inside a region they would recompile it (or need unbacked sizes), and a token count
    read on the host is a graph break by nature. Cost: per MoE layer, the dispatch's
    few dozen eager ops and one host read of the counts (a sync on a GPU), as before."""

    def compiled(fn):
        return torch.compile(fn, backend=backend, fullgraph=FULLGRAPH)

    for block in model.layers.values():
        moe = block.feed_forward
        if not hasattr(moe, "route"):  # a dense feed-forward (models/moe.py's MoE routes)
            block.compiled = compiled(block.compute)
            continue
        block.compiled_attend = compiled(block.attend)
        moe.route = compiled(moe.route)
        if moe.shared is not None:
            moe.shared.forward = compiled(moe.shared.forward)
