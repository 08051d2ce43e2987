"""CheckpointManager: save and load the whole training state with torch.distributed.checkpoint.

Owns: the step folders under ``<dump_folder>/<checkpoint.folder>``, when to save,
what to load, and the integrity of what it writes. Every component follows torch's
``Stateful`` protocol: ``model``, ``optimizer``, ``lr_scheduler``, ``dataloader``
(one entry per data-parallel rank), ``train_state`` and ``rng`` (one entry per rank).

A checkpoint is written into ``step-N.partial`` and becomes ``step-N`` only when
every rank's files and DCP's metadata are on disk and rank 0 has written
``manifest.json`` (sizes and CRC32 of every file, the config and data fingerprints)
and renamed the folder; a folder named ``step-N`` is complete by construction.

Never: decide what a component's state is, or build components.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.parallel import barrier

logger = logging.getLogger("torchtitan")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names it and the fix."""


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict):
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict):
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict):
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class RNGState(Stateful):
    """Every RNG a rank draws from, keyed by rank (DCP would merge equal keys across ranks)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict:
        state = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        return {self.key: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict):
        state = pickle.loads(state_dict[self.key])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])


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


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_inventory(path: str) -> dict[str, dict]:
    """Size and CRC32 of every file in a checkpoint folder (the manifest excluded)."""
    out = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name != MANIFEST and os.path.isfile(full):
            out[name] = {"size": os.path.getsize(full), "crc32": _crc32_file(full)}
    return out


class CheckpointManager:
    """Saves every ``interval`` steps and at the last step; loads the latest complete one."""

    def __init__(
        self, cfg, dims, *, model, optimizer, lr_scheduler, dataloader, train_state, fingerprint
    ):
        ck = cfg.checkpoint
        self.enabled = ck.enable_checkpoint
        self.folder = os.path.join(cfg.job.dump_folder, ck.folder)
        self.interval = ck.interval
        self.keep_latest_k = ck.keep_latest_k
        self.load_step = ck.load_step
        self.async_mode = ck.async_mode
        self.exclude = set(ck.exclude_from_loading)
        self.model_weights_only = ck.model_weights_only
        self.fallback_on_corruption = ck.fallback_on_corruption
        self.accept_data_change = ck.accept_data_change
        self.last_step = cfg.training.steps
        self.dims = dims
        self.fingerprint = fingerprint
        self.config_dict = cfg.to_dict()
        self.states: dict[str, Stateful] = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
            "rng": RNGState(dims.rank),
        }
        self._pending = None  # (future, step) of an async save not yet finalized
        self._staging = None  # future of its in-memory copy
        self._stager = None
        if self.enabled:
            check_writable(self.folder)

    # ---- saving ---------------------------------------------------------------------
    def should_save(self, step: int, stop_at: int = -1) -> bool:
        """Every ``interval`` steps, at the last step, and where the job stops early."""
        return self.enabled and (step % self.interval == 0 or step in (self.last_step, stop_at))

    def save(self, step: int, *, model_only: bool = False):
        """Write ``step-N``; in async mode return once the state is staged in memory."""
        self.wait()
        if model_only or (self.model_weights_only and step == self.last_step):
            names = ["model"]
        else:
            names = list(self.states)
        state = {name: self.states[name].state_dict() for name in names}
        partial = step_folder(self.folder, step) + ".partial"
        if self.dims.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        begin = time.perf_counter()
        if self.async_mode == "async":
            with self._save_errors(step):
                response = dcp.async_save(
                    state,
                    checkpoint_id=partial,
                    process_group=self.dims.cpu_group,
                    async_stager=self._async_stager(),
                )
            self._staging = response.staging_completion
            self._pending = (response.upload_completion, step)
            logger.info(
                "checkpoint step-%d handed off in %.2fs, staging and writing in the background",
                step,
                time.perf_counter() - begin,
            )
        else:
            with self._save_errors(step):
                dcp.save(state, checkpoint_id=partial, process_group=self.dims.cpu_group)
                self._finalize(step)
            logger.info("saved checkpoint step-%d in %.2fs", step, time.perf_counter() - begin)

    def _async_stager(self):
        # One stager for the whole run: it keeps its CPU copy buffers between saves,
        # and stages in a background thread so the save returns at once.
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def wait_for_staging(self):
        """Call before the optimizer step: staging copies the parameters it would change."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def wait(self):
        """Block until a pending async save is on disk and finalized."""
        self.wait_for_staging()
        if self._pending is not None:
            future, step = self._pending
            self._pending = None
            with self._save_errors(step):
                future.result()
                self._finalize(step)

    @contextlib.contextmanager
    def _save_errors(self, step: int):
        """A failed write (disk full, I/O error) on any rank: one clear error on every rank.

        DCP gathers every rank's write result, so all ranks see the failure together.
        """
        try:
            yield
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            shutil.rmtree(step_folder(self.folder, step) + ".partial", ignore_errors=True)
            done = complete_steps(self.folder)
            raise CheckpointError(
                f"saving checkpoint step-{step} in {self.folder} failed: {_root_cause(e)}; free "
                f"space or set --checkpoint.folder elsewhere, then resume (last complete "
                f"checkpoint: {('step-' + str(done[-1])) if done else 'none'})"
            ) from e

    def _finalize(self, step: int):
        """Rank 0 writes the manifest and renames the folder once every rank's data is on disk."""
        final = step_folder(self.folder, step)
        partial = final + ".partial"
        if self.dims.is_main:
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": self.dims.world_size,
                "torch_version": torch.__version__,
                "config": self.config_dict,
                "data_fingerprint": self.fingerprint,
                "files": file_inventory(partial),
            }
            with open(os.path.join(partial, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            for name in manifest["files"]:
                with open(os.path.join(partial, name), "rb") as f:
                    os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            _fsync_dir(self.folder)
            self._purge()

    def _purge(self):
        if self.keep_latest_k <= 0:
            return
        for step in complete_steps(self.folder)[: -self.keep_latest_k]:
            shutil.rmtree(step_folder(self.folder, step), ignore_errors=True)
            logger.info(
                "removed old checkpoint step-%d (keep_latest_k=%d)", step, self.keep_latest_k
            )

    def close(self):
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ---- loading --------------------------------------------------------------------
    def load(self) -> int:
        """Load the chosen checkpoint into every component; return its step (0 if none)."""
        if not self.enabled:
            return 0
        self._clean_partials()
        steps = complete_steps(self.folder)
        if self.load_step >= 0 and self.load_step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step={self.load_step}: no complete checkpoint step-{self.load_step} "
                f"in {self.folder}; complete steps: {steps or 'none'}"
            )
        if not steps:
            logger.info("no checkpoint in %s: starting from scratch", self.folder)
            return 0
        candidates = [s for s in steps[::-1] if self.load_step < 0 or s <= self.load_step]
        for step in candidates:
            path = step_folder(self.folder, step)
            problem = self._verify(path)
            if problem is None:
                break
            older = [s for s in steps if s < step]
            if not self.fallback_on_corruption or not older:
                fix = (
                    f"resume from the previous one with --checkpoint.load_step {older[-1]}, or set "
                    "--checkpoint.fallback_on_corruption to do that automatically"
                    if older
                    else "there is no older checkpoint: delete it to start from scratch"
                )
                raise CheckpointError(f"checkpoint {path} is damaged: {problem}; {fix}")
            logger.warning(
                "CHECKPOINT %s IS DAMAGED (%s): falling back to an older one", path, problem
            )
        begin = time.perf_counter()
        loaded = self._load_from(path)
        logger.info(
            "loaded checkpoint %s (%s) in %.2fs",
            path,
            ", ".join(loaded),
            time.perf_counter() - begin,
        )
        # Without a train state (a seed or weights-only checkpoint, or train_state
        # excluded) the run counts its steps from 0.
        return self.states["train_state"].step if "train_state" in loaded else 0

    def _clean_partials(self):
        if not os.path.isdir(self.folder):
            return
        partials = sorted(n for n in os.listdir(self.folder) if n.endswith(".partial"))
        self._barrier()
        for name in partials:
            if self.dims.is_main:
                logger.warning(
                    "ignoring and removing incomplete checkpoint %s",
                    os.path.join(self.folder, name),
                )
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        self._barrier()

    def _load_from(self, path: str) -> list[str]:
        saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        present = {k.split(".", 1)[0] for k in saved_keys}
        if "dataloader" in present:  # a weights-only or seed checkpoint has no data position
            self._check_fingerprint(read_manifest(path).get("data_fingerprint") or {}, path)
        names = [n for n in self.states if n in present and n not in self.exclude]
        skipped = [n for n in self.states if n in self.exclude and n in present]
        if skipped:
            logger.info("not loading %s (checkpoint.exclude_from_loading)", ", ".join(skipped))
        state = {}
        for name in names:
            if name == "dataloader":
                # Every rank's entry: the loader needs all of them to reshard.
                state[name] = {
                    k.split(".", 1)[1]: b"" for k in saved_keys if k.startswith("dataloader.")
                }
            elif name == "rng":
                key = self.states["rng"].key
                if f"rng.{key}" not in saved_keys:
                    logger.warning(
                        "checkpoint has no RNG state for %s: keeping the seeded RNG", key
                    )
                    continue
                state[name] = {key: b""}
            else:
                state[name] = self.states[name].state_dict()
        dcp.load(state, checkpoint_id=path, process_group=self.dims.cpu_group)
        for name, value in state.items():
            self.states[name].load_state_dict(value)
        return list(state)

    def _check_fingerprint(self, saved: dict, path: str):
        diffs = fingerprint_diff(saved, self.fingerprint)
        if not diffs:
            return
        if "dataloader" in self.exclude:
            logger.warning(
                "data changed since %s, data state not loaded: %s", path, "; ".join(diffs)
            )
        elif self.accept_data_change:
            logger.warning(
                "data changed since %s (%s); checkpoint.accept_data_change: the saved data "
                "positions are applied to the new data as they are",
                path,
                "; ".join(diffs),
            )
        else:
            raise CheckpointError(
                f"the data stream differs from checkpoint {path}: {'; '.join(diffs)}. Resume with "
                "the original data settings, or pass --checkpoint.accept_data_change (keep the data "
                "positions) or --checkpoint.exclude_from_loading dataloader (restart the data)"
            )

    def _verify(self, path: str) -> str | None:
        # Rank 0 reads the files once and tells the others, so all decide alike.
        result = [verify_checkpoint(path) if self.dims.is_main else None]
        if dist.is_initialized():
            dist.broadcast_object_list(result, src=0, group=self.dims.cpu_group)
        return result[0]

    def _barrier(self):
        barrier(self.dims)


def check_writable(folder: str):
    """Fail at start, not at the first save, when the checkpoint folder cannot be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {folder} is not writable ({e.strerror or e}); set "
            "--job.dump_folder or --checkpoint.folder to a writable location"
        ) from e


def _root_cause(e: BaseException) -> str:
    """DCP wraps every rank's traceback into one message; keep the first 'XError: ...' line."""
    text = str(e)
    match = re.search(r"^\w*(Error|Exception): .*$", text, flags=re.MULTILINE)
    line = match.group(0) if match else (text.splitlines() or [type(e).__name__])[0]
    return line[:300]


def fingerprint_diff(old: dict, new: dict) -> list[str]:
    """Each differing field of two data fingerprints, as 'field: old -> new'."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "sources" and isinstance(a, list) and isinstance(b, list):
            diffs += _sources_diff(a, b)
        else:
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def _sources_diff(old: list[dict], new: list[dict]) -> list[str]:
    if [(s["name"], s["weight"]) for s in old] != [(s["name"], s["weight"]) for s in new]:
        return [
            f"sources: {[(s['name'], s['weight']) for s in old]} -> {[(s['name'], s['weight']) for s in new]}"
        ]
    diffs = []
    for a, b in zip(old, new):
        files_a = {f[0]: f[1:] for f in a["files"]}
        files_b = {f[0]: f[1:] for f in b["files"]}
        for name in sorted(set(files_a) | set(files_b)):
            if files_a.get(name) != files_b.get(name):
                what = (
                    "added"
                    if name not in files_a
                    else "removed"
                    if name not in files_b
                    else "changed"
                )
                diffs.append(f"source {a['name']!r} file {name} {what}")
    return diffs


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def verify_checkpoint(path: str) -> str | None:
    """None if every file in the manifest is present with its size and CRC32, else the problem."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, expected in manifest.get("files", {}).items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"file {full} is missing"
        size = os.path.getsize(full)
        if size != expected["size"]:
            return f"file {full} has {size} bytes, expected {expected['size']} (truncated?)"
        if _crc32_file(full) != expected["crc32"]:
            return f"file {full} fails its checksum (corrupted)"
    return None
