"""One job per checkpoint folder (checkpoint/lease.py).

Fast: the lease itself, in threads of this process; a holder whose store stops answering
(moto's S3 server in a process of its own, paused with SIGSTOP or killed, as an outside
check did; or the holder alone cut off at the boundary the lease calls); the write paths
it guards; the loop's stop. Slow: real ``python train.py`` jobs: two on one bucket around
a paused store (issue #60), a lapse on rank 0 of two ranks; and on one dump folder: two at
once, a holder killed with SIGKILL, a requeue whose predecessor is still saving.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import CONFIG, REPO, error_lines, rank_context

from torchtitan.checkpoint import CheckpointError
from torchtitan.checkpoint.lease import LEASE, Lease, LeaseLost
from torchtitan.tools.launch import free_port, run_env


def foreign_lease(folder, age_s: float, timeout_s: float = 2.0) -> dict:
    """A lease file of another job (pid 999999 on another host), ``age_s`` seconds old."""
    os.makedirs(folder, exist_ok=True)
    record = {"host": "elsewhere", "pid": 999999, "job_id": "4242", "started": time.time() - 99,
              "timeout_s": timeout_s, "token": "theirs"}  # fmt: skip
    path = os.path.join(folder, LEASE)
    with open(path, "w") as f:
        json.dump(record, f)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return record


def test_a_live_holder_is_waited_for_then_named_and_never_disturbed(tmp_path, monkeypatch):
    """The holder's record says who it is; a second job waits ``wait_s`` and stops with
    one line naming it; the holder's lease is untouched and goes when it releases."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    first = Lease(str(tmp_path), timeout_s=5, wait_s=0)
    first.acquire()
    record = json.loads((tmp_path / LEASE).read_text())
    assert (record["pid"], record["job_id"], record["token"]) == (os.getpid(), "777", first.token)
    assert record["host"] and abs(record["started"] - time.time()) < 5
    begin = time.monotonic()
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}") as e:
        Lease(str(tmp_path), timeout_s=5, wait_s=0.4).acquire()
    assert time.monotonic() - begin >= 0.4
    message = str(e.value)
    assert "\n" not in message and f"pid {os.getpid()}" in message and "job 777" in message
    assert "lease_wait_seconds" in message and "--job.dump_folder" in message
    assert json.loads((tmp_path / LEASE).read_text())["token"] == first.token
    first.check()  # not lost
    first.release()
    first.release()  # idempotent
    assert not (tmp_path / LEASE).exists()


def test_a_holder_that_exits_within_the_wait_hands_over(tmp_path):
    """The requeue race: the predecessor releases 0.4 s into the wait; the next proceeds."""
    first = Lease(str(tmp_path), timeout_s=5, wait_s=0)
    first.acquire()
    threading.Timer(0.4, first.release).start()
    second = Lease(str(tmp_path), timeout_s=5, wait_s=10)
    begin = time.monotonic()
    second.acquire()
    assert 0.3 < time.monotonic() - begin < 5
    assert json.loads((tmp_path / LEASE).read_text())["token"] == second.token
    second.release()


def test_a_stale_lease_is_taken_over_with_a_warning_a_fresh_one_is_not(tmp_path, caplog):
    """Past the holder's own timeout (2 s here) the lease is a killed job's: taken over,
    with a warning naming it. Within it, the holder is alive: refused."""
    foreign_lease(tmp_path, age_s=0.0)
    with pytest.raises(CheckpointError, match=r"host elsewhere, pid 999999"):
        Lease(str(tmp_path), timeout_s=60, wait_s=0).acquire()
    foreign_lease(tmp_path, age_s=10.0)
    lease = Lease(str(tmp_path), timeout_s=60, wait_s=0)
    logger = logging.getLogger("torchtitan")  # train.main() stops it propagating
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="torchtitan"):
            lease.acquire()
    finally:
        logger.removeHandler(caplog.handler)
    assert any("taking over the lease" in r.message and "pid 999999" in r.message
               for r in caplog.records)  # fmt: skip
    assert json.loads((tmp_path / LEASE).read_text())["token"] == lease.token
    lease.release()


def test_a_lease_of_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path):
    """A holder on this machine (boot id) and pid namespace whose process is gone (kill
    -9, then a relaunch on the same node), or whose pid a later process took, is taken
    over without waiting for the timeout. Waited for: the same record with a live pid
    (this process), and a dead pid of another pid namespace (another container, which
    may share the host name) or of another machine (another boot id)."""
    from torchtitan.io import claims

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = {**claims.record(), "job_id": "4242", "timeout_s": 600, "token": "theirs"}
    waited = [
        {**here, "pid": os.getpid()},
        {**here, "pid": dead.pid, "pid_ns": "pid:[1]"},
        {**here, "pid": dead.pid, "boot_id": "another-machine"},
    ]
    for record in waited:
        (tmp_path / LEASE).write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match="in use by another job"):
            Lease(str(tmp_path), timeout_s=600, wait_s=0).acquire()
    for record in ({**here, "pid": dead.pid}, {**here, "pid": os.getpid(), "start": 1}):
        (tmp_path / LEASE).write_text(json.dumps(record))
        lease = Lease(str(tmp_path), timeout_s=600, wait_s=0)
        lease.acquire()
        assert json.loads((tmp_path / LEASE).read_text())["token"] == lease.token
        lease.release()


