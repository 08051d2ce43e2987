"""Counting the host's synchronisations with the device inside training steps, on a CPU.

A read by the host of a value computed on a GPU waits for the GPU to get there: a sync.
On a CPU nothing waits, so a test cannot feel one; this counter sees the calls that would
be one. ``counting(train)`` runs ``train.train_loop`` (in this process) with it and gives
each step's count: everything from one step's call to the next one's, so the step, its
report, the guard's verdicts and the loop's own work (a save step's save included).

What counts as a sync (``StepSyncs.reads``), on a value computed on the device (below):
- ``.item()``, ``float()``, ``int()``, ``bool()`` (an ``if tensor``), a format, ``.tolist()``,
  ``.numpy()``, ``.cpu()`` and ``.to("cpu")`` (seen as Python calls, through a
  ``TorchFunctionMode``: on a CPU ``.tolist()`` and ``.cpu()`` reach no aten op);
- the aten ops that read a value on the host wherever they are called from (a
  ``TorchDispatchMode``, which DTensor, FSDP and the optimizers dispatch through too):
  ``_local_scalar_dense``, ``is_nonzero``, ``equal``, and those whose output size hangs
  on the values (``nonzero``, ``masked_select``, ``unique``, a boolean mask index).
Not one: ``.to("cpu", non_blocking=True)``, an asynchronous copy (into pinned memory on
a GPU); the counter hands back a copy the host may read later for free, as a GPU's
would be once its event is done (reading it before the device got there is the
caller's bug, which no CPU run can show).

What is "computed on the device": the model's parameters and buffers, what the code
puts there (``.to(device)`` and factories given ``device=``, where ``device`` is a
``torch.device``: the string ``"cpu"`` names the host), and everything an aten op makes
from them (outputs of an op with such an input, in-place results included, and views
of their memory: DTensor makes some out of the modes' sight): activations, the loss,
gradients, the optimizer's moments, the guard's window. Data from the loader and the
host's own tensors (label counts, a gloo all-reduce of a Python float, what a
collective received into a host buffer) are not: reading those is host work. On a GPU
(``device.type != "cpu"``) a tensor's device says it instead.

Also kept, apart: the collectives on host tensors (``StepSyncs.host``: the control
group's stop agreement, the lease check, a gather for a log line): host work, not a
wait for the device. Each read and collective names the first frame of the project's
code that made it (``site``).

Cost: a Python call per aten op and per tensor method while counting (a debug step a
few times slower), and a step's device memory held until the next step begins; for
tests and benchmarks, never for training.

Never: change what a run computes (the modes pass every call through; ``.cpu()`` and
``.to(device)`` on a CPU hand back a copy, as on a GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from torchtitan import REPO_ROOT

aten = torch.ops.aten

# Python-level reads of a tensor's value by the host.
READ_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__",
                "__index__", "__complex__", "__format__", "__array__"}  # fmt: skip
# aten ops that read a value on the host (from C++ or Python alike).
READ_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
            aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default}  # fmt: skip
_PROJECT = (os.path.join(REPO_ROOT, "torchtitan") + os.sep, os.path.join(REPO_ROOT, "train.py"))


@dataclass
class Read:
    kind: str  # the method or aten op
    site: str  # the project's frame that made it: "torchtitan/spikes.py:123 decide"


@dataclass
class StepSyncs:
    step: int  # the training step the count starts at (a rewind takes a step again)
    reads: list[Read] = field(default_factory=list)  # syncs: host reads of device values
    host: list[Read] = field(default_factory=list)  # collectives on host tensors


def _site() -> str:
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_PROJECT):
            return f"{os.path.relpath(frame.filename, REPO_ROOT)}:{frame.lineno} {frame.name}"
    return "?"


def _storage(t: torch.Tensor) -> int:
    """The address of a plain tensor's memory (0: none, or a subclass without its own)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return 0
    return t.untyped_storage().data_ptr()


def _names_device(args, kwargs) -> bool:
    """Whether a call names the device the code computes on: a ``torch.device`` (not the
    string "cpu", which names the host)."""
    return any(isinstance(a, torch.device) for a in (*args, kwargs.get("device")))


def _written(func, args, kwargs) -> list:
    """The arguments an op writes into, by its schema."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(kwargs[arg.name] if arg.name in kwargs else
                           args[i] if i < len(args) else None)  # fmt: skip
    return written


def _from_project() -> bool:
    """Whether the tensor call being counted comes straight from the project's code (not
    torch's own: ``gather_object`` puts its bytes on a ``torch.device`` of the host)."""
    frame = sys._getframe(3)  # the caller, beyond _function and the mode
    return frame.f_code.co_filename.startswith(_PROJECT)


def _to_host(args, kwargs) -> bool | None:
    """For ``Tensor.to``: None unless it names the host (the string ``"cpu"``: a
    ``torch.device`` is taken for the device the code computes on, which on a CPU run is
    the CPU too), else whether it is asynchronous (``non_blocking``)."""
    targets = [*args[1:], kwargs.get("device")]
    if not any(isinstance(t, str) and t.startswith("cpu") for t in targets):
        return None
    return bool(kwargs.get("non_blocking")) or any(a is True for a in args[2:])


