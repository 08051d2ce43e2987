"""Claims: small files that say one process holds something (a checkpoint folder's lease,
a unit whose token counts it measures), and the one rule for when their holder is gone.

Owns: writing a holder's record, reading it back, the liveness rule, the heartbeat and
taking over a claim whose holder is gone. The lease (checkpoint/lease.py) and the count
claims (data/index.py) both go through it, so they judge a holder the same way.

- **Never half a record.** The record is written to a file of its own, then linked onto
  the claim's name: ``os.link`` fails when the name exists, so it is an exclusive create
  that publishes a whole record at once. A kill -9 between any two lines leaves either no
  claim (and a stray ``.<name>.<token>.tmp``) or a whole one. A file system without hard
  links falls back to ``O_EXCL`` and a write; a claim left empty or half-written there (or
  by an older version) is *torn*.
- **Liveness.** A holder is gone when its heartbeat (the file's mtime) is older than the
  stale limit, whatever the file holds, a torn claim included; or, at once, when it ran on
  this kernel (its boot id), in this pid namespace, and its pid is free or now belongs to a
  process started at another time (a recycled pid). The host name is never evidence: the
  containers of one job often share one, and so may two machines. A holder in another
  container or on another machine is judged by its heartbeat alone.
- **Taking over.** Only a claim seen gone is replaced, under ``<claim>.takeover`` (created
  exclusively), after reading it again: it must still be the record seen (its token, or
  for a torn one its inode, size and mtime) and still gone. The new record is renamed
  over it, so two takers cannot both win and a renewed claim is never replaced.

**On an object store** (a claim path that is an ``s3://`` URL; storage.py's requests)
there is no link, rename or mtime to set, and no need for them: a PUT is atomic, so a
torn claim cannot exist there, and the store's conditional writes do what the link and
the lock do here.

- Create: a PUT with ``If-None-Match: *``; of any number of creators exactly one gets
  200, the others 412.
- Read: one GET, giving the record, the object's ETag and its age: LastModified against
  the ``Date`` of the same reply, both the store's clock, so a skew between machines does
  not age a claim (this machine's clock only where a store sends no ``Date``); to a
  second, which a stale limit of tens of seconds does not feel.
- Heartbeat: the holder rewrites its record (its ``beat`` counted up, so the bytes and
  the ETag change) with ``If-Match`` on the ETag of the read that showed its own token.
  A 412 means another process replaced it: the holder sees the other's record at its
  next read, as it would locally.
- Take-over: a PUT with ``If-Match`` on the ETag seen gone. Any write since (a heartbeat,
  a release and a new claim, another taker) changed the ETag, so two takers cannot both
  win and a renewed claim is never replaced; no ``.takeover`` lock is needed.
- Release: a read that must show this holder's token, then a DELETE with ``If-Match`` on
  that ETag; a store that ignores the condition leaves a read-to-delete race, which needs
  the releasing holder, alive, to have missed its heartbeats for the whole stale limit
  and a taker to act inside those few milliseconds; the taker's claim is then deleted and
  the taker finds it gone at its next heartbeat (the lease stops its job at the next
  save; a unit's counts are measured twice at worst).

The liveness rule is the same: a holder on another machine or in another container is
judged by its heartbeat's age alone.

**Errors.** On a disk a failure is an ``OSError``. A store's client raises more than that:
s3fs turns a store's refusal (4xx, 5xx) into an ``OSError`` but passes botocore's own
errors through unchanged (``EndpointConnectionError``: nobody listens;
``ConnectionClosedError``; ``NoCredentialsError``), and a read timeout is botocore's
``ReadTimeoutError``. So ``create``, ``read``, ``take_over`` and ``release`` may raise any
of them on a store, and a caller that must outlive a store's fault (the lease's heartbeat)
catches ``Exception``; ``touch`` keeps its promise of a bool on a store whatever failed.

Cost: creating: one small file written, one link, one unlink; a heartbeat: one ``utime``;
judging a holder: one stat and one read of ~300 bytes (and of ``/proc/<pid>/stat``). On a
store: creating, one PUT (and one GET when another won); a heartbeat, one GET and one
PUT; judging, one GET; taking over, one PUT; releasing, one GET and one DELETE.

Never: decide what a claim stands for, wait, or signal the holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import cache

from torchtitan.io import storage

TAKEOVER = ".takeover"


@cache
def boot_id() -> str | None:
    """This kernel's boot id (Linux): equal for every container of one machine's boot,
    different on another machine or after a reboot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (Linux), so that a pid is only compared within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: no such process, a
    dead one not yet reaped, or no ``/proc`` to ask)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields count from the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def record(**extra) -> dict:
    """This process's holder record: who it is (host and pid for people; boot id, pid
    namespace and start time for the liveness rule), since when, and a token of its own."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_ns": pid_namespace(),
            "boot_id": boot_id(), "start": process_start(pid), "since": time.time(),
            "token": uuid.uuid4().hex, **extra}  # fmt: skip


@dataclass
class Seen:
    """A claim as read: its record (``{}`` when torn), its heartbeat's age in seconds, and
    what identifies this very file (inode, size, mtime), for a torn one; in a store, the
    object's ETag (``etag``), which every write changes."""

    record: dict
    age: float
    stamp: tuple[int, int, int]
    etag: str = ""

    @property
    def torn(self) -> bool:
        return not self.record

    def same_file(self, other: Seen) -> bool:
        if self.record.get("token") or other.record.get("token"):
            return self.record.get("token") == other.record.get("token")
        return self.stamp == other.stamp