def test_a_torn_lease_is_judged_by_its_age(tmp_path):
    """A lease left empty or half-written (a kill -9 between a create and its write, on a
    file system without links) names no holder: within this job's timeout it is waited
    for, past it taken over. A new lease is never seen torn: it is published whole."""
    for torn in ("", '{"host": "elsewh'):
        (tmp_path / LEASE).write_text(torn)
        with pytest.raises(CheckpointError, match="whose claim is torn"):
            Lease(str(tmp_path), timeout_s=2, wait_s=0.3).acquire()
        old = time.time() - 3
        os.utime(tmp_path / LEASE, (old, old))
        lease = Lease(str(tmp_path), timeout_s=2, wait_s=0)
        lease.acquire()
        assert json.loads((tmp_path / LEASE).read_text())["token"] == lease.token
        lease.release()


def test_the_heartbeat_is_renewed_off_the_training_thread_and_a_loss_is_noticed(tmp_path):
    """A daemon thread renews the file's time every timeout / 6 s; a lease taken over
    meanwhile (a stall past the timeout) makes the next save refuse."""
    lease = Lease(str(tmp_path), timeout_s=0.9, wait_s=0)
    lease.acquire()
    assert lease._thread.daemon and lease._thread is not threading.current_thread()
    path = tmp_path / LEASE
    os.utime(path, (time.time() - 50, time.time() - 50))
    time.sleep(0.45)
    assert time.time() - path.stat().st_mtime < 0.9
    foreign_lease(tmp_path, age_s=0.0)
    time.sleep(0.45)
    with pytest.raises(CheckpointError, match=r"lost the lease .*pid 999999"):
        lease.check()
    lease.release()
    assert json.loads(path.read_text())["token"] == "theirs"  # not ours to remove


def test_a_lease_wait_past_the_collective_timeout_is_a_config_error():
    """The other ranks wait for rank 0's lease in a collective: a wait they would time
    out in is refused before anything starts."""
    from torchtitan.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=r"lease_wait_seconds 400 .*init_timeout_seconds 300"):
        parse_args(["--checkpoint.enable_checkpoint", "--checkpoint.lease_wait_seconds", "400"])
    assert (
        parse_args(["--checkpoint.lease_wait_seconds", "2.5"]).checkpoint.lease_wait_seconds == 2.5
    )


# ---- a store that stops answering --------------------------------------------------------


