"""Launching this repository's ``train.py`` as a user does, for the acceptance tools.

Owns: the ``torchrun`` command line of a job, a free port for its rendezvous, the
environment a launched job gets, the rank processes of a running launcher, and the debug
config the tools default to.

Never: train in-process, wait on a job, or read what it wrote (``torchtitan.records.runs``
reads a run's records).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from torchtitan import REPO_ROOT

DEBUG_CONFIG = "train_configs/debug_model.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, args: list[str], script: str = "train.py") -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` (relative to the repo) on ``nproc`` ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", str(REPO_ROOT / script), *map(str, args),
    ]  # fmt: skip


def run_env() -> dict:
    """The environment of a launched job: one thread per process unless told otherwise,
    and the repository root on the path (a script under test/dist imports train.py)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": path}  # fmt: skip


def launcher_workers(pid: int) -> list[int]:
    """The rank processes of the torchrun launcher ``pid``: its children (Linux: /proc),
    which torchrun starts in sessions of their own, so a signal to its process group
    misses them. None once it is gone."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread (or the launcher) ended while listed
            pass
    return children
