"""Claims, the checkpoint lease and the token-count files on an object store: a real S3
API (moto's server on 127.0.0.1, reached through fsspec → s3fs → botocore, which
enforces ``If-None-Match`` / ``If-Match`` and gives ETags), one server for the module,
each test under its own prefix of one bucket.

The rule is claims.py's; on a store, create, renew, take over and release are each a
conditional request (storage.py). Each property has a negative control: the same
operation where it should succeed does."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import pytest
from helpers import cfg, write_parquet

from harness import s3
from torchtitan.checkpoint import CheckpointError
from torchtitan.checkpoint.lease import LEASE, Lease
from torchtitan.data import build_stream
from torchtitan.io import claims, storage

pytestmark = pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))


@pytest.fixture(scope="module")
def bucket():
    with s3.local_s3() as (name, _endpoint):
        yield name


@pytest.fixture
def prefix(bucket) -> str:
    """A fresh ``s3://bucket/<random>`` for one test."""
    return f"s3://{bucket}/{uuid.uuid4().hex[:8]}"


def _record_at(url: str) -> dict:
    return json.loads(storage.read_bytes(url))


# ---- the claim itself ------------------------------------------------------------------
def test_eight_creators_of_one_claim_one_wins(prefix):
    """Of 8 threads creating one claim at once, exactly one wins and the object holds its
    whole record. Negative control: once the winner released it, a creator wins again
    (the losers lost to the claim, not to the store)."""
    url = f"{prefix}/x.claim"
    for _ in range(3):  # three rounds: a race the store let two win would show
        records = [claims.record(rank=str(i)) for i in range(8)]
        won = [None] * 8
        start = threading.Barrier(8)

        def create(i, records=records, won=won, start=start):
            start.wait()
            won[i] = claims.create(url, records[i])

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert won.count(True) == 1, won
        winner = records[won.index(True)]
        assert _record_at(url) == winner
        assert claims.release(url, winner["token"]) and not storage.exists(url)


def test_a_claim_in_a_store_is_read_with_its_etag_and_age(prefix):
    """A read gives the record, the object's ETag and a heartbeat age by the store's clock
    (the reply's Date against LastModified): 0 to 1 s for a fresh claim, about 2 s after
    2 s. A heartbeat rewrites it under another ETag and ages it back to 0."""
    url = f"{prefix}/x.claim"
    mine = claims.record()
    assert claims.create(url, mine)
    seen = claims.read(url)
    assert seen.record == mine and seen.etag and not seen.torn and seen.age <= 1
    time.sleep(2.1)
    old = claims.read(url)
    assert 1 <= old.age <= 3 and old.etag == seen.etag
    assert claims.touch(url, mine["token"], old)
    new = claims.read(url)
    assert new.etag != seen.etag and new.age <= 1 and new.record["beat"] == 1
    assert claims.read(f"{prefix}/none.claim") is None


def test_a_take_over_needs_the_etag_it_saw(prefix):
    """A take-over is a PUT conditional on the ETag seen: it fails once the holder renewed
    its claim, once another taker took it, and once it was released and claimed again.
    Negative control: the same take-over on a fresh look wins, and the holder's next
    heartbeat then fails (it was taken over)."""
    url = f"{prefix}/x.claim"
    theirs, mine, third = (claims.record(rank=str(r)) for r in range(3))
    assert claims.create(url, theirs)
    seen = claims.read(url)
    assert claims.touch(url, theirs["token"])  # renewed since seen
    assert not claims.take_over(url, seen, mine, 60)
    assert _record_at(url)["token"] == theirs["token"]

    seen = claims.read(url)
    assert claims.take_over(url, seen, third, 60)  # another taker first
    assert not claims.take_over(url, seen, mine, 60)
    assert _record_at(url)["token"] == third["token"]

    seen = claims.read(url)
    assert claims.release(url, third["token"])
    assert claims.create(url, theirs)  # released and claimed again
    assert not claims.take_over(url, seen, mine, 60)

    seen = claims.read(url)  # the negative control
    assert claims.take_over(url, seen, mine, 60)
    assert _record_at(url)["token"] == mine["token"]
    assert not claims.touch(url, theirs["token"])  # the old holder's heartbeat fails
    assert claims.touch(url, mine["token"])


