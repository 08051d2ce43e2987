"""Device and process-group setup, and data-parallel wrapping (FSDP2 or DDP).

Owns: choosing the device and backend from what is present (CUDA + NCCL, else CPU +
gloo), initializing and tearing down the default process group and a gloo group for
CPU-side work, the small collectives the trainer needs (a barrier, the mean of a
scalar over ranks), and wrapping the model for data parallelism.

Never: build the model, hold training state, or read the config beyond its arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class ParallelDims:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # A gloo group of its own for CPU-side work: checkpoint traffic and error agreement.
    # ``dcp.async_save`` on the default group deadlocks while training collectives run.
    cpu_group: object = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: int = 300) -> ParallelDims:
    """Start the process group when launched by torchrun; one plain process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ and not dist.is_initialized():
        # "cpu:gloo,cuda:nccl" lets CPU-side collectives (checkpoint planning, error
        # agreement) run next to NCCL on GPUs.
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(pg_backend, timeout=timedelta(seconds=timeout_s))
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    return ParallelDims(rank, world, local_rank, device, backend, group)


def destroy_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(value: torch.Tensor) -> float:
    """The global mean of a scalar over all ranks (gloo has no AVG, so SUM / world)."""
    if not dist.is_initialized():
        return value.item()
    t = value.detach().to(torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / dist.get_world_size()).item()


def sum_over_ranks(value: int) -> int:
    """The sum of an integer count over all ranks."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def barrier(dims: ParallelDims):
    if dist.is_initialized():
        dist.barrier(group=dims.cpu_group)


def apply_data_parallel(model: nn.Module, mode: str, dims: ParallelDims) -> nn.Module:
    """Wrap for data parallelism: FSDP2 per transformer block and at the root, or DDP."""
    if not dist.is_initialized() or (dims.world_size == 1 and mode == "ddp"):
        return model
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [dims.device.index] if dims.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    raise ValueError(f"training.data_parallel {mode!r}: choose 'fsdp' or 'ddp'")
