"""The checkpoint folder on disk: step folder names, manifests, listing, durability.

Owns: what a name in ``<dump_folder>/<checkpoint.folder>`` means (``step-N`` complete,
``step-N.partial`` being written, ``step-N.abandoned[-k]`` set aside; ``lease.json`` is
lease.py's), reading and
durably writing the JSON manifests, and the start-up probe that the folder is writable.

Never: decide which checkpoint to use (timeline.py) or touch tensors.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid

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
    return os.path.join(folder, f"step-{step}")


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint (renamed from .partial, manifest present), ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def partial_steps(folder: str) -> list[int]:
    """Steps with a ``step-N.partial`` folder (a save that did not finish), ascending."""
    if not os.path.isdir(folder):
        return []
    names = (n[: -len(".partial")] for n in os.listdir(folder) if n.endswith(".partial"))
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))


def read_manifest(path: str, name: str = MANIFEST) -> dict:
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def holds_training_state(manifest: dict) -> bool:
    """A full checkpoint (not weights-only, not a seed): it has a train state to resume."""
    return "train_state" in manifest.get("contents", [])


def write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(path: str) -> str:
    """Rename ``path`` to the first free ``<path>.abandoned[-k]``; never deletes. Returns it."""
    dst, n = path + ".abandoned", 1
    while os.path.exists(dst):
        n += 1
        dst = f"{path}.abandoned-{n}"
    os.replace(path, dst)
    return dst


def check_writable(folder: str):
    """Fail at start, not at the first save, when the checkpoint folder cannot be written.

    The probe's name is unique per call (host, pid and a random part): ranks on
    different nodes, or in containers, often share a pid, and two probes of one name
    would remove each other's file.
    """
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(
            folder, f".write-test-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
        )
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {folder} is not writable ({e.strerror or e}); set "
            "--job.dump_folder or --checkpoint.folder to a writable location"
        ) from e
