"""torchtitan/io/claims.py: the one rule for claim files (the lease, the count claims).

The lease and the counts each test it through their own path (test/checkpoint/
test_lease.py, test/data/test_index.py: torn files, kills between create and write,
other containers); this is the rule itself: exclusive and whole creation, the liveness
of a holder, and a take-over that never replaces a claim that changed."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from torchtitan.io import claims


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_claim_is_created_once_and_whole(tmp_path):
    """Of 8 threads creating one claim at once, exactly one wins, and the file holds its
    whole record; no temporary file is left."""
    path = str(tmp_path / "x.claim")
    records = [claims.record(rank=str(i)) for i in range(8)]
    won = [None] * 8
    start = threading.Barrier(8)

    def create(i):
        start.wait()
        won[i] = claims.create(path, records[i])

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won.count(True) == 1
    assert json.loads(open(path).read()) == records[won.index(True)]
    assert os.listdir(tmp_path) == ["x.claim"]


def test_the_liveness_rule():
    """Gone at once: a dead pid of this machine and namespace, a reaped or unreaped one,
    or a live pid that a later process took (another start time). Not gone (the heartbeat
    decides): this live process, and any pid of another namespace or machine, or of a
    record that names neither."""
    me = claims.record()
    zombie = subprocess.Popen(["sleep", "0.2"])
    started = claims.process_start(zombie.pid)
    deadline = time.monotonic() + 10
    while _state(zombie.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not reaped: a zombie
    try:
        assert started is not None and _state(zombie.pid) == "Z"
        assert claims.holder_gone({**me, "pid": _dead_pid()})
        assert claims.holder_gone({**me, "pid": zombie.pid, "start": started})
        assert claims.holder_gone({**me, "start": me["start"] + 1})
        assert not claims.holder_gone(me)
        dead = _dead_pid()
        for other in ({"pid_ns": "pid:[1]"}, {"boot_id": "another-machine"}, {"boot_id": None},
                      {"pid_ns": None}):  # fmt: skip
            assert not claims.holder_gone({**me, "pid": dead, **other}), other
    finally:
        zombie.wait()


def test_gone_judges_a_torn_claim_by_its_age_alone(tmp_path):
    path = tmp_path / "x.claim"
    path.write_text("")
    seen = claims.read(str(path))
    assert seen.torn and claims.gone(seen, 60) is None
    old = time.time() - 61
    os.utime(path, (old, old))
    assert "torn" in claims.gone(claims.read(str(path)), 60)


def test_a_take_over_replaces_only_the_claim_it_saw_gone(tmp_path):
    """A stale claim is taken over; not when its holder renewed it meanwhile, nor when
    another process put a claim of its own there, nor while another takes it over."""
    path = str(tmp_path / "x.claim")
    old = time.time() - 100

    def stale(rec) -> claims.Seen:
        with open(path, "w") as f:
            json.dump(rec, f)
        os.utime(path, (old, old))
        return claims.read(path)

    theirs, mine = claims.record(rank="0"), claims.record(rank="1")
    seen = stale(theirs)
    claims.touch(path)  # renewed
    assert not claims.take_over(path, seen, mine, 60)
    seen = stale(theirs)
    stale(claims.record(rank="2"))  # released and claimed again (and stale too)
    assert not claims.take_over(path, seen, mine, 60)
    seen = stale(theirs)
    open(path + claims.TAKEOVER, "w").close()  # another process is taking it over
    assert not claims.take_over(path, seen, mine, 60)
    os.remove(path + claims.TAKEOVER)
    assert claims.take_over(path, seen, mine, 60)
    assert claims.read(path).record == mine and claims.gone(claims.read(path), 60) is None
    assert not claims.release(path, theirs["token"]) and os.path.exists(path)
    assert claims.release(path, mine["token"]) and not os.path.exists(path)
