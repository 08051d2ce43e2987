"""Checkpoints are data, not code (checkpoint/entries.py), and a save that waits for the
previous one says so (checkpoint/lifecycle.py).

Real DCP folders written by real runs; a planted folder is written with DCP itself.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import error_lines, train_here
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.checkpoint import MANIFEST, integrity, lifecycle

CK = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", 2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of the debug model, step-2 saved."""
    dump = tmp_path_factory.mktemp("data") / "run"
    train_here(dump, "--training.steps", 2, *CK)
    return dump


def test_the_projects_own_entries_are_tensors(trained):
    """The loader position, RNG states and train state are tensors (no pickle); the
    loader's and the Python/numpy RNGs' are JSON; the manifest (timeline) is JSON."""
    step = trained / "checkpoint" / "step-2"
    saved = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    own = {
        k: md for k, md in saved.items() if k.split(".")[0] in ("dataloader", "rng", "train_state")
    }
    assert set(own) >= {"dataloader.dp_rank_0", "rng.rank_0", "rng.dp_rank_0", "train_state.step"}
    assert all(isinstance(md, TensorStorageMetadata) for md in own.values()), own
    manifest = json.loads((step / MANIFEST).read_text())
    assert manifest["format_version"] == 3 and manifest["timeline"]["generation"] == 0


class WritesAFile:
    """Unpickling this writes ``path``: what a planted checkpoint entry could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def plant(trained, tmp_path, component: str, key: str):
    """A copy of step-2 whose ``component.key`` entry is a pickle that writes a file when
    loaded, with a manifest whose digests match (the folder verifies)."""
    src = trained / "checkpoint" / "step-2"
    flat = tmp_path / "trusted.pt"
    dcp_to_torch_save(str(src), str(flat))
    state = torch.load(flat, weights_only=False)  # our own fresh checkpoint: trusted
    marker = tmp_path / "planted-code-ran"
    state[component][key] = WritesAFile(marker)
    dump = tmp_path / "run"
    dst = dump / "checkpoint" / "step-2"
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    manifest = json.loads((src / MANIFEST).read_text())
    manifest["files"] = integrity.digest(str(dst), integrity.data_files(str(dst)))
    (dst / MANIFEST).write_text(json.dumps(manifest))
    assert integrity.verify_checkpoint(str(dst)) is None
    return dump, marker


@pytest.mark.parametrize(
    "component,key",
    [("dataloader", "dp_rank_0"), ("lr_scheduler", "step")],
    ids=["own-entry", "other-entry"],
)
def test_a_planted_pickle_is_refused_and_never_runs(trained, tmp_path, component, key):
    """An own entry that is a pickle is refused from DCP's metadata, before any read; any
    other non-tensor entry is read with the weights-only unpickler, which refuses the
    call. One line either way; the file the pickle would write never appears."""
    dump, marker = plant(trained, tmp_path, component, key)
    status, log = train_here(dump, "--training.steps", 4, *CK, expect_ok=False)
    assert not marker.exists(), "loading the checkpoint ran the planted code"
    assert status == 1
    (line,) = error_lines(log)
    assert f"{component}.{key}" in line and "pickle" in line, line


def test_a_format_2_checkpoint_is_refused_naming_the_version(trained, tmp_path):
    """Format 2 held pickled loader and RNG entries: refused in one line naming the
    version, with the way to keep its weights."""
    dump = tmp_path / "run"
    shutil.copytree(trained, dump)
    manifest_path = dump / "checkpoint" / "step-2" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": 2}))
    status, log = train_here(dump, "--training.steps", 4, *CK, expect_ok=False)
    assert status == 1
    (line,) = error_lines(log)
    assert "has format 2, this version reads 3" in line and "initial_load_path" in line, line


def test_a_save_that_waits_for_the_previous_one_says_so_once(tmp_path, monkeypatch):
    """Async saves every step, each finalization (but the last's) held until the loop
    asks to save the next step, then 0.3 s more: the loop waits at each save after the
    first, and one warning gives the interval, the write and the wait. (A finalization
    slowed by a fixed 0.3 s did not outlast a step under load.)"""
    import threading
    import time

    real_fsync, real_wait = lifecycle.integrity.fsync_files, lifecycle.Saver.wait_for_previous
    asked = {}  # step -> set once the loop asks to save it

    def slow_fsync(path, names):
        step = int(re.search(r"step-(\d+)", str(path)).group(1))
        if step < 3:
            assert asked.setdefault(step + 1, threading.Event()).wait(60), step
        time.sleep(0.3)
        real_fsync(path, names)

    def wait_for_previous(self, step):
        asked.setdefault(step, threading.Event()).set()
        return real_wait(self, step)

    monkeypatch.setattr(lifecycle.integrity, "fsync_files", slow_fsync)
    monkeypatch.setattr(lifecycle.Saver, "wait_for_previous", wait_for_previous)
    _, log = train_here(tmp_path / "run", "--training.steps", 3,
                        "--checkpoint.enable_checkpoint", "--checkpoint.interval", 1,
                        "--checkpoint.async_mode", "async")  # fmt: skip
    said = re.findall(
        r"checkpoint interval (\d+) steps \(([\d.]+) s\) is shorter than a save's write "
        r"\(([\d.]+) s\); the loop waited ([\d.]+) s",
        log,
    )
    assert len(said) == 1, log[-3000:]
    steps, interval_s, write_s, waited_s = int(said[0][0]), *map(float, said[0][1:])
    assert steps == 1 and write_s >= 0.3 and 0 < waited_s <= write_s and interval_s < write_s


def test_a_save_whose_previous_one_is_written_says_nothing(tmp_path, monkeypatch):
    """Negative control of the above: async saves every step, each step's batches held
    until the previous step's checkpoint is finalized (``step-N`` on disk), so every save
    finds the last one written: no warning. (A step slowed by a fixed 0.4 s was not
    enough under load: a write of 1.24 s was seen.)"""
    import time

    import train as recipe

    real, steps = recipe.next_batches, [0]
    folder = tmp_path / "run" / "checkpoint"

    def slow_batches(feed):
        steps[0] += 1
        deadline = time.monotonic() + 60
        while steps[0] > 1 and not (folder / f"step-{steps[0] - 1}").is_dir():
            assert time.monotonic() < deadline, f"step-{steps[0] - 1} was never finalized"
            time.sleep(0.02)
        return real(feed)

    monkeypatch.setattr(recipe, "next_batches", slow_batches)
    _, log = train_here(tmp_path / "run", "--training.steps", 3,
                        "--checkpoint.enable_checkpoint", "--checkpoint.interval", 1,
                        "--checkpoint.async_mode", "async")  # fmt: skip
    assert "saved step 3" in log or "step-3" in log, log[-3000:]
    assert "is shorter than a save's write" not in log, log[-3000:]
