"""CheckpointManager: save and load the whole training state with torch.distributed.checkpoint.

Owns: the step folders under ``<dump_folder>/<checkpoint.folder>``, when to save,
what to load, and the integrity of what it writes. Every component follows torch's
``Stateful`` protocol: ``model``, ``optimizer``, ``lr_scheduler``, ``dataloader``
(one entry per data-parallel rank), ``train_state`` and ``rng`` (one entry per rank).

The pieces, each small:
- a *save* writes ``step-N.partial`` with DCP (sync, or async on the checkpoint's
  own gloo group) next to ``manifest.pending.json`` (what the step holds, the
  config and the data fingerprint);
- the *finalizer* makes it ``step-N``: every rank checksums and fsyncs the files it
  wrote (O(own shard)), rank 0 gathers the digests, writes ``manifest.json`` and
  renames the folder. An async save is finalized in a background thread the moment
  DCP's write completes, so it is durable without waiting for the next save;
- the *timeline* chooses what to resume from (the newest checkpoint holding a
  training state; rank 0 decides and tells the others), finishes a ``.partial``
  whose data is complete, removes one whose data is not, and moves checkpoints newer
  than the resume point aside (``step-N.abandoned``), never deleting them;
- *verification* before a load is split over the ranks like the writing was.

A folder named ``step-N`` is complete by construction.

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
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.parallel import barrier

logger = logging.getLogger("torchtitan")
# DCP notes on every call of a single process (no process group) that it assumes one;
# here that is intended (python train.py, seed checkpoints), and async saves warn from
# DCP's own thread, out of reach of a local catch_warnings.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
PENDING = "manifest.pending.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Config sections a resume may change; the log lists what did change.
_RESUMABLE_CHANGES = ("optimizer", "lr_scheduler", "training.steps", "training.stop_at_step")


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
    """The optimizer's moments come from the checkpoint; its hyperparameters (lr, betas,
    weight decay, eps) stay those of the config this run was built from."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict):
        configured = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, hyper in zip(self.optimizer.param_groups, configured):
            group.update(hyper)


class RNGState(Stateful):
    """Every RNG a rank draws from, keyed by rank (DCP would merge equal keys across ranks).

    CUDA: only the current device's generator, so a rank that lands on another GPU
    index after a restart still continues its own stream.
    """

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict:
        state = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        return {self.key: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict):
        state = pickle.loads(state_dict[self.key])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])


# ---- the folder: names, manifests, listing ------------------------------------------------


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


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def format_problem(path: str, manifest: dict | None = None) -> str | None:
    """Why this version cannot read the checkpoint at ``path`` (its format), or None."""
    version = (manifest if manifest is not None else read_manifest(path)).get("format_version")
    if version != FORMAT_VERSION:
        return f"has format {version}, this version reads {FORMAT_VERSION}"
    return None


def holds_training_state(path: str) -> bool:
    """A full checkpoint (not weights-only, not a seed): it has a train state to resume."""
    try:
        return "train_state" in read_manifest(path).get("contents", [])
    except (OSError, ValueError):
        return False


def _write_json(path: str, obj: dict):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- integrity: each rank its own bytes ---------------------------------------------------


# Files are checksummed in chunks, in parallel threads (zlib and file reads release the
# GIL): one CRC32 per 64 MiB, which also says where a file is damaged.
CHECKSUM_CHUNK = 64 << 20
_CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))


def _crc32_range(path: str, offset: int) -> int:
    crc, left = 0, CHECKSUM_CHUNK
    with open(path, "rb") as f:
        f.seek(offset)
        while left > 0 and (block := f.read(min(left, 1 << 22))):
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def _crc32_file(path: str) -> list[int]:
    """CRC32 of each 64 MiB chunk of a file (one chunk for an empty file)."""
    offsets = range(0, max(1, os.path.getsize(path)), CHECKSUM_CHUNK)
    if len(offsets) == 1:
        return [_crc32_range(path, 0)]
    with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="crc32") as pool:
        return list(pool.map(lambda offset: _crc32_range(path, offset), offsets))


def own_files(path: str, rank: int) -> list[str]:
    """The files of a DCP checkpoint that ``rank`` wrote: its ``__<rank>_*.distcp`` data
    files, and DCP's ``.metadata`` for rank 0 (DCP's coordinator)."""
    names = sorted(n for n in os.listdir(path) if n.startswith(f"__{rank}_"))
    return [*names, ".metadata"] if rank == 0 else names