class StoreProcess:
    """moto's S3 server as a process of its own on 127.0.0.1, so that SIGSTOP pauses the
    store and not this test (harness/s3.py's runs in a thread of this process). It holds
    none of this process's files or pipes (``close_fds``, its output to /dev/null) and
    runs in a session of its own."""

    def __init__(self):
        self.endpoint = f"http://127.0.0.1:{free_port()}"
        host, port = self.endpoint[7:].split(":")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", port],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "no server"
                time.sleep(0.05)
        self.bucket = f"lease-{uuid.uuid4().hex[:12]}"

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def kill(self):
        self.resume()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def store(monkeypatch):
    """A fresh bucket on a ``StoreProcess``, the ``AWS_*`` variables pointed at it. The
    clients' retries are one try (as in test/io/test_store_faults.py), so that a store
    that is down fails a request at once rather than after ~20 s of backoff."""
    from harness import s3

    if s3.missing():
        pytest.skip(s3.missing())
    import fsspec.config
    import s3fs

    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 1}}}
    )
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    server = StoreProcess()
    try:
        for name, value in (("AWS_ENDPOINT_URL", server.endpoint), ("AWS_ACCESS_KEY_ID", "test"),
                            ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(server.bucket)
        yield server
    finally:
        server.kill()
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def said():
    """The torchtitan logger's records while the test runs (train.main stops it
    propagating to pytest's own capture)."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("torchtitan")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def deaths(monkeypatch):
    """The threads that die of an exception while the test runs (their traceback is
    printed as well)."""
    died = []
    hook = threading.excepthook

    def record(args):
        died.append((args.thread.name if args.thread else "?", args.exc_type.__name__))
        hook(args)

    monkeypatch.setattr(threading, "excepthook", record)
    return died


def lines(records, text: str) -> list[str]:
    return [r.getMessage() for r in records if text in r.getMessage()]


def store_read(path: str) -> dict:
    from torchtitan.io import claims

    seen = claims.read(path)
    return seen.record if seen is not None else {}


def refused(url: str):
    """botocore's error for a store nobody answers on (no OSError: it passes s3fs as is)."""
    from botocore.exceptions import EndpointConnectionError

    return EndpointConnectionError(endpoint_url=url)


def test_a_paused_store_the_holder_counts_its_lease_lost_before_a_taker_may_act(
    store, said, deaths, capfd
):
    """The outside check's scenario on one lease: the store is paused (SIGSTOP) longer
    than the timeout (3 s), then a second holder starts. The holder counts the lease lost
    before 3 s have passed since its last renewal was sent (its heartbeat thread waiting
    on the store, alive), before the taker's take-over; a late reply never renews it; it
    never deletes the taker's lease; and the store killed and left down makes a release
    one warning line. No traceback from any thread. Control: the taker did take over."""
    folder = f"s3://{store.bucket}/paused"
    holder = Lease(folder, timeout_s=3, wait_s=0)
    holder.acquire()
    taken_at = holder.renewed_at
    wait_for(lambda: holder.renewed_at > taken_at, 10, "a renewal")
    store.pause()
    wait_for(lambda: not holder.valid(), 10, "the holder to count its lease lost")
    seen_lost = time.monotonic()
    assert seen_lost - holder.renewed_at < holder.timeout_s
    assert holder.lost_at == holder.renewed_at + holder.timeout_s - holder.margin_s
    assert holder._thread.is_alive(), "the heartbeat waits on the paused store"
    with pytest.raises(LeaseLost) as e:
        holder.check()
    assert "\n" not in str(e.value) and f"checkpoint folder {folder}" in str(e.value)
    assert "lease_timeout_seconds" in str(e.value) and "Relaunch" in str(e.value)
    time.sleep(max(0.0, holder.renewed_at + holder.timeout_s + 1.5 - time.monotonic()))
    store.resume()
    taker = Lease(folder, timeout_s=3, wait_s=10)
    taker.acquire()
    assert holder.lost_at < taker.renewed_at
    wait_for(lambda: not holder._thread.is_alive(), 10, "the holder's heartbeat to end")
    assert not holder.valid()
    holder.release()  # lost: touches nothing
    assert store_read(taker.path)["token"] == taker.token
    store.kill()  # the store killed and left down
    taker.release()
    assert len(lines(said, f"releasing the lease on {folder} failed (the object store cannot "
                           "be reached")) == 1  # fmt: skip
    assert deaths == []
    assert "Traceback" not in capfd.readouterr().err


def test_a_store_killed_under_a_held_lease_is_a_missed_beat_not_a_dead_thread(
    store, said, deaths, capfd
):
    """The store killed and left down: botocore's EndpointConnectionError (no OSError)
    reaches the heartbeat, which says so in one warning line and keeps trying until the
    lease lapses, before the timeout; a release meets the dead store in one line. No
    thread dies, no traceback."""
    folder, other_folder = f"s3://{store.bucket}/killed", f"s3://{store.bucket}/other"
    holder, other = Lease(folder, 3, 0), Lease(other_folder, 3, 0)
    holder.acquire()
    other.acquire()
    store.kill()
    other.release()  # still valid: it asks the store, which is gone
    assert len(lines(said, f"releasing the lease on {other_folder} failed")) == 1
    failed = f"renewing the lease on {folder} failed (the object store cannot be reached"
    wait_for(lambda: lines(said, failed), 10, "a failed renewal")
    assert holder._thread.is_alive() and holder.valid()
    wait_for(lambda: not holder.valid(), 10, "the lease to lapse")
    assert time.monotonic() - holder.renewed_at < holder.timeout_s
    wait_for(lambda: not holder._thread.is_alive(), 10, "the heartbeat to end")
    assert len(lines(said, failed)) == 1, "said once per run of failures"
    assert len(lines(said, f"this job lost the lease on checkpoint folder {folder}")) == 1
    holder.release()
    assert deaths == []
    assert "Traceback" not in capfd.readouterr().err


class Cut:
    """The holder's heartbeat cut off from its store at the boundary the lease calls
    (``storage.get_object`` / ``put_object`` raise botocore's EndpointConnectionError in
    the holder's heartbeat thread) while every other thread reaches it: a partition of
    the holder's node. ``fail(n)``: the next ``n`` requests; ``cut_after_aligned()``: every
    request after a renewal written in the second half of a second of the store's clock,
    so that the store's whole-second age of it reaches a taker's limit as early as it can
    (see the ordering test). Meanwhile each beat starts 0.56 s into a second (its pause
    lengthened by under a second), so that the first renewal the store answers within
    0.34 s is the one: waiting for one to land there by chance took over 30 s under load,
    58 s once."""

    def __init__(self, monkeypatch, lease: Lease):
        from torchtitan.io import storage

        self.lease, self.failing, self.cut, self.align = lease, 0, False, False
        get, put = storage.get_object, storage.put_object

        def get_object(url):
            self._maybe_fail(url)
            return get(url)

        def put_object(url, body, absent=False, etag=None):
            self._maybe_fail(url)
            begin = time.time()
            written = put(url, body, absent=absent, etag=etag)
            end = time.time()
            if (self.align and self._mine() and written is not None and int(begin) == int(end)
                    and 0.55 <= begin % 1 and end % 1 <= 0.9):  # fmt: skip
                self.align, self.cut = False, True
            return written

        monkeypatch.setattr(storage, "get_object", get_object)
        monkeypatch.setattr(storage, "put_object", put_object)
        cut = self

        class Beats(threading.Event):
            """The heartbeat's pause, which ends 0.56 s into a second while aligning."""

            def wait(self, timeout=None):
                if super().wait(timeout) or not cut.align:
                    return self.is_set()
                return super().wait((0.56 - time.time() % 1) % 1)

        lease._stop = Beats()

    def _mine(self) -> bool:
        return threading.current_thread() is self.lease._thread

    def _maybe_fail(self, url):
        if self._mine() and (self.cut or self.failing > 0):
            self.failing = max(0, self.failing - 1)
            raise refused(os.environ["AWS_ENDPOINT_URL"])

    def fail(self, n: int):
        self.failing = n

    def cut_after_aligned(self):
        self.align = True


def test_a_holder_cut_off_from_its_store_gives_up_before_a_taker_may_act(
    store, monkeypatch, said, deaths, capfd
):
    """A renewal failing with botocore's EndpointConnectionError is a missed beat: the
    thread lives, renews at the next beat, and the lease stays valid. Then the holder is
    cut off for good while a taker polls the store (which answers it): the taker takes
    over at the earliest moment the store's whole-second age allows, and the holder has
    counted the lease lost before that. The timeout is 2.9 s and the last renewal is
    written 0.55-0.9 s into a second: its age reads 3 s (past 2.9) when only 2.1-2.45 s
    have passed, so the taker acts before the holder's last renewal + timeout (the
    control, asserted): a holder that counted the whole timeout would still write then."""
    folder = f"s3://{store.bucket}/cut"
    holder = Lease(folder, timeout_s=2.9, wait_s=0)
    cut = Cut(monkeypatch, holder)
    holder.acquire()
    cut.fail(1)
    wait_for(lambda: cut.failing == 0, 10, "the failed beat")
    missed = time.monotonic()
    wait_for(lambda: holder.renewed_at > missed, 10, "the next beat's renewal")
    assert holder.valid() and holder._thread.is_alive() and deaths == []
    assert len(lines(said, f"renewing the lease on {folder} failed (the object store cannot "
                           "be reached")) == 1  # fmt: skip
    assert len(lines(said, f"the lease on {folder} is renewed again")) == 1

    cut.cut_after_aligned()
    wait_for(lambda: cut.cut, 30, "a renewal written late in a second")
    last = holder.renewed_at
    taker = Lease(folder, timeout_s=2.9, wait_s=10)
    taker.acquire()
    assert taker.renewed_at < last + holder.timeout_s, "control: the earliest take-over"
    assert not holder.valid() and holder.lost_at < taker.renewed_at
    with pytest.raises(LeaseLost, match=f"lost the lease on checkpoint folder {folder}"):
        holder.check()
    wait_for(lambda: not holder._thread.is_alive(), 10, "the heartbeat to end")
    holder.release()
    assert store_read(taker.path)["token"] == taker.token
    taker.release()
    assert deaths == []
    assert "Traceback" not in capfd.readouterr().err


def lapse(monkeypatch, lease_thread: str = "ckpt-lease"):
    """Every lease heartbeat in this process fails from now on (botocore's error)."""
    from torchtitan.io import claims

    read = claims.read

    def failing(path):
        if threading.current_thread().name == lease_thread:
            raise refused("http://127.0.0.1:9")
        return read(path)

    monkeypatch.setattr(claims, "read", failing)


def tiny_state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "extra": {"step": step}}


