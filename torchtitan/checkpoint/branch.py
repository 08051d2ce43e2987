"""A branch: a run that starts from the whole state of another run's checkpoint
(``checkpoint.branch_from``), e.g. a WSD cooldown from step N of a stable run.

Owns: the option's rules (``check_config``) and judging the source before it is loaded
(``check_source``): a finished ``step-N`` folder (its manifest written) that holds a
training state. The manager loads it as it loads its own resume point
(``CheckpointManager.load``), when neither of this run's tiers holds a checkpoint:
every component (weights, optimizer, the LR schedule's step, data position, train
step, spike guard, RNG) less ``checkpoint.exclude_from_loading``, the config of this
run winning as on any resume (its changes since the source are logged). Once the
branch has saved, a start resumes its own newest checkpoint (a requeue never branches
again); before that, it branches from the source again.

The source is only read: no lease is taken on its folder, nothing there is finished,
set aside, purged or renamed, and its rewind records are not read (the step-N folder's
loader entry holds every skip decided before it was written; a later one is the
source's own timeline's). So a branch may run while its source trains, and several
branches of one source at once, each in its own ``job.dump_folder``.

Cost: rank 0 checks the source (a stat and one small manifest read); every rank then
verifies a share of its files (O(checkpoint / ranks)) and loads its own shard: the cost
of a resume, once per branch (a requeue after the branch's first save reads only its own).

Never: write into the source's folder, choose among the source run's checkpoints, or
load anything itself.
"""

from __future__ import annotations

import os

from torchtitan.checkpoint.folder import MANIFEST, CheckpointError, holds_training_state
from torchtitan.checkpoint.integrity import manifest_or_problem
from torchtitan.checkpoint.store import is_url, join, store_for
from torchtitan.config import ConfigError


def check_config(cfg) -> None:
    """The option's rules, raised as one ConfigError naming the key and the fix."""
    ck = cfg.checkpoint
    source = ck.branch_from
    if not source:
        return
    if not ck.enable_checkpoint:
        raise ConfigError(
            f"checkpoint.branch_from {source!r} needs --checkpoint.enable_checkpoint: a branch "
            "saves its own checkpoints, which its requeue resumes instead of branching again"
        )
    if ck.initial_load_path:
        raise ConfigError(
            f"checkpoint.branch_from {source!r} and checkpoint.initial_load_path "
            f"{ck.initial_load_path!r} are both set; set only one (branch_from takes the whole "
            "state, initial_load_path the weights alone)"
        )
    own = [join(cfg.job.dump_folder, ck.folder)]
    if ck.local_interval:
        own.append(join(cfg.job.dump_folder, ck.local_folder))
    for folder in own:
        if _inside(source, folder):
            raise ConfigError(
                f"checkpoint.branch_from {source!r} is inside this run's own checkpoint folder "
                f"{folder!r}; give the branch its own --job.dump_folder"
            )


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or under it (URLs as text, local paths made absolute)."""
    if is_url(path) != is_url(folder):
        return False
    if is_url(path):
        path, folder = path.rstrip("/"), folder.rstrip("/")
        return path == folder or path.startswith(folder + "/")
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_source(path: str) -> None:
    """Rank 0: raise one CheckpointError naming ``path`` unless it is a finished
    checkpoint holding a training state (its files are verified by every rank after)."""
    what = f"checkpoint.branch_from {path}"
    store = store_for(path)
    if not store.isdir(path):
        raise CheckpointError(
            f"{what}: no such folder; pass a step-N checkpoint folder of the source run"
        )
    if not store.isfile(join(path, MANIFEST)):
        raise CheckpointError(
            f"{what}: no {MANIFEST}, so not a finished checkpoint (a save still being written, "
            "or a killed one); pass a complete step-N folder of the source run"
        )
    manifest, problem = manifest_or_problem(path)
    if problem is not None:
        raise CheckpointError(f"{what}: {problem}; branch from another step of the source run")
    if not holds_training_state(manifest):
        raise CheckpointError(
            f"{what} holds model weights only (a seed or weights-only save): nothing to "
            "continue; branch from a full checkpoint, or start from its weights with "
            "--checkpoint.initial_load_path"
        )