def _write_new(path: str, rec: dict, durable: bool):
    """Write ``rec`` to a new file of its own beside ``path``; return its name."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return tmp


def create(path: str, rec: dict, durable: bool = False) -> bool:
    """Create the claim ``path`` holding ``rec`` if there is none (True), whole or not at
    all. ``durable``: fsync the record (a lease outlives a machine's crash; a store's PUT
    is durable when answered). Raises OSError where the folder cannot be written."""
    if storage.is_remote(path):
        return storage.put_object(path, _body(rec), absent=True) is not None
    tmp = _write_new(path, rec, durable)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here: an exclusive create, then the write
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read(path: str) -> Seen | None:
    """The claim at ``path`` (None: there is none). Raises OSError on a file system error
    other than the claim's absence (the caller decides whether to retry)."""
    if storage.is_remote(path):
        found = storage.get_object(path)
        if found is None:
            return None
        return Seen(_parse(found.body), found.age, (0, len(found.body), 0), found.etag)
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except FileNotFoundError:
        return None
    return Seen(_parse(text), time.time() - st.st_mtime, (st.st_ino, st.st_size, st.st_mtime_ns))


def _parse(text: str | bytes) -> dict:
    """The record in a claim's text; ``{}`` for a torn one (or anything but a record)."""
    try:
        rec = json.loads(text)
    except ValueError:
        rec = None
    return rec if isinstance(rec, dict) else {}


def _body(rec: dict) -> bytes:
    return json.dumps(rec).encode()


def holder_gone(rec: dict) -> bool:
    """Whether the holder ran on this machine's kernel, in this pid namespace, and its
    process is gone (its pid free, or taken by a process started at another time).

    Anything less certain (another machine, another container, a record without boot id
    or namespace) says False: only the heartbeat's age decides then."""
    if not rec.get("boot_id") or rec.get("boot_id") != boot_id():
        return False
    if not rec.get("pid_ns") or rec.get("pid_ns") != pid_namespace():
        return False
    try:
        pid = int(rec["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    started = process_start(pid)
    if started is None:
        if os.path.isdir("/proc/self"):
            return True  # no such process, or a dead one
        try:  # no /proc: ask the kernel
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return rec.get("start") is not None and started != rec["start"]


def gone(seen: Seen, stale_s: float) -> str | None:
    """Why the claim's holder is gone (so it may be taken over), or None while it may live."""
    if seen.age > stale_s:
        what = "torn (empty or half-written), and " if seen.torn else ""
        return f"it is {what}not refreshed for {seen.age:.0f}s (stale after {stale_s:g}s)"
    if not seen.torn and holder_gone(seen.record):
        return "its process is gone"
    return None


def take_over(path: str, seen: Seen, rec: dict, stale_s: float, durable: bool = False) -> bool:
    """Replace the claim ``path``, seen gone as ``seen``, with ``rec`` (True); False when
    another process is taking it over, or it changed meanwhile (released, taken, renewed).
    In a store: a PUT only if the object is still the one seen (``If-Match``)."""
    if storage.is_remote(path):
        return bool(seen.etag) and storage.put_object(path, _body(rec), etag=seen.etag) is not None
    lock = path + TAKEOVER
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        with contextlib.suppress(FileNotFoundError):  # left by a taker killed right there
            if time.time() - os.stat(lock).st_mtime > max(stale_s, 5.0):
                os.remove(lock)
        return False
    os.close(fd)
    try:
        now = read(path)
        if now is None or not now.same_file(seen) or gone(now, stale_s) is None:
            return False
        tmp = _write_new(path, rec, durable)
        os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(lock)


def touch(path: str, token: str | None = None, seen: Seen | None = None) -> bool:
    """Renew the heartbeat (False: the claim is gone, or the folder failed us). In a store
    (where ``token`` is the holder's): the record rewritten, its ``beat`` counted up, only
    if it is still the one read (``seen``, else read now) and holds ``token``; False when
    another process replaced it, or the store failed (any error of its client)."""
    if storage.is_remote(path):
        try:
            seen = seen or read(path)
            if seen is None or not token or seen.record.get("token") != token:
                return False
            beat = {**seen.record, "beat": int(seen.record.get("beat", 0)) + 1}
            return storage.put_object(path, _body(beat), etag=seen.etag) is not None
        except Exception:  # noqa: BLE001 - botocore's errors are no OSError: a missed beat
            return False
    try:
        os.utime(path)
        return True
    except OSError:
        return False


def release(path: str, token: str) -> bool:
    """Remove the claim if it is still the one holding ``token`` (True); a claim another
    process took over is left to it."""
    try:
        now = read(path)
    except OSError:
        return False
    if now is None or now.record.get("token") != token:
        return False
    if storage.is_remote(path):
        try:
            return storage.delete_object(path, now.etag)
        except OSError:
            return False
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    return True


def describe(rec: dict) -> str:
    """The holder for people: host, pid and what the record adds (rank, job)."""
    if not rec:
        return "a process whose claim is torn (empty or half-written)"
    who = [f"job {rec['job_id']}"] if rec.get("job_id") else []
    who += [f"rank {rec['rank']}"] if rec.get("rank") is not None else []
    who += [f"host {rec.get('host')}", f"pid {rec.get('pid')}"]
    since = rec.get("since", rec.get("started"))
    if since:
        who.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)))
    return ", ".join(who)
