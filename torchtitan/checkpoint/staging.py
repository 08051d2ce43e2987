"""An async save's staging that the store writer uploads from as it goes.

Owns ``PipelinedStager``: DCP's ``AsyncStager`` that copies a state's tensors into CPU
buffers of its own (kept between saves) on a thread of its own, entry by entry, and
tells a writer that asks (``wait_for``) when an entry's copy is done. DCP's
``DefaultStager`` hands DCP the staged state only once every tensor is copied, so the
upload of an async save started 0.5-0.8 s (the copy of the 1.6 GB state of the 125M
model, 1 rank) after the save's call and its durability came that much after a sync
save's; here the store writer serializes and uploads entry 1 while entry 2 is copied
(docs/benchmarks.md § 21).

- **Training-safe.** The loop's ``wait_for_staging()`` (before the optimizer step)
  waits for the last copy (``settled``), as it waits for DefaultStager's.
- **Never an entry before its copy.** A writer that uploads as it goes waits on the
  entry's own event first (``wait_for``); a writer that does not (a local folder's, DCP's
  own) is handed a future of the whole staged state, as DefaultStager's async staging
  does (``pipelined`` False).
- **Snapshots the rest.** A value that is not a tensor is deep-copied at the call, on
  the caller's thread (a few small objects: the project's states keep theirs as tensors).
- **In the writer's order.** Tensors under ``store_writer.SMALL`` first, then the rest,
  each in the state's order: the order the store writer serializes them in.

Used on CPU-only hosts. With CUDA, DefaultStager's pinned buffers and non-blocking copies
stage (lifecycle.py), untouched here.

- **A failed copy fails the save.** Its error is recorded before any waiter is woken,
  so the writer raises it rather than upload a buffer not copied: DCP's write fails on
  every rank together and the saver reports it in one line (the loop's
  ``wait_for_staging()`` waits on ``settled``, which does not raise it a second time).

Cost per save: one copy of the rank's own state (O(own shard) bytes, the same as
DefaultStager's), on the stager's thread; memory: one CPU copy of the rank's state,
allocated at the first save and reused (a tensor of another shape or dtype gets a new
buffer, and one the state no longer names is freed). Tensors that alias each other are
copied once each (DefaultStager's deep copy kept one).
"""

from __future__ import annotations

import collections
import copy
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor

from torchtitan.checkpoint.store_writer import SMALL


class PipelinedStager:
    """DCP's AsyncStager protocol (``stage``, ``synchronize_staging``, ``close``, and
    ``should_synchronize_after_execute``); see the module docstring."""

    should_synchronize_after_execute = False

    def __init__(self):
        self.pipelined = False  # set per save: the writer calls wait_for before each entry
        self.completion: Future | None = None  # the last copy of the latest stage()
        self.settled: Future | None = None  # the same, never failing (the loop waits on it)
        self._buffers: dict = {}  # (path in the state, shape, dtype): a CPU tensor
        self._ready: dict[int, threading.Event] = {}  # a buffer's storage address: copied
        self._failed: list = []  # the latest stage's copy error, set before its events
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage")

    def stage(self, state_dict: dict):
        """The staged copy of ``state_dict``: its tensors' buffers (filled on the stager's
        thread, in the store writer's order) and a deep copy of everything else. Returns
        it at once where ``pipelined``, else a future of it done once every copy is."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        used: dict = {}
        staged = self._mirror(state_dict, (), copies, used)
        self._buffers = used  # a buffer this state no longer names is freed
        for source, buffer in [c for c in copies if not c[1].nbytes]:
            buffer.copy_(source)  # nothing to copy (and no storage address of its own)
        # the store writer's order (store_writer.small_first): its first object first
        copies = sorted((c for c in copies if c[1].nbytes), key=lambda c: c[1].nbytes >= SMALL)
        ready = {buffer.untyped_storage().data_ptr(): threading.Event() for _, buffer in copies}
        self._ready, self._failed = ready, []
        self.completion = self._thread.submit(self._copy, copies, ready, self._failed)
        self.settled = Future()  # done once the copies end, whether or not they failed
        self.completion.add_done_callback(lambda _, settled=self.settled: settled.set_result(None))
        if self.pipelined:
            return staged
        whole: Future = Future()

        def resolve(done: Future):
            error = done.exception()
            if error is not None:
                whole.set_exception(error)
            else:
                whole.set_result(staged)

        self.completion.add_done_callback(resolve)
        return whole

    def wait_for(self, tensor: torch.Tensor):
        """Block until the entry whose staged buffer ``tensor`` views is copied; raise
        the staging's error if it failed. A tensor that is no buffer of this stage (not
        staged here) passes at once."""
        event, failed = self._ready.get(tensor.untyped_storage().data_ptr()), self._failed
        if event is None:
            return
        event.wait()
        if failed:  # set before any event of a failed stage: never a buffer not copied
            raise failed[0]

    def synchronize_staging(self) -> None:
        if self.completion is not None:
            self.completion.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._buffers.clear()

    @staticmethod
    def copy_entry(source: torch.Tensor, buffer: torch.Tensor):
        """One entry's copy, on the stager's thread."""
        buffer.copy_(source)

    def _mirror(self, value, path: tuple, copies: list, used: dict):
        """The staged ``value``: DCP's containers (dicts, lists) rebuilt around buffers
        for their tensors; anything else (a tuple, which DCP pickles whole, a dict of
        another kind) deep-copied now, its tensors with it."""
        if isinstance(value, DTensor):
            local = self._mirror(value.to_local(), path, copies, used)
            return DTensor.from_local(local, value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape,
                                      stride=value.stride())  # fmt: skip
        if isinstance(value, torch.Tensor):
            key = (path, tuple(value.shape), value.dtype)
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = torch.empty(value.shape, dtype=value.dtype)
            used[key] = buffer
            copies.append((value.detach(), buffer))
            return buffer
        if type(value) in (dict, collections.OrderedDict):
            return type(value)((k, self._mirror(v, (*path, k), copies, used))
                               for k, v in value.items())  # fmt: skip
        if type(value) is list:
            return [self._mirror(v, (*path, i), copies, used) for i, v in enumerate(value)]
        return copy.deepcopy(value)

    def _copy(self, copies: list, ready: dict, failed: list):
        try:
            for source, buffer in copies:
                self.copy_entry(source, buffer)
                ready[buffer.untyped_storage().data_ptr()].set()
        except BaseException as e:
            failed.append(e)  # first: a waiter woken below raises it (wait_for)
            raise
        finally:  # a failed copy wakes every waiter
            for event in ready.values():
                event.set()
