"""The checkpoint folder: step folder names, manifests, listing, durability.

Owns: what a name in ``<dump_folder>/<checkpoint.folder>`` means, on a local disk:
``step-N`` complete, ``step-N.partial`` being written; on an object store (``store``,
no rename): ``step-N`` holding ``manifest.json`` complete, ``step-N`` without it being
written (or a killed upload); and on both ``step-N.abandoned[-k]`` set aside
(``lease.json`` is lease.py's). Reading and durably writing the JSON manifests, and the
start-up probe that the folder is writable.

Never: decide which checkpoint to use (timeline.py) or touch tensors.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid

from torchtitan.checkpoint.store import join, store_for
from torchtitan.io import storage

# 3: the loader, RNG and train-state entries are tensors (JSON in uint8 for the loader
# and the Python/numpy RNGs); 2 held them as pickles. Model weights are the same in both.
FORMAT_VERSION = 3
WEIGHTS_FORMATS = (2, 3)
MANIFEST = "manifest.json"
PENDING = "manifest.pending.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names it and the fix."""


def step_folder(folder: str, step: int) -> str:
    return join(folder, f"step-{step}")


def save_folder(folder: str, step: int) -> str:
    """Where a save of ``step`` is written: ``step-N.partial`` (renamed when complete)
    on a local disk, ``step-N`` itself on an object store (complete once it holds the
    manifest)."""
    final = step_folder(folder, step)
    return final if store_for(folder).in_place else final + ".partial"


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint (a ``step-N`` holding its manifest), ascending.
    Cost: one listing and one existence test per step folder."""
    store = store_for(folder)
    steps = []
    for name in store.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and store.isfile(join(join(folder, name), MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def partial_steps(folder: str) -> list[int]:
    """Steps with a save that did not finish (``step-N.partial``; on a store, a
    ``step-N`` without its manifest), ascending."""
    store = store_for(folder)
    names = store.listdir(folder)
    if store.in_place:
        done = set(complete_steps(folder))
        found = (m for n in names if (m := _STEP_DIR.match(n)))
        return sorted(s for m in found if (s := int(m.group(1))) not in done)
    names = (n[: -len(".partial")] for n in names if n.endswith(".partial"))
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def read_manifest(path: str, name: str = MANIFEST) -> dict:
    with store_for(path).open(join(path, name), "rb") as f:
        return json.loads(f.read())


def holds_training_state(manifest: dict) -> bool:
    """A full checkpoint (not weights-only, not a seed): it has a train state to resume."""
    return "train_state" in manifest.get("contents", [])


def write_json(path: str, obj: dict):
    """Write durably: fsynced on a local disk; one PUT (whole or absent) on a store."""
    store_for(path).write_bytes(path, json.dumps(obj, indent=1).encode())


def fsync_dir(path: str):
    store_for(path).sync_dir(path)


def set_aside(path: str) -> str:
    """Move ``path`` to the first free ``<path>.abandoned[-k]``; never deletes. Returns it.
    (On a store a server-side copy, manifest last, then a delete, manifest first.)"""
    store = store_for(path)
    dst, n = path + ".abandoned", 1
    while store.isdir(dst):
        n += 1
        dst = f"{path}.abandoned-{n}"
    store.move_folder(path, dst, last=MANIFEST)
    return dst


def remove_checkpoint(path: str):
    """Delete a checkpoint folder, its manifest first: a delete killed half-way leaves a
    folder that no listing takes for complete."""
    store_for(path).rmtree(path, first=MANIFEST)


def check_writable(folder: str):
    """Fail at start, not at the first save, when the checkpoint folder cannot be written.

    The probe's name is unique per call (host, pid and a random part): ranks on
    different nodes, or in containers, often share a pid, and two probes of one name
    would remove each other's file.
    """
    store = store_for(folder)
    try:
        store.makedirs(folder)
        probe = join(folder, f".write-test-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}")
        store.write_bytes(probe, b"ok")
        store.remove(probe)
    except Exception as e:  # noqa: BLE001 - a store's fault is one line naming the folder
        fault = storage.store_fault(e)
        if fault is not None:
            raise CheckpointError(f"checkpoint folder {folder}: {fault}") from None
        if not isinstance(e, OSError):
            raise
        raise CheckpointError(
            f"checkpoint folder {folder} is not writable ({e.strerror or e}); set "
            "--job.dump_folder or --checkpoint.folder to a writable location"
        ) from e
