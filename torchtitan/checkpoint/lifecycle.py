"""A save's life: ``step-N.partial`` written by DCP, then finalized into ``step-N``
(on an object store: ``step-N`` written in place, complete once its manifest is).

Owns: writing a state with DCP (sync, or async on the checkpoint's own gloo group with
one persistent stager), the finalizer (every rank checksums and fsyncs the files it
wrote, rank 0 gathers the digests, writes ``manifest.json``, renames the folder and
starts the purge of checkpoints past ``keep_latest_k`` on a thread of its own, which the
next save waits for), finishing a ``.partial`` that a killed job left behind, and saying
(once, on rank 0, with the figures) when a save has to wait for the previous one's write.

An async save is finalized in a background thread the moment DCP's write completes,
so it is durable without waiting for the next save. A folder named ``step-N`` is
complete by construction: the manifest is written inside the ``.partial`` before the
rename, and a ``.partial`` that already holds a manifest is finished by verifying
against it (a kill between the two is harmless). On an object store (``store``: no
rename) the save is written into ``step-N`` itself and the manifest, written by rank 0
after every rank's digest arrived (so after every rank's upload and DCP's
``.metadata``), is what publishes it; async saves upload from DCP's thread alike.

Only while this job holds the folder's lease (``lease.Lease``, rank 0's): rank 0 asks it
right before each write that starts, publishes or removes a checkpoint (a save's first
write, the manifest, the rename, the purge, the tidying after a failed save), so a job
whose lease lapsed (a store that stopped answering its heartbeat) publishes nothing more,
even a save that was in flight when the store paused. Cost: a clock read each.

Never: choose what to save or what to resume from.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from torchtitan import parallel
from torchtitan.checkpoint import integrity, timeline
from torchtitan.checkpoint.folder import (
    MANIFEST,
    PENDING,
    CheckpointError,
    complete_steps,
    fsync_dir,
    read_manifest,
    remove_checkpoint,
    save_folder,
    step_folder,
    write_json,
)
from torchtitan.checkpoint.lease import LeaseLost
from torchtitan.checkpoint.staging import PipelinedStager
from torchtitan.checkpoint.store import join, store_for
from torchtitan.checkpoint.store_writer import StoreWriteError
from torchtitan.io import storage

logger = logging.getLogger("torchtitan")
# DCP notes on every call of a single process (no process group) that it assumes one;
# here that is intended (python train.py, seed checkpoints), and async saves warn from
# DCP's own thread, out of reach of a local catch_warnings.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


class Saver:
    """Writes and finalizes checkpoints in ``folder``; at most one async save in flight."""

    def __init__(self, folder: str, dims, async_mode: str, keep_latest_k: int,
                 shares_stager_of: Saver | None = None, lease=None):  # fmt: skip
        """``shares_stager_of``: another tier's saver whose staging buffers this one reuses
        (its saves never overlap this one's: the manager waits for both). ``lease``: the
        job's lease (``Lease``: its ``check()`` raises once the job may not write), asked
        before each write; None: no lease to keep."""
        self.folder, self.dims = folder, dims
        self.lease = lease
        self._stager_owner = shares_stager_of
        self.store = store_for(folder)
        self.async_mode, self.keep_latest_k = async_mode, keep_latest_k
        self._staging: Future | None = None  # the in-memory copy of an async save
        self._pending: Future | None = None  # its write and finalization
        self._pending_step = -1
        self._pending_began = 0.0  # when that save was called (perf_counter)
        self._said_overlap = False  # a save waited for the previous one: said once
        self._stager = None
        self._finalizer = None  # one background thread: finalizes async saves in order
        self._purger = None  # rank 0's thread removing checkpoints past keep_latest_k
        self._purging: Future | None = None  # that purge, until a wait() took it
        self._last_purge: Future | None = None  # the last one started (for after_write)
        # This rank's share of the last finalization: checksumming and fsyncing its files.
        self.last_checksum_s = self.last_fsync_s = 0.0
        # The last async save from its call to the end of its finalization.
        self.last_write_s = 0.0

    @property
    def writing(self) -> bool:
        """An async save is being written or finalized, or a save's purge is running."""
        return any(f is not None and not f.done() for f in (self._pending, self._last_purge))

    def _may_write(self):
        """Raise ``LeaseLost`` unless this job still holds the folder (rank 0 holds the
        lease; elsewhere always true). Asked right before a write: a request that waited on
        a paused store may return past the lease's deadline."""
        if self.lease is not None:
            self.lease.check()

    def _writer(self, partial: str):
        """DCP's writer for ``partial``; a store's asks ``_may_write`` before every request
        (rank 0: a save that began in time sends nothing once the lease has lapsed)."""
        writer = self.store.writer(partial)
        if hasattr(writer, "may_write"):
            writer.may_write = self._may_write
        return writer

    @property
    def _no_dist(self) -> bool:
        return not torch.distributed.is_initialized()

    def save(self, step: int, state: dict, manifest: dict):
        """Write ``step-N``; in async mode return once the copy to memory has started.

        Blocks the caller for: a pending async save of an earlier step (normally done
        long before), and (sync mode) the write and finalization.
        """
        self.wait()
        partial = save_folder(self.folder, step)

        def prepare():
            with self._save_errors(step):
                self._may_write()
                if self.store.in_place:  # written in place: an older timeline's step-N first
                    timeline.make_room(self.folder, step)
                remove_checkpoint(partial)
                self.store.makedirs(partial)
                _write_pending(join(partial, PENDING), manifest)
                self._may_write()  # no data written after a prep that outlived the lease

        # Rank 0 prepares the folder while the others wait; its error (a lapsed lease, a
        # store's fault) is every rank's, at once, rather than theirs once rank 0 exits.
        parallel.on_main(self.dims, prepare)
        begin = time.perf_counter()
        if self.async_mode == "async":
            stager, writer = self._async_stager(), self._writer(partial)
            if isinstance(stager, PipelinedStager):  # a store writer uploads as it goes
                stager.pipelined = hasattr(writer, "staging")
                if stager.pipelined:
                    writer.staging = stager
            with self._save_errors(step):
                response = dcp.async_save(
                    state,
                    checkpoint_id=partial,
                    storage_writer=writer,
                    process_group=self.dims.cpu_group,
                    async_stager=stager,
                    no_dist=self._no_dist,
                )
            if isinstance(response, AsyncSaveResponse):
                self._staging, written = response.staging_completion, response.upload_completion
            else:  # handed over at once: the stager's copies are the staging; one that
                # failed fails the write on every rank, reported once by wait()
                self._staging, written = stager.settled, response
            if self._finalizer is None:
                self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-finalize")
            self._pending = self._finalizer.submit(self._write_and_finalize, written, step, begin)
            self._pending_step, self._pending_began = step, begin
            logger.info(
                "checkpoint step-%d handed off in %.2fs, staging and writing in the background",
                step,
                time.perf_counter() - begin,
            )
        else:
            with self._save_errors(step):
                dcp.save(state, checkpoint_id=partial, storage_writer=self._writer(partial),
                         process_group=self.dims.cpu_group, no_dist=self._no_dist)  # fmt: skip
                self.finalize(step)
            logger.info("saved checkpoint step-%d in %.2fs", step, time.perf_counter() - begin)

    def _write_and_finalize(self, written: Future, step: int, began: float):
        try:
            written.result()
            self.finalize(step)
        finally:
            self.last_write_s = time.perf_counter() - began

    def wait_for_previous(self, step: int):
        """``wait()`` before saving ``step``. When the previous async save is still being
        written, the loop waits here: said once per run, with the figures, since every
        later save at this interval waits the same way."""
        pending = self._pending
        if pending is None or pending.done():
            return self.wait()
        begin = time.perf_counter()
        previous, previous_began = self._pending_step, self._pending_began
        self.wait()
        waited = time.perf_counter() - begin
        if self._said_overlap or not self.dims.is_main:  # every rank waits alike
            return
        self._said_overlap = True
        steps, interval_s = step - previous, begin - previous_began
        write_s = self.last_write_s
        enough = max(steps + 1, math.ceil(steps * write_s / max(interval_s, 1e-9)))
        logger.warning(
            "checkpoint interval %d steps (%.2f s) is shorter than a save's write (%.2f s); "
            "the loop waited %.2f s (said once; --checkpoint.interval %d or more hides the write)",
            steps, interval_s, write_s, waited, enough,
        )  # fmt: skip

    def _async_stager(self):
        # One stager for the whole run: it keeps its CPU copy buffers between saves,
        # and stages in a background thread so the save returns at once. On CPU, one
        # that a store writer uploads from as it copies (staging.py).
        if self._stager_owner is not None:
            return self._stager_owner._async_stager()
        if self._stager is None and not torch.cuda.is_available():
            self._stager = PipelinedStager()
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
        if self._staging is not None:  # cleared first: a failed one is raised once
            staging, self._staging = self._staging, None
            staging.result()

    def after_write(self, callback):
        """Call ``callback()`` once a pending async save is written and finalized (or has
        failed) and the purge after it is done, from their thread; now if none is running."""

        def after_purge(_=None):  # a finished save's purge was started before it ended
            purge = self._last_purge
            if purge is None:
                callback()
            else:
                purge.add_done_callback(lambda _: callback())  # runs now if already done

        pending = self._pending
        if pending is None:
            after_purge()
        else:
            pending.add_done_callback(after_purge)

    def wait(self):
        """Block until a pending async save is written and finalized (or raise its error),
        and the purge after the last save is done."""
        try:
            if self._pending is None:
                self.wait_for_staging()
            else:
                future, step = self._pending, self._pending_step
                self._pending = None
                with self._save_errors(step):  # a failed staging is the save's one line too
                    staging = None
                    try:
                        self.wait_for_staging()
                    except Exception as e:  # noqa: BLE001 - raised below, after the write ends
                        staging = e
                    future.result()  # the write's error (a failed staging fails it as well)
                    if staging is not None:
                        raise staging
        finally:  # even after a failed save, no purge outlives wait() (close, the lease)
            if self._purging is not None:  # set by the save just waited for, if it published
                purging, self._purging = self._purging, None
                purging.result()

    @contextlib.contextmanager
    def _save_errors(self, step: int):
        """A failed write (disk full, I/O error) on any rank: one clear error on every rank.

        DCP gathers every rank's write result and the finalizer every rank's digest,
        so all ranks see the failure together.
        """
        try:
            yield
        except LeaseLost:
            raise  # the folder may be another job's: nothing here is ours to tidy
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            if self.lease is not None and not self.lease.valid():  # lapsed during the save
                raise LeaseLost(self.lease.problem()) from None
            remove_checkpoint(save_folder(self.folder, step))
            done = complete_steps(self.folder)
            last = ("step-" + str(done[-1])) if done else "none"
            store = store_problem(e)
            if store is not None:  # names the object and the fix already
                raise CheckpointError(f"saving checkpoint step-{step} in {self.folder} failed: "
                                      f"{store} (last complete checkpoint: {last})") from e  # fmt: skip
            raise CheckpointError(
                f"saving checkpoint step-{step} in {self.folder} failed: {root_cause(e)}; free "
                f"space or set --checkpoint.folder elsewhere, then resume (last complete "
                f"checkpoint: {last})"
            ) from e

    def finalize(self, step: int, share: list[str] | None = None):
        """``step-N.partial`` -> ``step-N`` once every rank's data is on disk (on a store:
        ``step-N``'s manifest written once every rank's data is uploaded).

        Each rank checksums and fsyncs the files it wrote (O(own shard)), or ``share``
        when finishing a partial left by a killed job; rank 0 gathers the digests
        (O(ranks) small messages), writes the manifest, renames, starts the purge
        (``publish``), and tells every rank the outcome. Runs on the training thread
        (sync, restart) or the finalizer thread (async), always on the checkpoint group.
        """
        partial = save_folder(self.folder, step)
        try:
            names = integrity.own_files(partial, self.dims.rank) if share is None else share
            begin = time.perf_counter()
            mine: dict | str = integrity.digest(partial, names)
            self.last_checksum_s = time.perf_counter() - begin
            integrity.fsync_files(partial, names)
            self.last_fsync_s = time.perf_counter() - begin - self.last_checksum_s
        except OSError as e:
            mine = f"rank {self.dims.rank} could not checksum its files: {e}"
        every = parallel.gather_objects(self.dims, mine)
        outcome = None
        if self.dims.is_main:
            problems = [d for d in every if isinstance(d, str)]
            if problems:
                outcome = problems[0]
            else:
                files = {name: info for d in every for name, info in d.items()}
                try:
                    manifest = {**read_manifest(partial, PENDING), "files": files}
                    self._may_write()  # the commit point: a store's manifest publishes
                    write_json(join(partial, MANIFEST), manifest)
                    self.publish(step, purge_later=share is None)
                except LeaseLost as e:  # every rank raises it: none tidies the folder
                    outcome = e
                except Exception as e:  # noqa: BLE001 - the others wait for the outcome: send one
                    said = store_problem(e) or root_cause(e)
                    outcome = f"rank 0 could not publish step-{step}: {said}"
        outcome = parallel.broadcast_from_main(self.dims, outcome)
        if isinstance(outcome, LeaseLost):
            raise LeaseLost(str(outcome))
        if outcome is not None:
            raise CheckpointError(outcome)

    def publish(self, step: int, purge_later: bool = False):
        """Rank 0: a ``.partial`` holding its manifest becomes ``step-N``, then the purge.

        The manifest is written before this, inside the partial: a kill anywhere in here
        leaves either a partial with a manifest (finished by ``finish_partial``) or a
        complete ``step-N``. On a store the manifest was the publication: only the purge.

        ``purge_later`` (a save, not a start finishing a killed one): the purge runs on a
        thread of its own, which the next save, a rewind and ``close`` wait for (``wait``),
        so that neither a sync save's caller nor an async save's durable time waits for
        deletes (on the local S3 server 0.6-1.0 s for a 125M checkpoint; a local folder's
        rmtree of GBs). It is kill-safe as it was (``remove_checkpoint``: manifest first).
        """
        partial = save_folder(self.folder, step)
        self.store.remove(join(partial, PENDING))
        if not self.store.in_place:
            timeline.make_room(self.folder, step)
            self._may_write()  # the commit point on a disk: the rename publishes
            self.store.move_folder(partial, step_folder(self.folder, step), last=MANIFEST)
            fsync_dir(self.folder)
        if not purge_later:
            self._may_write()
            timeline.purge(self.folder, self.keep_latest_k)
            return
        if self._purger is None:
            self._purger = ThreadPoolExecutor(1, thread_name_prefix="ckpt-purge")
        self._purging = self._last_purge = self._purger.submit(self._purge, step)

    def _purge(self, step: int):
        """The purge after ``step-N``; a failure is a warning (the step is published; a
        later save's purge removes what is left)."""
        try:
            self._may_write()
            timeline.purge(self.folder, self.keep_latest_k)
        except LeaseLost:
            pass  # the folder may be another job's; the loop stops on the lease's line
        except Exception as e:  # noqa: BLE001 - cleanup: never fails a published save
            logger.warning("removing checkpoints older than step-%d in %s failed: %s; a later "
                           "save removes them", step, self.folder, e)  # fmt: skip

    def finish_partial(self, step: int):
        """Finish or remove ``step-N.partial`` left by a killed job (collective, every rank).

        - it holds ``manifest.json``: the kill came after the digests were written;
          the ranks verify their share of its files against it (O(total / ranks)) and
          rank 0 renames it;
        - it holds only the pending manifest and DCP's data is complete: the kill came
          between DCP's last write and the finalization; the ranks digest a share of
          its files each and it is finalized;
        - otherwise it is an interrupted write and is removed.
        """
        path = save_folder(self.folder, step)
        status = None
        if self.dims.is_main:
            if self.store.isfile(join(path, MANIFEST)):
                status = "manifest"
            elif self.store.isfile(join(path, PENDING)) and integrity.dcp_data_complete(path):
                status = "data"
            else:
                status = "incomplete"
        status = parallel.broadcast_from_main(self.dims, status)
        if status == "incomplete":
            if self.dims.is_main:
                logger.warning("ignoring and removing incomplete checkpoint %s", path)
                remove_checkpoint(path)
            parallel.barrier(self.dims)
            return
        logger.warning("finishing checkpoint %s: its data was written before the job stopped", path)
        try:
            if status == "manifest":
                self._publish_verified(step, path)
            else:
                files = integrity.data_files(path)
                self.finalize(step, share=files[self.dims.rank :: self.dims.world_size])
        except LeaseLost:
            raise  # not this job's folder any more: nothing removed
        except CheckpointError as e:  # every rank gets the same outcome
            if self.dims.is_main:
                logger.warning("removing %s: %s", path, e)
                remove_checkpoint(path)
        parallel.barrier(self.dims)

    def _publish_verified(self, step: int, path: str):
        mine = integrity.verify_share(path, self.dims.rank, self.dims.world_size)
        problems = [p for p in parallel.all_gather_objects(self.dims, mine) if p is not None]
        if problems:
            raise CheckpointError(problems[0])
        outcome = None
        if self.dims.is_main:
            try:
                read_manifest(path)  # readable, or the partial is not finished
                self.publish(step)
            except LeaseLost as e:
                outcome = e
            except (OSError, ValueError) as e:
                outcome = f"rank 0 could not publish step-{step}: {e}"
        outcome = parallel.broadcast_from_main(self.dims, outcome)
        if isinstance(outcome, LeaseLost):
            raise LeaseLost(str(outcome))
        if outcome is not None:
            raise CheckpointError(outcome)

    def close(self):
        self.wait()
        if self._finalizer is not None:
            self._finalizer.shutdown()
            self._finalizer = None
        if self._purger is not None:
            self._purger.shutdown()
            self._purger = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _write_pending(path: str, manifest: dict):
    """The pending manifest; a store's fault is one line naming the object."""
    try:
        write_json(path, manifest)
    except OSError as e:
        fault = storage.store_fault(e)
        if fault is None:
            raise
        raise StoreWriteError(f"writing {path}: {fault}") from None


def store_problem(e: BaseException) -> str | None:
    """The line of a store writer's error behind ``e`` (its chain, or any rank's failure
    that DCP gathered into a CheckpointException), naming the object and the fix; None if
    the save failed otherwise."""
    todo, seen = [e], set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, StoreWriteError):
            return str(error)
        if isinstance(error, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in error.failures.values())
        todo.extend([error.__cause__, error.__context__])
    return None


def root_cause(e: BaseException) -> str:
    """DCP wraps every rank's traceback into one message; keep the first 'XError: ...' line."""
    text = str(e)
    match = re.search(r"^\w*(Error|Exception): .*$", text, flags=re.MULTILINE)
    line = match.group(0) if match else (text.splitlines() or [type(e).__name__])[0]
    return line[:300]
