"""An async save's staging (staging.py) through the saver as the manager drives it
(lifecycle.Saver, one process), on the local S3 server of harness/s3.py and a local
folder: the store writer uploads each entry once its copy is done, while later entries
are still being copied; the local folder's writer (the control) starts once every copy
is done. The staged copy is what is saved, whatever the loop does after
``wait_for_staging()``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import served_bucket

from torchtitan.checkpoint import staging, store_reader, store_writer
from torchtitan.checkpoint.folder import step_folder
from torchtitan.checkpoint.lifecycle import Saver
from torchtitan.parallel import init_distributed

GATE_S = 2.0  # the last copy waits this long at most for the first entry's upload


@pytest.fixture(scope="module")
def server():
    with served_bucket() as served:
        yield served


def state() -> dict:
    """5 entries of 256 KiB, then a small one, last in the state and first in the store
    writer's order (store_writer.small_first), and a value that is not a tensor."""
    model = {f"w{i}": torch.full((64, 1024), float(i + 1)) for i in range(5)}
    return {"model": {**model, "step": torch.tensor(7.0)}, "extra": {"note": "not a tensor"}}


VALUES = {1.0, 2.0, 3.0, 4.0, 5.0, 7.0}


def saved_at(folder: str, step: int) -> dict:
    got = {"model": {k: torch.zeros_like(v) for k, v in state()["model"].items()},
           "extra": {"note": None}}  # fmt: skip
    path = step_folder(folder, step)
    reader = store_reader.StoreReader(path) if path.startswith("s3://") else None
    dcp.load(got, checkpoint_id=path, storage_reader=reader, no_dist=True)
    return got


@pytest.mark.parametrize("where", ["store", "local"])
def test_an_async_save_uploads_each_entry_once_copied_while_later_ones_copy(
    server, tmp_path, monkeypatch, where
):
    """The last entry's copy waits (up to 2 s) for the first entry to be serialized: on
    the store it is, before that copy (the stager copies in the writer's order: the small
    entry, last in the state, first), and no entry is serialized before its own copy
    (its bytes the staged ones, each the value it had at the save); on a local folder
    (control: DCP's writer, handed the staged state once every copy is done) it is not.
    The loop changes every tensor right after ``wait_for_staging()``, which waited for
    the last copy: the checkpoint holds the values at the save."""
    import threading

    from torch.distributed.checkpoint import filesystem

    bucket, _ = server
    folder = f"s3://{bucket}/staged-{time.time_ns()}" if where == "store" else str(tmp_path)
    copied, serialized, first = {}, [], threading.Event()
    overlapped = []

    def gated_copy(source, buffer):
        if len(copied) == 5:  # the last: held until an entry is serialized, or GATE_S,
            overlapped.append(first.wait(GATE_S))
            time.sleep(0.3)  # and then long enough for a writer that does not wait to pass it
        buffer.copy_(source)
        copied[buffer.untyped_storage().data_ptr()] = time.perf_counter()

    def recording(write_item):
        def record(transforms, stream, data, item, *args):
            if isinstance(data, torch.Tensor):
                serialized.append((time.perf_counter(), data.untyped_storage().data_ptr(),
                                   float(data.flatten()[0])))  # fmt: skip
                first.set()
            return write_item(transforms, stream, data, item, *args)

        return record

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU hosts' stager
    monkeypatch.setattr(staging.PipelinedStager, "copy_entry", staticmethod(gated_copy))
    monkeypatch.setattr(store_writer, "_write_item", recording(store_writer._write_item))
    monkeypatch.setattr(filesystem, "_write_item", recording(filesystem._write_item))
    saver = Saver(folder, init_distributed(), "async", 0)
    try:
        live = state()
        saver.save(2, live, {"step": 2, "contents": ["model"]})
        saver.wait_for_staging()
        assert len(copied) == 6, "wait_for_staging waits for the last copy"
        for tensor in live["model"].values():
            tensor.add_(100)  # the loop's optimizer step
        saver.wait()
    finally:
        saver.close()
    got = saved_at(folder, 2)
    assert got["extra"] == state()["extra"]
    for name, tensor in state()["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert len(serialized) == 6
    assert overlapped == [where == "store"], "uploads while later entries copy (store only)"
    for at, buffer, value in serialized:
        assert at >= copied[buffer], "an entry serialized before its copy was done"
        assert value in VALUES


@pytest.mark.parametrize("where", ["store", "local"])
def test_a_failed_copy_fails_the_save_in_one_line_and_leaves_no_checkpoint(
    server, tmp_path, monkeypatch, where
):
    """The third entry's copy fails (memory, say): no entry is uploaded from a buffer not
    copied; the save fails with the saver's one line naming the step, ``step-2`` is not a
    complete checkpoint, and the loop's ``wait_for_staging()`` on the store does not
    raise it a second time. Control: the same save with the copies working is complete."""
    from torchtitan.checkpoint.folder import CheckpointError, complete_steps

    bucket, _ = server
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for failing in (True, False):
        folder = (f"s3://{bucket}/failed-{failing}-{time.time_ns()}" if where == "store"
                  else str(tmp_path / f"failed-{failing}"))  # fmt: skip
        copies = []

        def copy_or_fail(source, buffer, failing=failing, copies=copies):
            copies.append(buffer)
            if failing and len(copies) == 3:
                time.sleep(0.2)  # after async_save returned: its staging future fails, too
                raise MemoryError("no room for the staging copy")
            buffer.copy_(source)

        monkeypatch.setattr(staging.PipelinedStager, "copy_entry", staticmethod(copy_or_fail))
        saver = Saver(folder, init_distributed(), "async", 0)
        try:
            saver.save(2, state(), {"step": 2, "contents": ["model"]})
            if where == "store":
                saver.wait_for_staging()
            if failing:
                with pytest.raises(CheckpointError, match="saving checkpoint step-2") as caught:
                    saver.wait()
                assert "\n" not in str(caught.value)
            else:
                saver.wait()
        finally:
            saver.close()
        assert complete_steps(folder) == ([] if failing else [2])