def digest(path: str, names: list[str]) -> dict[str, dict]:
    """Size and CRC32 of the named files.

    Cost: reads those files once (normally still in the page cache): O(own bytes),
    spread over up to 8 threads.
    """
    return {
        name: {"size": os.path.getsize(os.path.join(path, name)),
               "crc32": _crc32_file(os.path.join(path, name))}
        for name in names
    }  # fmt: skip


def fsync_files(path: str, names: list[str]):
    """Flush the named files to stable storage. Cost: the bytes still dirty in the cache."""
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())


def verify_files(path: str, expected: dict[str, dict]) -> str | None:
    """None if every named file is present with its size and CRC32, else the problem."""
    for name, want in sorted(expected.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"file {full} is missing"
        size = os.path.getsize(full)
        if size != want["size"]:
            return f"file {full} has {size} bytes, expected {want['size']} (truncated?)"
        if _crc32_file(full) != want["crc32"]:
            return f"file {full} fails its checksum (corrupted)"
    return None


def verify_checkpoint(path: str) -> str | None:
    """Whole-folder verification in one process (tools and tests; jobs split it by rank)."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    return verify_files(path, manifest.get("files", {}))


def _dcp_data_complete(path: str) -> bool:
    """Whether a DCP folder holds its metadata and every byte range the metadata names."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception:  # noqa: BLE001 - no or unreadable metadata: not complete
        return False
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, end in needed.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.getsize(full) < end:
            return False
    return True


class CheckpointManager:
    """Saves every ``interval`` steps and at the last step; loads the timeline's resume point."""

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
        self.initial_load = (ck.initial_load_path, ck.initial_load_format)
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
        self._staging: Future | None = None  # the in-memory copy of an async save
        self._pending: Future | None = None  # its write and finalization
        self._pending_step = -1
        self._stager = None
        self._finalizer = None  # one background thread: finalizes async saves in order
        # This rank's share of the last finalization: checksumming and fsyncing its files.
        self.last_checksum_s = self.last_fsync_s = 0.0
        if self.enabled:
            check_writable(self.folder)

    @property
    def _no_dist(self) -> bool:
        return not dist.is_initialized()

    # ---- saving ---------------------------------------------------------------------
    def should_save(self, step: int, stop_at: int = -1) -> bool:
        """Every ``interval`` steps, at the last step, and where the job stops early."""
        return self.enabled and (step % self.interval == 0 or step in (self.last_step, stop_at))

    def save(self, step: int, *, model_only: bool = False):
        """Write ``step-N``; in async mode return once the copy to memory has started.

        Blocks the caller for: a pending async save of an earlier step (normally done
        long before), the state_dict calls, and (sync mode) the write and finalization.
        """
        self.wait()
        if model_only or (self.model_weights_only and step == self.last_step):
            names = ["model"]
        else:
            names = [n for n, s in self.states.items() if s is not None]
        state = {name: self.states[name].state_dict() for name in names}
        partial = step_folder(self.folder, step) + ".partial"
        if self.dims.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            _write_json(os.path.join(partial, PENDING), self._manifest_base(step, names))
        self._barrier()
        begin = time.perf_counter()
        if self.async_mode == "async":
            with self._save_errors(step):
                response = dcp.async_save(
                    state,
                    checkpoint_id=partial,
                    process_group=self.dims.cpu_group,
                    async_stager=self._async_stager(),
                    no_dist=self._no_dist,
                )
            self._staging = response.staging_completion
            if self._finalizer is None:
                self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-finalize")
            written = response.upload_completion
            self._pending = self._finalizer.submit(lambda: (written.result(), self._finalize(step)))
            self._pending_step = step
            logger.info(
                "checkpoint step-%d handed off in %.2fs, staging and writing in the background",
                step,
                time.perf_counter() - begin,
            )
        else:
            with self._save_errors(step):
                dcp.save(state, checkpoint_id=partial, process_group=self.dims.cpu_group,
                         no_dist=self._no_dist)  # fmt: skip
                self._finalize(step)
            logger.info("saved checkpoint step-%d in %.2fs", step, time.perf_counter() - begin)

    def _manifest_base(self, step: int, contents: list[str]) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "contents": contents,
            "world_size": self.dims.world_size,
            "torch_version": torch.__version__,
            "config": self.config_dict,
            "data_fingerprint": self.fingerprint,
        }

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
        """Block until a pending async save is written and finalized (or raise its error)."""
        self.wait_for_staging()
        if self._pending is not None:
            future, step = self._pending, self._pending_step
            self._pending = None
            with self._save_errors(step):
                future.result()

    @contextlib.contextmanager
    def _save_errors(self, step: int):
        """A failed write (disk full, I/O error) on any rank: one clear error on every rank.

        DCP gathers every rank's write result and the finalizer every rank's digest,
        so all ranks see the failure together.
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

    def _finalize(self, step: int, share: list[str] | None = None):
        """``step-N.partial`` -> ``step-N`` once every rank's data is on disk.

        Each rank checksums and fsyncs the files it wrote (O(own shard)), or ``share``
        when finishing a partial left by a killed job; rank 0 gathers the digests
        (O(ranks) small messages), writes the manifest, renames, purges, and tells
        every rank the outcome. Runs on the training thread (sync, restart) or the
        finalizer thread (async), always on the checkpoint group.
        """
        partial = step_folder(self.folder, step) + ".partial"
        try:
            names = own_files(partial, self.dims.rank) if share is None else share
            begin = time.perf_counter()
            mine: dict | str = digest(partial, names)
            self.last_checksum_s = time.perf_counter() - begin
            fsync_files(partial, names)
            self.last_fsync_s = time.perf_counter() - begin - self.last_checksum_s
        except OSError as e:
            mine = f"rank {self.dims.rank} could not checksum its files: {e}"
        every = self._gather(mine)
        outcome = [None]
        if self.dims.is_main:
            problems = [d for d in every if isinstance(d, str)]
            if problems:
                outcome = [problems[0]]
            else:
                files = {name: info for d in every for name, info in d.items()}
                try:
                    self._publish(partial, step, files)
                except OSError as e:  # the others wait for the outcome: always send one
                    outcome = [f"rank 0 could not publish step-{step}: {e}"]
        self._broadcast(outcome)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])

    def _publish(self, partial: str, step: int, files: dict):
        """Rank 0: manifest, rename, purge. After this, ``step-N`` is complete and durable."""
        with open(os.path.join(partial, PENDING)) as f:
            manifest = {**json.load(f), "files": files}
        _write_json(os.path.join(partial, MANIFEST), manifest)
        os.remove(os.path.join(partial, PENDING))
        final = step_folder(self.folder, step)
        if os.path.isdir(final):  # an older timeline's step of the same number
            logger.warning("replacing %s with the new checkpoint of that step", final)
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(self.folder)
        self._purge()

    def _purge(self):
        """keep_latest_k counts full checkpoints only: weights-only and seed ones are outputs."""
        if self.keep_latest_k <= 0:
            return
        full = [s for s in complete_steps(self.folder)
                if holds_training_state(step_folder(self.folder, s))]  # fmt: skip
        for step in full[: -self.keep_latest_k]:
            shutil.rmtree(step_folder(self.folder, step), ignore_errors=True)
            logger.info(
                "removed old checkpoint step-%d (keep_latest_k=%d)", step, self.keep_latest_k
            )

    def close(self):
        self.wait()
        if self._finalizer is not None:
            self._finalizer.shutdown()
            self._finalizer = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ---- loading --------------------------------------------------------------------
    def load(self) -> int:
        """Load the timeline's resume point into every component; return its step (0 if none)."""
        path = None
        if self.enabled:
            self._settle_partials()
            path = self._choose()
        if path is None:
            if self.initial_load[0]:
                self._load_initial_weights()
            elif self.enabled:
                logger.info("no checkpoint in %s: starting from scratch", self.folder)
            return 0
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

    def _settle_partials(self):
        """Finish every ``.partial`` whose data is complete; remove the others.

        A kill between DCP's last write and the rename leaves a complete checkpoint
        under its ``.partial`` name: it is finalized here, its files checksummed by
        all ranks in turn (O(total / ranks) each). A partial without all its data is
        an interrupted write and is removed.
        """
        names = [None]
        if self.dims.is_main and os.path.isdir(self.folder):
            names = [sorted(n for n in os.listdir(self.folder) if n.endswith(".partial"))]
        self._broadcast(names)
        for name in names[0] or []:
            path = os.path.join(self.folder, name)
            status = [None]
            if self.dims.is_main:
                complete = os.path.isfile(os.path.join(path, PENDING)) and _dcp_data_complete(path)
                status = ["complete" if complete else "incomplete"]
            self._broadcast(status)
            step = int(name[len("step-") : -len(".partial")])
            if status[0] == "complete":
                logger.warning(
                    "finishing checkpoint %s: its data was written before the job stopped", path
                )
                files = sorted(f for f in os.listdir(path) if f != PENDING)
                try:
                    self._finalize(step, share=files[self.dims.rank :: self.dims.world_size])
                except CheckpointError as e:  # every rank gets the same outcome
                    if self.dims.is_main:
                        logger.warning("removing %s: %s", path, e)
                        shutil.rmtree(path, ignore_errors=True)
            elif self.dims.is_main:
                logger.warning("ignoring and removing incomplete checkpoint %s", path)
                shutil.rmtree(path, ignore_errors=True)
            self._barrier()

    def _choose(self) -> str | None:
        """Rank 0 picks the resume point and moves newer checkpoints aside; all verify it."""
        plan = [None]
        if self.dims.is_main:
            plan = [self._candidates()]
        self._broadcast(plan)
        candidates, problem = plan[0]
        if problem:
            raise CheckpointError(problem)
        chosen = None
        for i, step in enumerate(candidates):
            path = step_folder(self.folder, step)
            problem = self._verify(path)
            if problem is None:
                chosen = step
                break
            older = candidates[i + 1 :]
            if not self.fallback_on_corruption or not older:
                fix = (
                    f"resume from the previous one with --checkpoint.load_step {older[0]}, or set "
                    "--checkpoint.fallback_on_corruption to do that automatically"
                    if older
                    else "there is no older checkpoint: delete it to start from scratch"
                )
                raise CheckpointError(f"checkpoint {path} is damaged: {problem}; {fix}")
            logger.warning(
                "CHECKPOINT %s IS DAMAGED (%s): falling back to an older one", path, problem
            )
        if chosen is None:
            return None
        if self.dims.is_main:
            self._set_aside_after(chosen)
        self._barrier()
        return step_folder(self.folder, chosen)

    def _candidates(self) -> tuple[list[int], str | None]:
        """Rank 0: the steps to try, newest first, or the reason there are none.

        The resume point is the newest checkpoint holding a training state; weights-only
        and seed checkpoints are used only while no full one exists.
        """
        steps = complete_steps(self.folder)
        if self.load_step >= 0:
            if self.load_step not in steps:
                return [], (
                    f"checkpoint.load_step={self.load_step}: no complete checkpoint "
                    f"step-{self.load_step} in {self.folder}; complete steps: {steps or 'none'}"
                )
            return [s for s in steps[::-1] if s <= self.load_step], None
        full = [s for s in steps if holds_training_state(step_folder(self.folder, s))]
        if not full:
            return steps[::-1], None
        for s in steps:
            if s > full[-1]:
                logger.info("not resuming from step-%d: it holds model weights only", s)
        return full[::-1], None

    def _set_aside_after(self, step: int):
        """Rank 0: checkpoints newer than the resume point belong to an abandoned timeline."""
        for s in complete_steps(self.folder):
            if s <= step:
                continue
            src = step_folder(self.folder, s)
            dst, n = src + ".abandoned", 1
            while os.path.exists(dst):
                n += 1
                dst = f"{src}.abandoned-{n}"
            os.replace(src, dst)
            logger.warning(
                "moved %s aside to %s: it is newer than the resume point step-%d, so it "
                "belongs to an abandoned timeline (never resumed, never purged)",
                src, dst, step,
            )  # fmt: skip
        _fsync_dir(self.folder)

    def _verify(self, path: str) -> str | None:
        """Every rank checks a share of the files (O(total / ranks)); all get the first problem."""
        try:
            files = read_manifest(path).get("files", {})
            names = sorted(files)[self.dims.rank :: self.dims.world_size]
            mine = verify_files(path, {n: files[n] for n in names})
        except (OSError, ValueError) as e:
            mine = f"unreadable {MANIFEST} ({e})"
        problems = [p for p in self._all_gather(mine) if p is not None]
        return problems[0] if problems else None

    def _load_initial_weights(self):
        """Start from other weights while the run has no checkpoint of its own: a step
        folder of another job (``dcp``: verified with each rank checking a share of its
        files, O(checkpoint / ranks); then the model entries only, each rank reading its
        own shard) or a Hugging Face folder (``hf``: rank 0 reads it, O(model), and
        broadcasts each rank its part). Every rank raises the same one line on a bad one."""
        path, fmt = self.initial_load
        model = self.states["model"].model
        begin = time.perf_counter()
        if fmt == "dcp":
            self._load_initial_dcp(model, path)
        else:
            _load_initial_hf(model, path, self.dims)
        logger.info(
            "no checkpoint of this run yet: model weights from %s (%s) in %.2fs",
            path, fmt, time.perf_counter() - begin,
        )  # fmt: skip

    def _load_initial_dcp(self, model: torch.nn.Module, path: str):
        what = f"checkpoint.initial_load_path {path}"
        problem = self._verify(path) if os.path.isdir(path) else "it is not a folder"
        if problem:
            raise CheckpointError(f"{what}: {problem}; pass a complete step-N folder")
        problem = format_problem(path)
        if problem:
            raise CheckpointError(
                f"{what} {problem}; convert it with the version that wrote it (e.g. to a HF folder)"
            )
        state = {"model": get_model_state_dict(model)}
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        for name, value in state["model"].items():
            have = getattr(saved.get(f"model.{name}"), "size", None)
            if have is None or tuple(have) != tuple(value.shape):
                raise CheckpointError(
                    f"{what}: model weight {name} is "
                    f"{'absent' if have is None else tuple(have)}, this model's is "
                    f"{tuple(value.shape)}; use the model.flavor and tokenizer of the job "
                    "that wrote it"
                )
        dcp.load(state, checkpoint_id=path, process_group=self.dims.cpu_group,
                 no_dist=self._no_dist)  # fmt: skip
        set_model_state_dict(model, state["model"])

    def _load_from(self, path: str) -> list[str]:
        manifest = read_manifest(path)
        problem = format_problem(path, manifest)
        if problem:
            raise CheckpointError(
                f"checkpoint {path} {problem}; resume it with the version that wrote it"
            )
        saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        present = {k.split(".", 1)[0] for k in saved_keys}
        if "dataloader" in present:  # a weights-only or seed checkpoint has no data position
            self._check_fingerprint(manifest.get("data_fingerprint") or {}, path)
        if "train_state" in present:
            self._log_config_changes(manifest.get("config") or {}, path)
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
        dcp.load(
            state, checkpoint_id=path, process_group=self.dims.cpu_group, no_dist=self._no_dist
        )
        for name, value in state.items():
            self.states[name].load_state_dict(value)
        return list(state)

    def _log_config_changes(self, saved: dict, path: str):
        def resumable(diff: str) -> bool:
            key = diff.split(":")[0]
            return key in _RESUMABLE_CHANGES or key.split(".")[0] in _RESUMABLE_CHANGES

        changes = [d for d in config_diff(saved, self.config_dict) if resumable(d)]
        if changes:
            logger.info("config changed since %s, the config wins: %s", path, "; ".join(changes))

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

    # ---- collectives on the checkpoint group ------------------------------------------
    def _barrier(self):
        barrier(self.dims)

    def _broadcast(self, obj: list):
        if dist.is_initialized():
            dist.broadcast_object_list(obj, src=0, group=self.dims.cpu_group)

    def _gather(self, obj) -> list:
        """Every rank's ``obj`` on rank 0 (others get an empty list)."""
        if not dist.is_initialized():
            return [obj]
        out = [None] * self.dims.world_size if self.dims.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.dims.cpu_group)
        return out or []

    def _all_gather(self, obj) -> list:
        if not dist.is_initialized():
            return [obj]
        out = [None] * self.dims.world_size
        dist.all_gather_object(out, obj, group=self.dims.cpu_group)
        return out


def _load_initial_hf(model: torch.nn.Module, path: str, dims):
    from torchtitan.hf import read_hf_folder

    weights, problem = {}, [None]
    if dims.is_main:
        try:
            weights, _ = read_hf_folder(path, getattr(model, "module", model).args)
        except Exception as e:  # noqa: BLE001 - whatever stops the read is the folder's
            problem = [str(e).splitlines()[0] if str(e) else type(e).__name__]
    if dist.is_initialized():  # every rank raises the same one line
        dist.broadcast_object_list(problem, src=0, group=dims.cpu_group)
    if problem[0]:
        raise CheckpointError(f"checkpoint.initial_load_path {path}: {problem[0]}")
    from_main = dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_main)
    set_model_state_dict(model, weights, options=options)


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


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Each differing leaf of two nested config dicts, as 'section.key: old -> new'."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, name + ".")
        elif a != b:
            diffs.append(f"{name}: {a!r} -> {b!r}")
    return diffs


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
