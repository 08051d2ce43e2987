"""One job per checkpoint folder: the lease file ``<folder>/lease.json``.

Owns: taking, renewing and releasing the lease. It records the holder (host, pid, job
id if a scheduler set one, start time, the holder's timeout); its heartbeat is the
file's modification time, renewed by a daemon thread every ``timeout / 6`` seconds
(at most 10 s), so the training thread never waits on it. Only rank 0 holds it.

A job that finds a live holder waits up to ``wait_s`` for it to go (the requeue race:
a preempted job still writing its last checkpoint while its successor starts), then
stops with one line naming the holder. A lease whose heartbeat is older than the
holder's own timeout is stale (its job was killed) and is taken over with a warning;
so is, at once, one whose holder ran on this machine (its boot id), in this pid
namespace, and whose process is gone (a ``kill -9`` relaunched on the same node need
not wait the timeout).
The live holder is never touched: a job only replaces a lease it has seen go stale.
Creating, judging and taking over are ``torchtitan.io.claims``'s, the same rule the count
claims follow: the record is published whole (written aside, then linked onto
``lease.json``), a torn lease (empty or half-written) is judged by its age, and "its
process is gone" needs this kernel's boot id and pid namespace, never the host name.

A folder that is a URL (``s3://bucket/prefix``) takes its lease in the store, through the
same claims: an exclusive PUT (``If-None-Match: *``), a heartbeat that rewrites the record
only while it is this job's (``If-Match`` on its ETag), its age the store's LastModified
against the store's clock, and a take-over conditional on the ETag seen stale; the same
messages, naming the holder.

Cost: taking it: one small file written and linked (plus polls of it while waiting);
holding it: one small read and one ``utime`` per heartbeat, off the training thread. In a
store: one PUT to take it; one GET and one PUT per heartbeat (at most every 10 s: ~17,000
requests a job-day, a few cents); each poll while waiting, one GET.

Never: read or write checkpoints, or stop the holder's job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from torchtitan.checkpoint.folder import CheckpointError
from torchtitan.io import claims, storage

logger = logging.getLogger("torchtitan")

LEASE = "lease.json"
_JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "TORCHELASTIC_RUN_ID")
_POLL_S = 0.25


def job_id() -> str | None:
    """The scheduler's id for this job, if one set it (Slurm, PBS, LSF, SGE, torchrun)."""
    for var in _JOB_ID_VARS:
        if os.environ.get(var) and os.environ[var] != "none":
            return os.environ[var]
    return None


def describe(holder: dict) -> str:
    return claims.describe(holder)


class Lease:
    """The lease on ``folder``: ``acquire()`` once, ``release()`` at the end (idempotent)."""

    def __init__(self, folder: str, timeout_s: float, wait_s: float):
        self.folder, self.timeout_s, self.wait_s = folder, timeout_s, wait_s
        self.path = storage.join(folder, LEASE)
        self.record = claims.record(job_id=job_id(), timeout_s=timeout_s)
        self.record["started"] = self.record["since"]
        self.token = self.record["token"]
        self.held = False
        self.lost: dict | None = None  # the holder that took it over, if one did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, min(10.0, self.timeout_s / 6))

    def acquire(self):
        """Take the lease, waiting up to ``wait_s`` for a live holder; raise if it stays."""
        storage.makedirs(self.folder)
        deadline = time.monotonic() + self.wait_s
        said = False
        while True:
            if claims.create(self.path, self.record, durable=True):
                break
            seen = claims.read(self.path)
            if seen is None:  # released meanwhile: create it again
                continue
            why = claims.gone(seen, self._stale_s(seen.record))
            if why is not None:
                if claims.take_over(self.path, seen, self.record, self._stale_s(seen.record),
                                    durable=True):  # fmt: skip
                    logger.warning(
                        "taking over the lease on %s from %s: %s, so that job is gone",
                        self.folder, describe(seen.record), why,
                    )  # fmt: skip
                    break
                time.sleep(_POLL_S / 5)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"checkpoint folder {self.folder} is in use by another job "
                    f"({describe(seen.record)}, heartbeat {seen.age:.0f}s ago); waited "
                    f"{self.wait_s:g}s (checkpoint.lease_wait_seconds) for it to exit. Stop "
                    f"that job, or give this one its own --job.dump_folder"
                )
            if not said:
                logger.warning(
                    "checkpoint folder %s is held by %s: waiting up to %gs for it to exit",
                    self.folder, describe(seen.record), self.wait_s,
                )  # fmt: skip
                said = True
            time.sleep(min(_POLL_S, left))
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _stale_s(self, holder: dict) -> float:
        """The holder's own timeout (a torn lease, which names none: this job's)."""
        try:
            return float(holder.get("timeout_s", self.timeout_s))
        except (TypeError, ValueError):
            return self.timeout_s

    def _beat(self):
        renewed = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            try:
                seen = claims.read(self.path)
            except OSError as e:  # a network filesystem's hiccup (ESTALE, EIO): try again
                if time.monotonic() - renewed > self.timeout_s:
                    self.lost = {}
                    logger.error("the lease on %s could not be renewed for %gs (%s): this "
                                 "job stops at its next save", self.folder, self.timeout_s, e)  # fmt: skip
                    return
                continue
            if seen is not None and seen.torn:  # a fallback file system's write: look again
                continue
            if seen is None or seen.record.get("token") != self.token:
                self.lost = seen.record if seen is not None else {}
                logger.error(
                    "the lease on %s was lost (%s): another job may write there; this job "
                    "stops at its next save", self.folder,
                    describe(seen.record) if seen is not None else "the file was removed",
                )  # fmt: skip
                return
            if claims.touch(self.path, self.token, seen):
                renewed = time.monotonic()

    def check(self):
        """Raise if the lease was lost (taken over after a stall longer than the timeout)."""
        if self.lost is not None:
            raise CheckpointError(
                f"this job lost the lease on checkpoint folder {self.folder} (now "
                f"{describe(self.lost) if self.lost else 'nobody'}): its heartbeat stalled past "
                "checkpoint.lease_timeout_seconds; not saving over another job's checkpoints"
            )

    def release(self):
        """Stop the heartbeat and remove the lease if it is still this job's."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.held:
            self.held = False
            with contextlib.suppress(OSError):
                claims.release(self.path, self.token)