class SyncCounter:
    """The reads and host collectives of each step (``steps``); ``begin(step)`` opens the
    next step's count. Enter it (``with``) to count; tensors made before it are the
    device's only once ``on_device`` names them (a model's parameters)."""

    def __init__(self):
        self.steps: list[StepSyncs] = []
        self._device = WeakIdKeyDictionary()  # the tensors computed on the device
        # The memory of the tensors marked in this step, held (so that no host tensor takes
        # its address) until the next step begins.
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._roots: list[torch.Tensor] = []
        self._reading = 0  # inside a counted method: its aten op is the same read
        counter = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return counter._function(func, args, kwargs or {})

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return counter._dispatch(func, args, kwargs or {})

        self._modes = (Functions(), Dispatch())
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            self._stack.enter_context(mode)
        return self

    def __exit__(self, *exc):
        self._stack.close()

    # ---- what is on the device -----------------------------------------------------
    def on_device(self, tensors):
        """Name tensors made before counting began as the device's (a model's parameters
        and buffers): kept as roots, marked again as each step begins."""
        self._roots = list(tensors)
        for t in self._roots:
            self._mark(t)

    def _mark(self, t: torch.Tensor):
        for x in (t, getattr(t, "_local_tensor", None)):  # a DTensor and its shard
            if x is not None:
                self._device[x] = True
                where = _storage(x)
                if where:
                    self._storages[where] = x.untyped_storage()

    def is_device(self, t) -> bool:
        """Computed on the device: marked, or on the memory of a tensor marked in this
        step (autograd's saved tensors come back as new tensors on it, and DTensor makes
        some out of the modes' sight); on a GPU, its device."""
        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type != "cpu" or t in self._device:
            return True
        where = _storage(getattr(t, "_local_tensor", t))
        held = self._storages.get(where) if where else None
        # A storage freed in place (FSDP's resize_(0)) has let its address go.
        return held is not None and held.data_ptr() == where

    # ---- counting ------------------------------------------------------------------
    def begin(self, step: int):
        self.steps.append(StepSyncs(step))
        self._storages.clear()
        for t in self._roots:
            self._mark(t)

    def _count(self, kind: str, host: bool = False):
        if self.steps:
            where = self.steps[-1].host if host else self.steps[-1].reads
            where.append(Read(kind, _site()))

    def _function(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        tensor = args[0] if args else None
        if name == "to" and isinstance(tensor, torch.Tensor):
            asynchronous = _to_host(args, kwargs)
            if asynchronous is None:  # to the device (a torch.device) or another dtype
                out = func(*args, **kwargs)
                if _names_device(args[1:], kwargs) and _from_project():
                    if out is tensor:  # on a CPU the same tensor; on a GPU a new one
                        with torch._C.DisableTorchFunction():
                            out = tensor.clone()
                    self._mark(out)
                return out
            if self.is_device(tensor) and tensor.device.type == "cpu":
                if not asynchronous:
                    self._count("to(cpu)")
                return self._host_copy(tensor)  # on a GPU, a new host tensor
        if _names_device((), kwargs) and _from_project():  # a factory on the device
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
            return out
        if name in READ_METHODS and self.is_device(tensor):
            self._count(name)
            if name == "cpu" and tensor.device.type == "cpu":
                return self._host_copy(tensor)
            self._reading += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._reading -= 1
        return func(*args, **kwargs)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            copy = tensor.detach().clone()
        self._device.pop(copy, None)
        self._storages.pop(_storage(copy), None)
        return copy

    def _dispatch(self, func, args, kwargs):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(self.is_device(t) for t in tensors)
        if on_device and not self._reading and self._reads(func, args):
            self._count(str(func.overloadpacket.__name__))
        if func.namespace in ("c10d", "_c10d_functional") and not on_device:
            self._count(func.overloadpacket.__name__, host=True)
        out = func(*args, **kwargs)
        if on_device:  # its outputs, and the arguments it wrote (out=, a collective's buffer)
            for t in tree_leaves((out, _written(func, args, kwargs))):
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    @staticmethod
    def _reads(func, args) -> bool:
        if func in READ_OPS:
            return True
        if func is aten.index.Tensor:  # a boolean mask: its true count sizes the output
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        return False


@contextlib.contextmanager
def per_step(train_module, begin, loop=None):
    """``train_module``'s loop (train.py, run in this process inside the block) with
    ``begin(step)`` called as each step's call begins (``step``: the one it trains), and
    run by ``loop(real_loop, run, preemption)`` where given; restored on exit."""
    real_loop, real_feed = train_module.train_loop, train_module.feed_and_step

    def feed_and_step(run, batch_loss):
        feed, step = real_feed(run, batch_loss)

        def counted(batches):
            begin(run.train_state.step + 1)
            return step(batches)

        return feed, counted

    def train_loop(run, preemption):
        return loop(real_loop, run, preemption) if loop else real_loop(run, preemption)

    train_module.train_loop, train_module.feed_and_step = train_loop, feed_and_step
    try:
        yield
    finally:
        train_module.train_loop, train_module.feed_and_step = real_loop, real_feed


@contextlib.contextmanager
def counting(train_module):
    """``train_module.train_loop`` (train.py, run in this process inside the block) with a
    ``SyncCounter`` over it, a count per step call; yields the counter."""
    counter = SyncCounter()

    def loop(real_loop, run, preemption):
        counter.on_device([*run.model.parameters(), *run.model.buffers()])
        with counter:
            return real_loop(run, preemption)

    with per_step(train_module, counter.begin, loop):
        yield counter


def main(argv: list[str] | None = None) -> int:
    """``torchrun harness/syncs.py OUT train.py-arguments...``: ``train.main`` counted; each
    rank writes its steps to ``OUT.rank<r>.json`` (the repository root on the path)."""
    import json
    from dataclasses import asdict

    import train

    argv = sys.argv[1:] if argv is None else argv
    with counting(train) as counter:
        status = train.main(argv[1:])
    with open(f"{argv[0]}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump([asdict(s) for s in counter.steps], f)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
