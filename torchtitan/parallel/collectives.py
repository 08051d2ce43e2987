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
    """``fn(*args)`` on rank 0 only; every rank returns its result, or raises its error.
    For work done once per job and moved as a value. Collective: every rank must call it.

    An error goes with its causes (``raise ... from``, or the one it was raised while
    handling), which pickling drops, so that every rank reports it in the same one line
    (train.main): a project error (``torchtitan``'s: DataError, CheckpointError...) is
    raised on every rank as that type (``except DataError`` holds), its message followed
    by its causes' first lines where it does not name them already; another error
    (s3fs's PermissionError, a bug) stays itself on rank 0 and is ``RankZeroFailed`` on
    the others, caused by rank 0's error and its causes (a store's fault among them is
    said as rank 0 says it: storage.store_fault). An error or cause that cannot travel
    (unpicklable, or a class whose ``__init__`` takes other arguments than its message)
    goes as its line. Cost: one pickled broadcast (the value, or the error and its
    causes: a few KB)."""
    outcome, error = None, None
    if dims.is_main:
        try:
            outcome = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            if _ours(e):
                e.args = (_with_causes(e),)
            outcome, error = (False, [_travelling(c) for c in _causes(e)]), e
    ok, value = broadcast_from_main(dims, outcome)
    if ok:
        return value
    if error is not None:  # rank 0: its own error, with its traceback and causes
        raise error
    raise _arrived(value)


class RankZeroFailed(dist.DistError):
    """Rank 0's error in work it did for every rank (``on_main``), as another rank raises
    it: "rank 0 failed: <its line> (caused by ...)", caused by rank 0's error and its
    causes. A ``DistError``: for this rank a collective failed, the one whose root met the
    error, so train.main says it in one line as it says any broken collective: a store's
    fault among the causes as rank 0 says it (storage.store_fault), else "stopped because
    rank 0 failed: ..." once rank 0 has reported (parallel.why_collective_broke)."""


def _ours(error: BaseException) -> bool:
    """A project error: a type of ``torchtitan``'s own (its message is its one line)."""
    return type(error).__module__.split(".")[0] == "torchtitan"


def _causes(error: BaseException | None) -> list[BaseException]:
    """``error`` and what caused it (``__cause__``, else ``__context__`` unless ``raise
    ... from None`` suppressed it, as a traceback shows them), outermost first, each once."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def _line(name: str, text: str) -> str:
    """'Type: the first line of the message' (that line at most 300 characters)."""
    first = (text.splitlines() or [""])[0][:300]
    return f"{name}: {first}" if first else name


def _with_causes(error: BaseException) -> str:
    """``error``'s message, then the lines of its causes that it does not name already."""
    text, said = str(error), []
    for cause in _causes(error)[1:]:
        first = (str(cause).splitlines() or [""])[0]
        if not first or first not in text:
            said.append(_line(type(cause).__name__, str(cause)))
    return f"{text} (caused by {'; caused by '.join(said)})" if said else text


def _travelling(error: BaseException) -> tuple:
    """What goes of ``error`` to the other ranks: (itself if a copy of it comes back
    from pickling, else None; its class if it is a project error's, to rebuild it without
    its ``__init__``, else None; its type's name; its message)."""
    name, text = type(error).__name__, str(error)
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error, None, name, text
    except Exception:  # noqa: BLE001 - one that cannot travel goes as its line
        pass
    cls = type(error) if _ours(error) else None
    try:
        pickle.dumps(cls)
    except Exception:  # noqa: BLE001 - a class defined where no import finds it
        cls = None
    return None, cls, name, text


def _arrived(chain: list[tuple]) -> BaseException:
    """The error rank 0 sent (``_travelling`` of it and of each cause) linked to its
    causes again: itself where it is a project error, else ``RankZeroFailed``."""
    linked: BaseException | None = None
    for error, cls, name, text in reversed(chain):
        if error is None and cls is not None:
            error = cls.__new__(cls)
            error.args = (text,)
        elif error is None:
            error = RuntimeError(_line(name, text))
        error.__cause__ = linked
        linked = error
    assert linked is not None
    if _ours(linked):
        return linked
    said = [_line(name, text) for _, _, name, text in chain[1:]]
    causes = f" (caused by {'; caused by '.join(said)})" if said else ""
    failed = RankZeroFailed(f"rank 0 failed: {_line(chain[0][2], chain[0][3])}{causes}")
    failed.__cause__ = linked
    return failed


def broadcast_from_main(dims: ParallelDims, obj, control: bool = False):
    """Rank 0's ``obj`` on every rank (pickled, for small objects): on the checkpoint
    group, or with ``control`` on the control group. The training thread sends on the
    checkpoint group only while no async save is in flight (its finalization uses that
    group from another thread: two threads' collectives on one group cross, and gloo
    hangs or aborts on a size mismatch); at any other moment it uses ``control``."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=dims.control_group if control else dims.cpu_group)
    return box[0]


def gather_objects(dims: ParallelDims, obj) -> list:
    """Every rank's ``obj`` on rank 0, in rank order (others get an empty list)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(obj, out, dst=0, group=dims.cpu_group)
    return out or []


def all_gather_objects(dims: ParallelDims, obj, control: bool = False) -> list:
    """Every rank's ``obj`` on every rank, in rank order (checkpoint group; ``control``:
    the control group, as ``broadcast_from_main`` says when)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj, group=dims.control_group if control else dims.cpu_group)
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
