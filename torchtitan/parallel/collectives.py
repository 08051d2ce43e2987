"""The small collectives the trainer needs: a barrier, the mean or sum of a scalar over
ranks, a flag raised on any rank, work done on rank 0 and moved as a value, and the
job's ranks as the data plan uses them (``JobRanks``).

Never: make process groups (groups.py) or run a model's collectives (torch does).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.parallel.groups import ParallelDims


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


def mean_on_control(dims: ParallelDims, value: float) -> float:
    """The mean of a host float over all ranks, on the control group (gloo: no device
    tensor, whatever device the value came from; one 8-byte all-reduce)."""
    if dims.control_group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dims.control_group)
    return float(t.item()) / dims.world_size


def sum_tensor_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """An integer tensor summed over all ranks (a copy; the input is left as it was)."""
    if not dist.is_initialized():
        return value.clone()
    t = value.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(dims: ParallelDims, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one small gloo all-reduce)."""
    if dims.control_group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dims.control_group)
    return bool(t.item())


def gather_to_main(dims: ParallelDims, items: list) -> list:
    """Every rank's ``items``, concatenated on rank 0 (empty elsewhere); control group."""
    if dims.control_group is None:
        return list(items)
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(items, out, dst=0, group=dims.control_group)
    return [item for part in (out or []) for item in part]


def barrier(dims: ParallelDims):
    if dist.is_initialized():
        dist.barrier(group=dims.cpu_group)


def on_main(dims: ParallelDims, fn, *args):
    """``fn(*args)`` on rank 0 only; every rank returns its result, or raises its error
    (the same exception, so a user error stays one line on every rank). For work done
    once per job and moved as a value. Collective: every rank must call it."""
    outcome = None
    if dims.is_main:
        try:
            outcome = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - one that cannot travel: its line does
                e = RuntimeError(f"{type(e).__name__}: {e}")
            outcome = (False, e)
    ok, value = broadcast_from_main(dims, outcome)
    if not ok:
        raise value
    return value


def broadcast_from_main(dims: ParallelDims, obj):
    """Rank 0's ``obj`` on every rank (checkpoint group; pickled, for small objects)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=dims.cpu_group)
    return box[0]


def gather_objects(dims: ParallelDims, obj) -> list:
    """Every rank's ``obj`` on rank 0, in rank order (others get an empty list)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(obj, out, dst=0, group=dims.cpu_group)
    return out or []


def all_gather_objects(dims: ParallelDims, obj) -> list:
    """Every rank's ``obj`` on every rank, in rank order (checkpoint group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj, group=dims.cpu_group)
    return out


@dataclass
class JobRanks:
    """The job's ranks as the data plan uses them (``data.plan.Ranks``): rank 0 runs
    what is done once per job, every rank its share, over the checkpoint group."""

    dims: ParallelDims

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def world(self) -> int:
        return self.dims.world_size

    def on_main(self, fn, *args):
        return on_main(self.dims, fn, *args)

    def gather(self, obj) -> list:
        return gather_objects(self.dims, obj)