def full(step: int) -> dict:
    """A manifest of a full checkpoint (one the purge counts)."""
    return {"step": step, "contents": ["model", "train_state"]}


def test_a_save_in_flight_when_the_lease_lapses_is_never_published(tmp_path, monkeypatch):
    """An async save is being written when the heartbeat stops renewing: its finalizer
    reaches the commit point after the lease lapsed, and publishes nothing (no manifest,
    no rename), tidies nothing, purges nothing; the wait raises the lease's one line.
    Control: the save before it, with the lease valid, was published and kept."""
    from torchtitan.checkpoint import integrity
    from torchtitan.checkpoint.lifecycle import Saver
    from torchtitan.parallel import init_distributed

    folder = str(tmp_path / "ckpt")
    lease = Lease(folder, timeout_s=1.2, wait_s=0)
    lease.acquire()
    saver = Saver(folder, init_distributed(), "async", keep_latest_k=1, lease=lease)
    try:
        saver.save(1, tiny_state(1), full(1))
        saver.wait()
        assert sorted(os.listdir(folder)) == [LEASE, "step-1"]
        digest = integrity.digest

        def digest_after_the_lapse(*args):  # the write still in flight when the store stops
            lapse(monkeypatch)
            wait_for(lambda: not lease.valid(), 10, "the lease to lapse")
            return digest(*args)

        monkeypatch.setattr(integrity, "digest", digest_after_the_lapse)
        saver.save(2, tiny_state(2), full(2))
        with pytest.raises(LeaseLost, match=f"lost the lease on checkpoint folder {folder}"):
            saver.wait()
    finally:
        monkeypatch.undo()
        saver.close()
    assert sorted(os.listdir(folder)) == [LEASE, "step-1", "step-2.partial"]
    assert not os.path.exists(os.path.join(folder, "step-2.partial", "manifest.json"))
    lease.release()
    assert os.path.exists(os.path.join(folder, LEASE)), "lapsed: left to age out"


