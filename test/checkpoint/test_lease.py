"""One job per checkpoint folder (checkpoint/lease.py).

Fast: the lease itself, in threads of this process. Slow: real ``python train.py`` jobs
on one dump folder: two at once, a holder killed with SIGKILL, a requeue whose
predecessor is still saving.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import CONFIG, REPO, error_lines

from torchtitan.checkpoint import CheckpointError
from torchtitan.checkpoint.lease import LEASE, Lease
from torchtitan.tools.launch import run_env


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
