"""One job per checkpoint folder: the lease file ``<folder>/lease.json``.

Owns: taking, renewing and releasing the lease. It records the holder (host, pid, job
id if a scheduler set one, start time, the holder's timeout); its heartbeat is the
file's modification time, renewed by a daemon thread every ``timeout / 6`` seconds
(at most 10 s), so the training thread never waits on it. Only rank 0 holds it.

A job that finds a live holder waits up to ``wait_s`` for it to go (the requeue race:
a preempted job still writing its last checkpoint while its successor starts), then
stops with one line naming the holder. A lease whose heartbeat is older than the
holder's own timeout is stale (its job was killed) and is taken over with a warning;
so is, at once, one whose holder ran on this host, in this pid namespace, and whose
process is gone (a ``kill -9`` relaunched on the same node need not wait the timeout).
The live holder is never touched: a job only replaces a lease it has seen go stale,
under a short-lived takeover file created with ``O_EXCL``.

Cost: taking it: one ``O_EXCL`` create (plus polls of one small file while waiting);
holding it: one small read and one ``utime`` per heartbeat, off the training thread.

Never: read or write checkpoints, or stop the holder's job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from torchtitan.checkpoint.folder import CheckpointError

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
    job = f"job {holder['job_id']}, " if holder.get("job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"{job}host {holder.get('host')}, pid {holder.get('pid')}, started {started}"


class Lease:
    """The lease on ``folder``: ``acquire()`` once, ``release()`` at the end (idempotent)."""

    def __init__(self, folder: str, timeout_s: float, wait_s: float):
        self.folder, self.timeout_s, self.wait_s = folder, timeout_s, wait_s
        self.path = os.path.join(folder, LEASE)
        self.token = uuid.uuid4().hex
        self.held = False
        self.lost: dict | None = None  # the holder that took it over, if one did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, min(10.0, self.timeout_s / 6))

    def _record(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace(),
                "job_id": job_id(), "started": time.time(), "timeout_s": self.timeout_s,
                "token": self.token}  # fmt: skip

    def acquire(self):
        """Take the lease, waiting up to ``wait_s`` for a live holder; raise if it stays."""
        os.makedirs(self.folder, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        said = False
        while True:
            if self._create():
                break
            holder, age = self._read()
            if holder is None:  # released meanwhile: create it again
                continue
            why = self._gone(holder, age)
            if why is not None:
                if self._take_over(holder, why):
                    break
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(
                    f"checkpoint folder {self.folder} is in use by another job ({describe(holder)}, "
                    f"heartbeat {age:.0f}s ago); waited {self.wait_s:g}s "
                    f"(checkpoint.lease_wait_seconds) for it to exit. Stop that job, or give "
                    f"this one its own --job.dump_folder"
                )
            if not said:
                logger.warning(
                    "checkpoint folder %s is held by %s: waiting up to %gs for it to exit",
                    self.folder, describe(holder), self.wait_s,
                )  # fmt: skip
                said = True
            time.sleep(min(_POLL_S, left))
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _gone(self, holder: dict, age: float) -> str | None:
        """Why the holder's job is gone (so its lease may be taken over), or None."""
        timeout = float(holder.get("timeout_s", self.timeout_s))
        if age > timeout:
            return f"its heartbeat is {age:.0f}s old (timeout {timeout:g}s)"
        if _process_gone(holder):
            return "its process is gone"
        return None

    def _create(self) -> bool:
        """Create the lease file if there is none (atomic: O_EXCL)."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._record(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read(self) -> tuple[dict | None, float]:
        """The holder's record and its heartbeat's age in seconds; (None, 0) if there is no
        lease, ``{}`` for one not written yet (or whose writer was killed mid-write)."""
        try:
            with open(self.path) as f:
                age = time.time() - os.fstat(f.fileno()).st_mtime
                try:
                    return json.load(f), age
                except ValueError:
                    return {}, age
        except FileNotFoundError:
            return None, 0.0

    def _take_over(self, holder: dict, why: str) -> bool:
        """Replace a lease seen stale, under ``lease.json.takeover`` (O_EXCL) so that two
        jobs taking over at once cannot both win, nor replace a fresh lease."""
        lock = self.path + ".takeover"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):  # left by a job killed right there
                if time.time() - os.stat(lock).st_mtime > max(self.timeout_s, 5.0):
                    os.remove(lock)
            time.sleep(_POLL_S / 5)
            return False
        os.close(fd)
        try:
            now, age = self._read()
            if now is None or now.get("token") != holder.get("token"):
                return False  # released or taken meanwhile: start over
            if self._gone(now, age) is None:
                return False  # its holder renewed it meanwhile: it is live

            tmp = f"{self.path}.{self.token}"
            with open(tmp, "w") as f:
                json.dump(self._record(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            os.remove(lock)
        logger.warning(
            "taking over the lease on %s from %s: %s, so that job is gone",
            self.folder, describe(holder), why,
        )  # fmt: skip
        return True

    def _beat(self):
        renewed = time.monotonic()
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder, _ = self._read()
            except OSError as e:  # a network filesystem's hiccup (ESTALE, EIO): try again
                if time.monotonic() - renewed > self.timeout_s:
                    self.lost = {}
                    logger.error("the lease on %s could not be renewed for %gs (%s): this "
                                 "job stops at its next save", self.folder, self.timeout_s, e)  # fmt: skip
                    return
                continue
            if holder == {}:  # being written this instant (a takeover): look next beat
                continue
            if holder is None or holder.get("token") != self.token:
                self.lost = holder or {}
                logger.error(
                    "the lease on %s was lost (%s): another job may write there; this job "
                    "stops at its next save", self.folder,
                    describe(holder) if holder else "the file was removed",
                )  # fmt: skip
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)
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
            holder, _ = self._read()
            if holder is not None and holder.get("token") == self.token:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux), so that a pid is only compared within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_gone(holder: dict) -> bool:
    """Whether the holder ran on this host, in this pid namespace, and its pid is free.

    Anything less certain (another host, another container, no namespace) says False:
    only the heartbeat's age decides then. A recycled pid also says False (the wait).
    """
    same = holder.get("host") == socket.gethostname() and holder.get("pid_ns")
    if not same or holder["pid_ns"] != _pid_namespace():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    return False