def test_a_lease_lapsing_after_a_publish_purges_nothing(tmp_path, monkeypatch):
    """The purge (keep_latest_k 1) runs after step-2 is published; the lease lapses in
    between: step-1 stays. Control: with the lease valid, step-2's purge removed it."""
    from torchtitan.checkpoint import lifecycle
    from torchtitan.checkpoint.lifecycle import Saver
    from torchtitan.parallel import init_distributed

    kept = {}
    for lapses in (False, True):
        folder = str(tmp_path / f"ckpt-{lapses}")
        lease = Lease(folder, timeout_s=1.2, wait_s=0)
        lease.acquire()
        saver = Saver(folder, init_distributed(), "disabled", keep_latest_k=1, lease=lease)
        try:
            saver.save(1, tiny_state(1), full(1))
            if lapses:
                fsync_dir = lifecycle.fsync_dir

                def fsync_then_lapse(path, fsync_dir=fsync_dir, lease=lease):  # after the rename
                    fsync_dir(path)
                    lapse(monkeypatch)
                    wait_for(lambda: not lease.valid(), 10, "the lease to lapse")

                monkeypatch.setattr(lifecycle, "fsync_dir", fsync_then_lapse)
            saver.save(2, tiny_state(2), full(2))
            saver.wait()
        finally:
            monkeypatch.undo()
            saver.close()
            lease.release()
        kept[lapses] = sorted(n for n in os.listdir(folder) if n.startswith("step-"))
    assert kept == {False: ["step-2"], True: ["step-1", "step-2"]}


def _lapse_during_a_finalization(rank: int, store: str, folder: str, out) -> None:
    """One of two forked ranks: its checkpoint group busy with a finalization's gather
    (rank 0's sent first, rank 1's only after the check) while the training thread asks
    the lease after a step; rank 0's lease lapsed (its file removed: the next beat counts
    it lost)."""
    from datetime import timedelta

    import torch.distributed as dist

    from torchtitan import parallel
    from torchtitan.checkpoint import CheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    said = {}
    try:
        groups = [dist.new_group(backend="gloo", timeout=timedelta(seconds=8)) for _ in "cc"]
        dims = parallel.ParallelDims(rank, 2, 0, torch.device("cpu"), "gloo",
                                     cpu_group=groups[0], control_group=groups[1])  # fmt: skip
        manager = CheckpointManager.__new__(CheckpointManager)  # what check_lease reads
        manager.enabled, manager.dims = True, dims
        manager.lease = Lease(folder, timeout_s=0.6, wait_s=0)
        if rank == 0:
            manager.lease.acquire()
            os.remove(os.path.join(folder, LEASE))
            while manager.lease.valid():
                time.sleep(0.02)
        gathered = []

        def finalization():  # as Saver.finalize gathers the digests, on the checkpoint group
            gathered.extend(parallel.gather_objects(dims, {"rank": rank}))

        thread = threading.Thread(target=finalization)
        if rank == 0:
            thread.start()
            time.sleep(0.3)  # its gather is in flight when the training thread asks
        try:
            manager.check_lease()
        except LeaseLost as e:
            said["line"] = str(e)
        except Exception as e:  # noqa: BLE001 - the crossed collective, as this rank met it
            said["line"] = f"{type(e).__name__}: {e}"[:300]
        if rank == 1:
            thread.start()
        thread.join(timeout=20)
        said["gathered"] = gathered if not thread.is_alive() else "still in its gather"
        manager.lease.release()
    finally:
        out.put((rank, said))


