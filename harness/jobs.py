"""A real multi-process job of this repository, run to completion.

Owns ``torchrun``: the tools' command line and environment (``torchtitan.tools.launch``),
waited on with its output captured. Never: judge the job (the caller checks
``returncode`` and reads its records).
"""

from __future__ import annotations

import subprocess

from torchtitan import REPO_ROOT
from torchtitan.tools.launch import run_env, torchrun_command


def torchrun(
    nproc: int, args: list[str], script: str = "train.py", timeout: float | None = 600
) -> subprocess.CompletedProcess:
    """Run a job to completion and return it (the caller checks ``returncode``)."""
    return subprocess.run(
        torchrun_command(nproc, args, script), cwd=REPO_ROOT, env=run_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
