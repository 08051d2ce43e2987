"""One job per checkpoint folder: the lease file ``<folder>/lease.json``.

Owns: taking, renewing and releasing the lease, and saying whether this job may still
write the folder (``valid``, ``check``). It records the holder (host, pid, job id if a
scheduler set one, start time, the holder's timeout); its heartbeat is the file's
modification time, renewed by a daemon thread every ``timeout / 6`` seconds (at most
10 s), so the training thread never waits on it. Only rank 0 holds it.

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

**The holder gives up before anyone may take over.** A taker may act once the heartbeat
is ``timeout`` old by its own reading; the holder counts from when it *sent* its last
successful renewal (the monotonic clock; the store's or the disk's time of that write is
later still), and holds the lease valid until that moment plus ``timeout - margin``. The
margin is a quarter of the timeout, and at least two heartbeats (a third of the timeout
up to 60 s; 20 s at the default 60 s). It covers what separates the holder's clock from
a taker's reading: the store's ages are whole seconds (a fractional timeout is reached up
to a second early), the clocks of two machines sharing a disk differ, and a write checked
against the deadline just before it was sent must land before a taker acts. Past the
deadline the lease is lost for good, whatever a late reply says: the heartbeat stops, and
every write path asks ``check()`` (the training loop every step, through the manager;
the save's start, its commit point and its purge), so a job that may have lost its folder
writes nothing more there and stops in one line on every rank. The holder has
``timeout - margin`` (four heartbeats up to 60 s) to renew: a store that answers again
within it costs nothing.

Any failure of a renewal (an ``OSError`` of a disk, any error of a store's client:
botocore's ``EndpointConnectionError``, a timeout, a 5xx) is a missed heartbeat: said in
one warning line naming the folder (once per run of failures), never a dead thread or a
traceback. ``release`` likewise never raises, and touches nothing once the lease may be
lost (a taker's lease is never deleted: the release is conditional on this job's token,
and is not even tried past the deadline, where a disk's read-then-remove could race a
taker).

Cost: taking it: one small file written and linked (plus polls of it while waiting);
holding it: one small read and one ``utime`` per heartbeat, off the training thread. In a
store: one PUT to take it; one GET and one PUT per heartbeat (at most every 10 s: ~17,000
requests a job-day, a few cents); each poll while waiting, one GET. On the training
thread: ``valid()`` reads the clock and a flag under a lock, nothing else.

Never: read or write checkpoints, or stop the holder's job (the manager and the loop do,
when ``check()`` says so).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

from torchtitan.checkpoint.folder import CheckpointError
from torchtitan.io import claims, storage

logger = logging.getLogger("torchtitan")

LEASE = "lease.json"
_JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "TORCHELASTIC_RUN_ID")
_POLL_S = 0.25
_JOIN_S = 2.0  # a release waits this long for a heartbeat in flight (a request: ms)


class LeaseLost(CheckpointError):
    """This job lost, or may have lost, its checkpoint folder's lease: it writes nothing
    more there. The message names the folder, why, and the fix."""


def job_id() -> str | None:
    """The scheduler's id for this job, if one set it (Slurm, PBS, LSF, SGE, torchrun)."""
    for var in _JOB_ID_VARS:
        if os.environ.get(var) and os.environ[var] != "none":
            return os.environ[var]
    return None


def describe(holder: dict) -> str:
    return claims.describe(holder)