def test_a_lapse_seen_while_a_finalization_holds_the_checkpoint_group_crosses_nothing(tmp_path):
    """check_lease (after every step, the training thread) says rank 0's line on the
    control group: an async save's finalization may be in a collective on the checkpoint
    group at that moment, from its own thread. Two forked gloo ranks: both raise
    LeaseLost with rank 0's line and the finalization's gather completes with both
    digests. The mutant that sent the line on the checkpoint group (the campaign's hang:
    trial 659819, a store restarted while saves were in flight) crosses the two
    collectives: a rank aborts on gloo's size mismatch, or both wait out the timeout."""
    ctx = rank_context()
    out = ctx.Queue()
    folder = str(tmp_path / "checkpoint")
    os.makedirs(folder)
    procs = [ctx.Process(target=_lapse_during_a_finalization,
                         args=(r, str(tmp_path / "store"), folder, out)) for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    said = {}
    try:
        for _ in procs:
            rank, got = out.get(timeout=60)
            said[rank] = got
    except Exception:  # noqa: BLE001 - a rank that died (SIGABRT) sends nothing
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert sorted(said) == [0, 1], (said, [p.exitcode for p in procs])
    for rank in (0, 1):
        assert said[rank]["line"].startswith(f"this job lost the lease on checkpoint folder "
                                             f"{folder}: its file was removed"), said  # fmt: skip
    assert said[0]["gathered"] == [{"rank": 0}, {"rank": 1}] and said[1]["gathered"] == [], said


def test_the_loop_stops_on_every_rank_within_a_step_of_a_lapse_and_saves_nothing(
    tmp_path, monkeypatch
):
    """train.main whose heartbeat fails from step 5 on (botocore's error, every beat): the
    lease lapses 2/3 s after its last renewal (timeout 1 s), and the loop stops at the
    first step boundary after that, in one line naming the folder, with no traceback and
    no checkpoint. Control: the loop ran steps after the failures began, before the lapse."""
    from helpers import train_here

    import train as train_script
    from torchtitan.checkpoint import CheckpointManager

    made, steps = [], []

    class Recorded(CheckpointManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    save_if_due = train_script.save_if_due

    def recorded_save_if_due(run, step, last_step):
        steps.append((time.monotonic(), step))
        if step == 5:
            lapse(monkeypatch)
        return save_if_due(run, step, last_step)

    monkeypatch.setattr(train_script, "CheckpointManager", Recorded)
    monkeypatch.setattr(train_script, "save_if_due", recorded_save_if_due)
    dump = tmp_path / "run"
    status, log = train_here(dump, "--training.steps", 400, "--checkpoint.enable_checkpoint",
                             "--checkpoint.interval", 1000, "--checkpoint.lease_timeout_seconds",
                             1, expect_ok=False)  # fmt: skip
    folder = str(dump / "checkpoint")
    (line,) = error_lines(log)
    assert status == 1 and f"lost the lease on checkpoint folder {folder}" in line, log[-3000:]
    assert "Traceback" not in log
    lost_at = made[0].lease.lost_at
    after = [step for at, step in steps if at >= lost_at]
    assert len(after) <= 1 and 5 < steps[-1][1] < 400, (after, steps[-1])
    assert [n for n in os.listdir(folder) if n.startswith("step-")] == []


# ---- real jobs around a paused store ------------------------------------------------------

# Each job's requests that write the store: when each was sent, and (once answered) when
# it was answered and whether it succeeded; a request never answered (the job exited with
# it in flight) is noted as sent.
WRITES_SHIM = """
import itertools, json, os, threading, time

_log, _lock, _ids = os.environ["STORE_WRITES"], threading.Lock(), itertools.count()
_WRITES = {"PutObject", "DeleteObject", "DeleteObjects", "CopyObject", "UploadPart",
           "UploadPartCopy", "CreateMultipartUpload", "CompleteMultipartUpload"}


def _note(*event):
    with _lock, open(_log, "a") as f:
        f.write(json.dumps(event) + "\\n")


def _noting(call):
    def noted(self, operation, params):
        if operation not in _WRITES:
            return call(self, operation, params)
        n = next(_ids)
        _note("sent", n, time.time(), operation, params.get("Key", ""))
        ok = False
        try:
            reply = call(self, operation, params)
            ok = True
            return reply
        finally:
            _note("answered", n, time.time(), ok)

    return noted


def _anoting(call):
    async def noted(self, operation, params):
        if operation not in _WRITES:
            return await call(self, operation, params)
        n = next(_ids)
        _note("sent", n, time.time(), operation, params.get("Key", ""))
        ok = False
        try:
            reply = await call(self, operation, params)
            ok = True
            return reply
        finally:
            _note("answered", n, time.time(), ok)

    return noted


import aiobotocore.client
import botocore.client

botocore.client.BaseClient._make_api_call = _noting(botocore.client.BaseClient._make_api_call)
aiobotocore.client.AioBaseClient._make_api_call = _anoting(
    aiobotocore.client.AioBaseClient._make_api_call)
"""


@dataclass
class Write:
    """One write request of a job: sent and answered (``inf``: never) as ``time.time()``."""

    sent: float
    operation: str
    key: str
    answered: float = math.inf
    ok: bool = False


def noted(writes: Path) -> list[Write]:
    found = {}
    for line in writes.read_text().splitlines() if writes.exists() else []:
        event, n, at, *rest = json.loads(line)
        if event == "sent":
            found[n] = Write(at, *rest)
        else:
            found[n].answered, found[n].ok = at, rest[0]
    return list(found.values())


def published(notes: list[Write]) -> list[Write]:
    """The manifests written (a checkpoint published) among ``notes``."""
    return [w for w in notes if w.operation == "PutObject" and w.key.endswith("/manifest.json")
            and w.ok]  # fmt: skip


def store_job(tmp_path, store, name: str, *extra) -> tuple[subprocess.Popen, Path, Path]:
    """``python train.py`` on the bucket's ``ckpt`` folder in the background: the process,
    its stderr's file and its store-writes log."""
    from helpers import shim_env

    log, writes = tmp_path / f"{name}.log", tmp_path / f"{name}.writes"
    env = shim_env(tmp_path / "shim", WRITES_SHIM, STORE_WRITES=str(writes),
                   AWS_ENDPOINT_URL=store.endpoint, AWS_ACCESS_KEY_ID="test",
                   AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    argv = [sys.executable, "train.py", *map(str, JOB), "--job.dump_folder", str(tmp_path / name),
            "--checkpoint.folder", f"s3://{store.bucket}/ckpt", *map(str, extra)]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return proc, log, writes


@pytest.mark.slow
def test_a_requeue_after_a_paused_store_one_job_writes_the_folder_the_other_stops(tmp_path, store):
    """Issue #60 end to end: job 1 saves to the bucket every 5 steps; the store is paused
    (SIGSTOP) for 1.5 s past the lease timeout (3 s), then a copy of the job is started.
    Job 1 stops in one line naming the folder, no traceback; it sent no write after its
    own deadline (its last renewal sent + 3 s - the 1 s margin), and none of its writes
    was answered after job 2 sent its take-over; job 2 resumes and writes its own
    checkpoints there, and exits cleanly on SIGTERM. Controls: job 1 wrote the bucket
    (checkpoints and renewals) before the pause; job 2 writes after its take-over."""
    first, first_log, first_writes = store_job(tmp_path, store, "first")
    second = None
    try:
        wait_for(lambda: len(published(noted(first_writes))) >= 2, 120, "job 1's saves")
        store.pause()
        time.sleep(3 + 1.5)
        store.resume()
        assert first.wait(timeout=60) == 1, first_log.read_text()[-3000:]
        second, second_log, second_writes = store_job(tmp_path, store, "second",
                                                      "--checkpoint.lease_wait_seconds", 10)  # fmt: skip
        wait_for(lambda: "loaded checkpoint" in second_log.read_text(), 120, "job 2's resume")
        loaded = int(re.search(r"loaded checkpoint \S+/step-(\d+)", second_log.read_text())[1])
        wait_for(lambda: any(w.key.endswith(f"/step-{loaded + 5}/manifest.json")
                             for w in published(noted(second_writes))), 120, "job 2's save")  # fmt: skip
    finally:
        if first.poll() is None:
            first.kill()
        if second is not None:
            assert finish(second) == 0, second_log.read_text()[-3000:]
    log = first_log.read_text()
    (line,) = error_lines(log)
    assert f"lost the lease on checkpoint folder s3://{store.bucket}/ckpt" in line, log[-3000:]
    assert "Traceback" not in log
    mine, theirs = noted(first_writes), noted(second_writes)
    renewals = [w for w in mine if w.key.endswith("/lease.json") and w.ok]
    assert len(renewals) >= 2 and len(published(mine)) >= 2
    deadline = renewals[-1].sent + 3 - 1  # Lease(timeout 3).margin_s: two 0.5 s heartbeats
    late = [(round(w.sent - deadline, 2), w.operation, w.key) for w in mine if w.sent >= deadline]
    assert not late, (late, first_log.read_text()[-3000:])
    takeover = next(w.sent for w in theirs if w.key.endswith("/lease.json") and w.ok)
    assert "taking over the lease" in second_log.read_text()
    assert max(w.answered for w in mine) < takeover
    assert any(w.sent > takeover for w in published(theirs))


# Rank 0's lease heartbeat fails (botocore's error) from its LAPSE_AFTER-th beat on.
LAPSE_SHIM = """
import os, threading

if os.environ.get("RANK") == "0":
    from torchtitan.io import claims

    _read, _beats = claims.read, [0]

    def _failing(path):
        if threading.current_thread().name == "ckpt-lease":
            _beats[0] += 1
            if _beats[0] > int(os.environ["LAPSE_AFTER"]):
                from botocore.exceptions import EndpointConnectionError

                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return _read(path)

    claims.read = _failing
"""


@pytest.mark.slow
def test_a_lapse_on_rank_0_stops_every_rank_in_the_same_line(tmp_path):
    """2 ranks under torchrun; rank 0's heartbeat fails from its 20th beat (timeout 1 s:
    a beat every 1/6 s). Every rank stops at the same step boundary with rank 0's one
    line naming the folder, no rank's traceback, and nothing saved. Control: the job
    trained before the lapse (steps logged)."""
    from helpers import shim_env

    from torchtitan.tools.launch import torchrun_command

    dump = tmp_path / "run"
    args = [*CONFIG, "--job.dump_folder", dump, "--training.steps", 100_000,
            "--checkpoint.enable_checkpoint", "--checkpoint.interval", 100_000,
            "--checkpoint.lease_timeout_seconds", 1]  # fmt: skip
    env = shim_env(tmp_path / "shim", LAPSE_SHIM, LAPSE_AFTER="20")
    proc = subprocess.run(torchrun_command(2, [str(a) for a in args]), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    log = proc.stdout + proc.stderr
    errors = error_lines(proc.stderr)
    folder = dump / "checkpoint"
    assert proc.returncode != 0 and len(errors) == 2, log[-3000:]
    assert {e.split("]")[0] for e in errors} == {"[rank0", "[rank1"}
    assert len({e.split("] ", 1)[1] for e in errors}) == 1, errors
    assert f"lost the lease on checkpoint folder {folder}" in errors[0]
    assert "]: Traceback" not in log and "INFO step " in log
    assert [n for n in os.listdir(folder) if n.startswith("step-")] == []


# ---- real jobs --------------------------------------------------------------------------

JOB = [*CONFIG, "--training.steps", 100_000, "--checkpoint.enable_checkpoint",
       "--checkpoint.interval", 5, "--checkpoint.keep_latest_k", 2,
       "--checkpoint.lease_timeout_seconds", 3]  # fmt: skip


def launch(dump, log, *extra) -> subprocess.Popen:
    """``python train.py`` on ``dump`` in the background, its stderr to ``log``."""
    argv = [sys.executable, "train.py", *map(str, JOB), "--job.dump_folder", str(dump),
            *map(str, extra)]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))  # fmt: skip


def wait_for(check, timeout=120, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def saved(dump, step: int) -> bool:
    return (dump / "checkpoint" / f"step-{step}" / "manifest.json").exists()


def finish(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=120)


def abandoned(dump) -> list[str]:
    return [n for n in os.listdir(dump / "checkpoint") if "abandoned" in n]


@pytest.mark.slow
def test_two_launches_on_one_folder_the_second_is_refused(tmp_path):
    """The reported accident: a second job on a folder in use. It waits its 1 s, stops
    with one line naming the first (pid), loads nothing, sets nothing aside; the first
    trains on, and releases the lease on its SIGTERM save."""
    dump = tmp_path / "run"
    first = launch(dump, tmp_path / "first.log")
    try:
        wait_for(lambda: saved(dump, 5), what="the first job's step-5")
        second = launch(dump, tmp_path / "second.log", "--checkpoint.lease_wait_seconds", 1)
        assert second.wait(timeout=120) == 1
        log = (tmp_path / "second.log").read_text()
        (line,) = error_lines(log)
        assert f"pid {first.pid}" in line and "in use by another job" in line, line
        assert "loaded checkpoint" not in log
        reached = max(int(n[5:]) for n in os.listdir(dump / "checkpoint") if n[5:].isdigit())
        wait_for(lambda: saved(dump, reached + 5), what="the first job saving on")
        assert first.poll() is None and abandoned(dump) == []
    finally:
        assert finish(first) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert "preempted at step" in (tmp_path / "first.log").read_text()
    assert not (dump / "checkpoint" / LEASE).exists()


@pytest.mark.slow
def test_after_a_sigkill_the_next_launch_takes_over(tmp_path):
    """SIGKILL leaves the lease behind; the next job takes it over with a warning naming
    the killed job (at once: same host, its process gone; elsewhere after the 3 s
    heartbeat timeout) and resumes from the killed job's checkpoint."""
    dump = tmp_path / "run"
    first = launch(dump, tmp_path / "first.log")
    try:
        wait_for(lambda: saved(dump, 5), what="the first job's step-5")
    finally:
        first.kill()
        first.wait()
    assert (dump / "checkpoint" / LEASE).exists()
    second = launch(dump, tmp_path / "second.log", "--checkpoint.lease_wait_seconds", 60)
    log_path = tmp_path / "second.log"
    try:
        wait_for(lambda: "loaded checkpoint" in log_path.read_text(), what="the resume")
    finally:
        assert finish(second) == 0, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert re.search(rf"taking over the lease .*pid {first.pid}", log), log[-3000:]
    assert not (dump / "checkpoint" / LEASE).exists()


@pytest.mark.slow
def test_a_requeue_waits_for_its_predecessor_to_save_and_exit(tmp_path):
    """The requeue race: the successor starts while the predecessor still runs; it waits,
    the predecessor saves on SIGTERM and exits, and the successor resumes from exactly
    that step, with nothing set aside."""
    dump = tmp_path / "run"
    first = launch(dump, tmp_path / "first.log")
    second_log = tmp_path / "second.log"
    second = None
    try:
        wait_for(lambda: saved(dump, 5), what="the first job's step-5")
        second = launch(dump, second_log, "--checkpoint.lease_wait_seconds", 120)
        wait_for(lambda: "waiting up to" in second_log.read_text(), what="the second to wait")
        assert finish(first) == 0
        stopped = re.search(r"preempted at step (\d+)", (tmp_path / "first.log").read_text())
        wait_for(lambda: "loaded checkpoint" in second_log.read_text(), what="the resume")
        assert f"step-{stopped.group(1)} " in second_log.read_text()
    finally:
        first.kill()
        if second is not None:
            assert finish(second) == 0, second_log.read_text()[-3000:]
    assert abandoned(dump) == []