def test_a_heartbeat_renews_only_the_claim_it_read(prefix):
    """The holder's heartbeat is conditional on the ETag of the read that showed its
    token: a read taken before another process replaced the claim does not renew (nor
    overwrite) the replacement. Negative control: with a fresh read it renews."""
    url = f"{prefix}/x.claim"
    mine, theirs = claims.record(rank="0"), claims.record(rank="1")
    assert claims.create(url, mine)
    seen = claims.read(url)
    assert claims.take_over(url, seen, theirs, 60)
    assert not claims.touch(url, mine["token"], seen)  # the old read: If-Match fails
    assert _record_at(url) == theirs
    assert claims.touch(url, theirs["token"], claims.read(url))
    assert _record_at(url) == {**theirs, "beat": 1}


def test_a_release_removes_only_its_own_claim(prefix):
    """Release deletes the claim only while it holds this holder's token (and is still
    the object read, ``If-Match`` on the DELETE). Negative control: the holder's own
    release removes it."""
    url = f"{prefix}/x.claim"
    theirs, mine = claims.record(rank="0"), claims.record(rank="1")
    assert claims.create(url, mine)
    assert claims.take_over(url, claims.read(url), theirs, 60)
    assert not claims.release(url, mine["token"]) and _record_at(url) == theirs
    assert not storage.delete_object(url, '"not-its-etag"') and storage.exists(url)
    assert claims.release(url, theirs["token"]) and not storage.exists(url)
    assert not claims.release(url, theirs["token"])  # already gone


def test_a_lost_reply_to_a_winning_put_is_still_a_win(prefix):
    """A client retries a request whose reply was lost; the retry of a conditional put
    that won meets its own object (412). The object holding exactly the bytes sent, it
    was this write: the put says so (the ETag). Negative control: other bytes there are
    another's write, a loss."""
    url = f"{prefix}/x.claim"
    body = claims._body(claims.record())
    tag = storage.put_object(url, body, absent=True)
    assert tag and storage.put_object(url, body, absent=True) == tag  # the "retry"
    assert storage.put_object(url, body + b" ", absent=True) is None
    assert storage.put_object(url, body + b" ", etag='"stale"') is None
    assert storage.read_bytes(url) == body


def test_claims_on_another_store_are_refused_naming_it():
    with pytest.raises(OSError, match="gs://b/x.claim: claims need conditional writes"):
        claims.create("gs://b/x.claim", claims.record())


