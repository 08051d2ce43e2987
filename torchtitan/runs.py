"""Launching training jobs and reading back what they wrote, for scripts and tests.

Owns: the ``torchrun`` command line for this repository's ``train.py``, a free
port for its rendezvous, and strict readers of a run's ``metrics.jsonl``: a step
that appears twice, or out of order, is an error rather than a value that
silently wins (a resume that failed to trim its files must not look fine).

Never: train, or decide whether a run is correct (the callers compare).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from torchtitan import REPO_ROOT

DEBUG_CONFIG = "train_configs/debug_model.toml"


class RunRecordError(ValueError):
    """A run's records contradict themselves (a step twice, steps out of order)."""


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


def torchrun(
    nproc: int, args: list[str], script: str = "train.py", timeout: float | None = 600
) -> subprocess.CompletedProcess:
    """Run a job to completion and return it (the caller checks ``returncode``)."""
    return subprocess.run(
        torchrun_command(nproc, args, script), cwd=REPO_ROOT, env=run_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines of a per-step file; raises RunRecordError unless steps strictly increase."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if records and record["step"] <= records[-1]["step"]:
                what = "twice" if record["step"] == records[-1]["step"] else "out of order"
                raise RunRecordError(f"{path}:{number}: step {record['step']} appears {what}")
            records.append(record)
    return records


def losses(dump: str | Path) -> dict[int, float]:
    """{step: loss} of a run's ``metrics.jsonl`` (strict: see ``read_records``)."""
    return {r["step"]: r["loss"] for r in read_records(Path(dump) / "metrics.jsonl")}


def validation_losses(dump: str | Path) -> dict[int, float]:
    """{step: validation_loss} of the steps of ``metrics.jsonl`` that ran a validation."""
    records = read_records(Path(dump) / "metrics.jsonl")
    return {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
