"""Checkpoints of the whole training state with torch.distributed.checkpoint (DCP).

One file per job: ``manager`` (what to save and load, as ``train.py`` drives it),
``lifecycle`` (write, finalize, finish a killed save), ``timeline`` (what to resume
from, what to keep), ``integrity`` (digests, verification, format), ``compat`` (does
a checkpoint fit this run), ``branch`` (a run started from another run's checkpoint,
which it only reads), ``stateful`` (the components' adapters), ``entries``
(the project's entries as tensors; DCP reads that execute nothing), ``lease`` (one job
per folder), ``changes`` (config diffs) and ``folder`` (names and manifests
on disk). None of them imports ``manager``, and none imports the Hugging Face interop.
"""

from torchtitan.checkpoint.changes import config_diff
from torchtitan.checkpoint.folder import (
    MANIFEST,
    PENDING,
    CheckpointError,
    check_writable,
    complete_steps,
    read_manifest,
    step_folder,
)
from torchtitan.checkpoint.integrity import format_problem, own_files, verify_checkpoint
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.stateful import TrainState

__all__ = [
    "MANIFEST",
    "PENDING",
    "CheckpointError",
    "CheckpointManager",
    "TrainState",
    "check_writable",
    "complete_steps",
    "config_diff",
    "format_problem",
    "own_files",
    "read_manifest",
    "step_folder",
    "verify_checkpoint",
]