def one_line(error: BaseException) -> str:
    """A failure in one line: a store's fault as ``storage`` words it (naming the store
    and the fix), else the error's type and first line."""
    fault = storage.store_fault(error)
    if fault is not None:
        return fault
    text = (str(error).splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Lease:
    """The lease on ``folder``: ``acquire()`` once, ``release()`` at the end (idempotent);
    ``valid()`` / ``check()`` before writing the folder."""

    def __init__(self, folder: str, timeout_s: float, wait_s: float):
        self.folder, self.timeout_s, self.wait_s = folder, timeout_s, wait_s
        self.path = storage.join(folder, LEASE)
        self.record = claims.record(job_id=job_id(), timeout_s=timeout_s)
        self.record["started"] = self.record["since"]
        self.token = self.record["token"]
        self.held = False
        self.lost: dict | None = None  # set once, never cleared: the new holder ({}: unknown)
        self._why = ""  # why it was lost, for check()'s line
        self._lock = threading.Lock()
        # Monotonic: until when the lease is this job's for sure. Not held (other ranks, a
        # disabled checkpoint): nothing to lose.
        self._valid_until = math.inf
        self.renewed_at = math.nan  # when the last successful renewal (or the take) was sent
        self.lost_at = math.nan  # when this job first counted the lease lost (monotonic)
        self._last_failure = ""  # the last renewal's failure, in one line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, min(10.0, self.timeout_s / 6))

    @property
    def margin_s(self) -> float:
        """How long before a taker may act the holder counts the lease lost (see above)."""
        # mutant lease-no-margin: `max(self.timeout_s / 4, 2 * self.heartbeat_s)` -> `0.0`; test/checkpoint/test_lease.py::test_a_holder_cut_off_from_its_store_gives_up_before_a_taker_may_act
        return max(self.timeout_s / 4, 2 * self.heartbeat_s)

    def acquire(self):
        """Take the lease, waiting up to ``wait_s`` for a live holder; raise if it stays."""
        storage.makedirs(self.folder)
        deadline = time.monotonic() + self.wait_s
        said = False
        while True:
            sent = time.monotonic()
            if claims.create(self.path, self.record, durable=True):
                break
            seen = claims.read(self.path)
            if seen is None:  # released meanwhile: create it again
                continue
            why = claims.gone(seen, self._stale_s(seen.record))
            if why is not None:
                sent = time.monotonic()
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
        with self._lock:
            self.held = True
            self.renewed_at = sent
            self._valid_until = sent + self.timeout_s - self.margin_s
        self._thread = threading.Thread(target=self._beat, name="ckpt-lease", daemon=True)
        self._thread.start()
        storage.guard_writes(self.folder, self.check)  # every write request there asks it first

    def _stale_s(self, holder: dict) -> float:
        """The holder's own timeout (a torn lease, which names none: this job's)."""
        try:
            return float(holder.get("timeout_s", self.timeout_s))
        except (TypeError, ValueError):
            return self.timeout_s

    # ---- the heartbeat (its own thread) -----------------------------------------------
    def _beat(self):
        failing_since = None
        while not self._stop.wait(self.heartbeat_s):
            if not self.valid():
                break
            sent = time.monotonic()
            try:
                renewed = self._renew()
            except Exception as e:  # noqa: BLE001 - any failure of a renewal is a missed beat
                renewed, self._last_failure = None, one_line(e)
            if self.lost is not None or self._stop.is_set():
                break
            if renewed:
                self._renewed(sent)
                if failing_since is not None:
                    logger.warning("the lease on %s is renewed again, after %.1fs of failures",
                                   self.folder, time.monotonic() - failing_since)  # fmt: skip
                failing_since, self._last_failure = None, ""
            elif self._last_failure and failing_since is None:
                failing_since = sent
                logger.warning(
                    "renewing the lease on %s failed (%s); retrying every %.2gs: this job stops "
                    "if it is not renewed within %.0fs", self.folder, self._last_failure,
                    self.heartbeat_s, max(0.0, self._valid_until - time.monotonic()),
                )  # fmt: skip
        if self.lost is not None and not self._stop.is_set():
            logger.error("%s", self.problem())

    def _renew(self) -> bool:
        """One heartbeat: True when renewed; False when not (a torn read, a write the
        store refused: looked at again next beat); a lost lease is recorded (``lost``)."""
        seen = claims.read(self.path)
        if seen is not None and seen.torn:  # a fallback file system's write: look again
            return False
        if seen is None or seen.record.get("token") != self.token:
            taken = seen.record if seen is not None else {}
            self._lose(taken, "another job took it over" if taken else "its file was removed")
            return False
        if self._stop.is_set() or not self.valid():  # released, or lapsed while reading
            return False
        if claims.touch(self.path, self.token, seen):
            return True
        self._last_failure = self._last_failure or "the renewal was not written"
        return False

    def _renewed(self, sent: float):
        """A renewal sent at ``sent`` succeeded: valid until ``sent + timeout - margin``,
        unless the deadline passed while it was in flight (lost for good: a check may
        have said so already)."""
        with self._lock:
            if self.lost is None and time.monotonic() < self._valid_until:
                self.renewed_at = sent
                self._valid_until = max(self._valid_until,
                                        sent + self.timeout_s - self.margin_s)  # fmt: skip

    def _lose(self, holder: dict, why: str):
        with self._lock:
            if self.lost is None:
                self.lost, self._why, self.lost_at = holder, why, time.monotonic()

    # ---- asked before writing (any thread) --------------------------------------------
    def valid(self) -> bool:
        """Whether this job may still write the folder: the lease is held (or was never
        this process's to hold) and its deadline has not passed. Once False, False for
        good. Cost: one clock read under a lock."""
        with self._lock:
            if self.lost is None and time.monotonic() >= self._valid_until:
                since = time.monotonic() - self.renewed_at
                failure = self._last_failure or "its storage gave no answer"
                self.lost, self.lost_at = {}, self._valid_until
                self._why = (f"its heartbeat could not renew it (last renewed {since:.1f}s "
                             f"ago; {failure})")  # fmt: skip
            return self.lost is None

    def problem(self) -> str | None:
        """The one line saying why this job may not write the folder (None: it may)."""
        if self.valid():
            return None
        if self._why == "released":
            return (f"this job released the lease on checkpoint folder {self.folder} and may "
                    "not write there any more")  # fmt: skip
        if self.lost:  # another job's record is there
            return (
                f"this job lost the lease on checkpoint folder {self.folder} to "
                f"{describe(self.lost)}, which took it over (this job's heartbeat was not "
                f"renewed for checkpoint.lease_timeout_seconds {self.timeout_s:g}s); this one "
                "stops without writing there: stop one of the two jobs, or give this one its "
                "own --job.dump_folder"
            )
        return (
            f"this job lost the lease on checkpoint folder {self.folder}: "
            f"{self._why}; another job may take the folder over once the lease is "
            f"{self.timeout_s:g}s old (checkpoint.lease_timeout_seconds), so this one stops "
            "without writing there. Relaunch once the folder's store answers: the job resumes "
            "from its newest complete checkpoint (if another job holds the folder now, stop "
            "one of them or give this one its own --job.dump_folder)"
        )

    def check(self):
        """Raise ``LeaseLost`` (one line naming the folder and the fix) unless ``valid()``."""
        problem = self.problem()
        if problem is not None:
            raise LeaseLost(problem)

    def release(self):
        """Stop the heartbeat and remove the lease if it is still this job's and still
        valid (idempotent). Never raises: a failure is one warning line; a lease that may
        be lost, or a heartbeat stuck on a store that does not answer, is left to age out."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if not self.held:
            return
        storage.unguard_writes(self.folder, self.check)
        self.held = False
        if not self.valid():
            return  # may be another job's by now: not ours to touch (nor to wait for)
        if thread is not None:
            thread.join(timeout=_JOIN_S)
        if thread is not None and thread.is_alive():  # waiting on the store: it may still write
            self._lose({}, "released")
            logger.warning("the lease on %s is left to expire: its store did not answer its "
                           "heartbeat; the next job takes it over after %gs", self.folder,
                           self.timeout_s)  # fmt: skip
            return
        if not self.valid():
            return
        try:
            claims.release(self.path, self.token)
        except Exception as e:  # noqa: BLE001 - a release is best effort; the lease ages out
            logger.warning("releasing the lease on %s failed (%s); the next job takes it over "
                           "after %gs", self.folder, one_line(e), self.timeout_s)  # fmt: skip
        finally:
            self._lose({}, "released")