# ---- the checkpoint lease --------------------------------------------------------------
def test_a_second_job_on_a_bucket_prefix_is_refused_naming_the_holder(prefix, monkeypatch):
    """The lease of an ``s3://`` checkpoint folder is an object under it: a second job
    waits ``wait_s`` and stops with the local message, naming the holder's job id, host
    and pid. Negative control: once the holder releases, the second job takes it."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    folder = f"{prefix}/ckpt"
    first = Lease(folder, timeout_s=5, wait_s=0)
    first.acquire()
    assert _record_at(f"{folder}/{LEASE}")["token"] == first.token
    second = Lease(folder, timeout_s=5, wait_s=0.3)
    with pytest.raises(CheckpointError) as e:
        second.acquire()
    message = str(e.value)
    assert message.startswith(f"checkpoint folder {folder} is in use by another job (job 777")
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in message and "\n" not in message
    first.check()
    first.release()
    assert not storage.exists(f"{folder}/{LEASE}")
    second.acquire()
    assert _record_at(f"{folder}/{LEASE}")["token"] == second.token
    second.release()


def test_a_stale_lease_in_a_store_is_taken_over_and_its_holder_told(prefix, caplog):
    """A holder whose heartbeat stops for longer than its timeout (1 s) is taken over by
    the next job (its heartbeat's age by the store's clock), with a warning naming it;
    when the stalled holder's heartbeat resumes it finds the lease lost and ``check()``
    refuses to save. Negative control: while the holder beats (the same 1 s timeout, for
    longer than it), the next job is refused."""
    folder = f"{prefix}/ckpt"
    first = Lease(folder, timeout_s=1, wait_s=0)
    first.acquire()
    time.sleep(1.5)  # beating every 1/6 s: never stale
    with pytest.raises(CheckpointError, match="is in use by another job"):
        Lease(folder, timeout_s=1, wait_s=0.2).acquire()

    first._stop.set()  # the holder stalls (a hung process, a paused container)
    first._thread.join()
    second = Lease(folder, timeout_s=1, wait_s=10)
    begin = time.monotonic()
    second.acquire()
    assert 0.5 < time.monotonic() - begin < 5
    assert "taking over the lease" in caplog.text and "not refreshed" in caplog.text
    assert _record_at(f"{folder}/{LEASE}")["token"] == second.token

    first._stop.clear()  # the stall ends: the next heartbeat finds another holder
    first._thread = threading.Thread(target=first._beat, daemon=True)
    first._thread.start()
    deadline = time.monotonic() + 5
    while first.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(CheckpointError, match="lost the lease"):
        first.check()
    first.release()  # not its own any more: left to the new holder
    assert _record_at(f"{folder}/{LEASE}")["token"] == second.token
    second.release()


# ---- token counts ----------------------------------------------------------------------
def _corpus(folder, files: int = 4, docs: int = 16):
    """``files`` parquet files of ``docs`` short documents (16 units a file)."""
    for f in range(files):
        rows = [{"id": f"d{f}-{i}", "text": f"File {f}, document {i}. " * (3 + i % 5)}
                for i in range(docs)]  # fmt: skip
        write_parquet(folder / f"part-{f:03d}.parquet", rows)
    return folder


def _measured_in_a_fork(order, delay: float):
    """Fork a process that measures every unit of ``order`` (``delay`` s each), starting
    with the imports and the stream warm; (pid, the pipe its count of measured comes on)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it never returns into pytest
        code = 3
        try:
            measure = order.counts._measure

            def slow(unit, heartbeat=None, **piece):
                time.sleep(delay)
                return measure(unit, heartbeat, **piece)

            order.counts._measure = slow
            order.pass_tokens()
            os.write(write, str(order.counts.measured).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def test_two_processes_split_the_measuring_through_the_bucket(tmp_path, prefix, tokenizer):
    """Two processes measuring one corpus (16 units) with ``length_index_dir`` in a
    bucket hand the units out through claims in the bucket: each unit measured once, by
    one or the other (both measured some: they ran at once), 16 count files and no claim
    left. Negative control: a process alone, on a prefix of its own, measures all 16."""
    folder = _corpus(tmp_path / "c", files=1)
    counts = f"{prefix}/counts"
    training = cfg(folder, length_index_dir=counts, streaming="true").training
    orders = [build_stream(training, tokenizer).orders[0] for _ in range(2)]
    children = [_measured_in_a_fork(order, 0.02) for order in orders]
    measured = []
    for pid, pipe in children:
        _, status = os.waitpid(pid, 0)
        measured.append(int(os.read(pipe, 64) or b"-1"))
        os.close(pipe)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert sum(measured) == 16 and min(measured) > 0, measured
    fs, inner = storage._fs(counts)
    names = fs.find(inner)
    assert len([n for n in names if n.endswith(".npz")]) == 16
    assert not [n for n in names if n.endswith(".claim")]

    alone = build_stream(cfg(folder, length_index_dir=f"{prefix}/alone",
                             streaming="true").training, tokenizer).orders[0]  # fmt: skip
    alone.pass_tokens()
    assert alone.counts.measured == 16


def test_a_measurer_renews_its_claim_in_the_bucket(tmp_path, prefix, tokenizer):
    """While a unit is measured, the heartbeat ``measure_unit`` is given renews the
    claim in the bucket (its ``beat`` counted up): a measurer keeps its unit however long
    it takes. Negative control: a heartbeat with another token renews nothing."""
    folder = _corpus(tmp_path / "c", files=1)
    training = cfg(folder, length_index_dir=f"{prefix}/counts", streaming="true").training
    order = build_stream(training, tokenizer).orders[0]
    measure, beats = order.counts._measure, []

    def measured(unit, heartbeat=None, **piece):
        claim = order.counts.path(unit) + ".claim"
        claims.touch(claim, "another-token")
        beats.append(_record_at(claim).get("beat"))
        heartbeat()
        beats.append(_record_at(claim).get("beat"))
        return measure(unit, heartbeat, **piece)

    order.counts._measure = measured
    assert order.counts.counts(order.units(1)[0]).total > 0
    assert beats == [None, 1] and order.counts.measured == 1


def test_count_files_in_a_bucket_are_reused(tmp_path, prefix, tokenizer):
    """A second ``SourceCounts`` over the same bucket prefix reads every unit's counts:
    none measured, the same totals. Negative control: another bad-data policy (another
    key) measures all 16 again."""
    folder = _corpus(tmp_path / "c", files=1)
    training = cfg(folder, length_index_dir=f"{prefix}/counts", streaming="true").training
    first = build_stream(training, tokenizer).orders[0]
    tokens = first.pass_tokens()
    assert first.counts.measured == 16
    unit = tuple(int(x) for x in first.units(1)[0])
    assert first.counts.has(unit) and first.counts.path(unit).startswith(f"{prefix}/counts/")
    again = build_stream(training, tokenizer).orders[0]
    assert again.pass_tokens() == tokens and again.counts.measured == 0
    strict = build_stream(cfg(folder, length_index_dir=f"{prefix}/counts", streaming="true",
                              bad_data="error").training, tokenizer).orders[0]  # fmt: skip
    strict.pass_tokens()
    assert strict.counts.measured == 16


def test_a_damaged_count_file_in_a_bucket_is_measured_again(tmp_path, prefix, tokenizer,
                                                             caplog):  # fmt: skip
    """A count file whose bytes do not parse (written by something else: a PUT is whole)
    is named in a warning, deleted and measured again, its new file readable. Negative
    control: the file rewritten whole is read, not measured."""
    folder = _corpus(tmp_path / "c", files=1)
    training = cfg(folder, length_index_dir=f"{prefix}/counts", streaming="true",
                   length_index_wait_seconds=2).training  # fmt: skip
    order = build_stream(training, tokenizer).orders[0]
    unit = tuple(int(x) for x in order.units(1)[0])
    url = order.counts.path(unit)
    storage.put_object(url, b"PK" + bytes(100))
    assert order.counts.counts(unit).total > 0 and order.counts.measured == 1
    assert "unreadable" in caplog.text and url in caplog.text
    again = build_stream(training, tokenizer).orders[0]
    assert again.counts.counts(unit).total > 0 and again.counts.measured == 0


def test_a_count_file_once_published_is_kept(prefix):
    """Count files are published by a create-only PUT: a second writer's bytes never
    replace the first's (both hold the same counts by construction). Negative control:
    after the file is removed, the next publish writes."""
    url = f"{prefix}/k/0-8.npz"
    storage.publish(url, lambda f: f.write(b"first"))
    storage.publish(url, lambda f: f.write(b"second"))
    assert storage.read_bytes(url) == b"first"
    storage.remove(url)
    storage.publish(url, lambda f: f.write(b"second"))
    assert storage.read_bytes(url) == b"second"


class _Ranks:
    """Two ranks in one process; rank 1 does not see what rank 0 wrote when ``blind``."""

    world = 2

    def __init__(self, blind: bool):
        self.rank, self.blind = 0, blind

    def on_main(self, fn, *args):
        return fn(*args)

    def gather(self, obj) -> list:
        return [obj, obj and not self.blind]


def test_a_bucket_every_rank_sees_is_a_shared_folder(tmp_path, prefix, caplog):
    """The shared-folder check puts its marker in the bucket and finds it there (no
    warning), then removes it. Negative control: a rank that does not see it is named."""
    from torchtitan.data.plan import check_shared_folder

    training = cfg(tmp_path, length_index_dir=f"{prefix}/counts").training
    check_shared_folder(training, _Ranks(blind=False))
    assert "not shared" not in caplog.text
    fs, inner = storage._fs(f"{prefix}/counts")
    fs.invalidate_cache()
    assert not fs.find(inner)  # the marker is gone
    check_shared_folder(training, _Ranks(blind=True))
    assert f"token-count folder {prefix}/counts is not shared: ranks [1]" in caplog.text


def test_counts_on_a_store_without_conditional_writes_are_kept_in_memory(tmp_path, tokenizer,
                                                                         caplog):  # fmt: skip
    """A ``length_index_dir`` on an fsspec store this project makes no claims on (here
    ``memory://``) is named in one warning; the process measures what it reads and keeps
    it in memory, writing nothing there. Negative control: a file published there is
    found (the look would see a count file)."""
    import fsspec

    folder = _corpus(tmp_path / "c", files=1)
    where = f"memory://{uuid.uuid4().hex[:8]}/counts"
    order = build_stream(cfg(folder, length_index_dir=where, streaming="true").training,
                         tokenizer).orders[0]  # fmt: skip
    assert order.pass_tokens() > 0 and order.counts.measured == 16
    assert f"cannot write token counts to {where}" in caplog.text
    assert "claims need conditional writes" in caplog.text
    fs, inner = fsspec.core.url_to_fs(where)
    assert not fs.find(inner)
    storage.publish(f"{where}/k/0-8.npz", lambda f: f.write(b"counts"))
    assert fs.find(inner) == [f"{inner}/k/0-8.npz"]
