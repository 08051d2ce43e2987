"""torchtitan/data/index.py: token counts measured just in time, per unit, in files shared
by every process (content-keyed, atomic, claimed), and refused when stale."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest
from helpers import cfg, write_parquet

from torchtitan.data import build_dataloader, build_stream
from torchtitan.data import index as length_index
from torchtitan.data.plan import check_shared_folder
from torchtitan.data.sources import DataError
from torchtitan.io import claims


def corpus(folder, files: int = 8, docs: int = 32):
    """``files`` parquet files of ``docs`` short documents (16 units a file)."""
    for f in range(files):
        rows = [{"id": f"d{f}-{i}", "text": f"File {f}, document {i}. " * (3 + i % 5)}
                for i in range(docs)]  # fmt: skip
        write_parquet(folder / f"part-{f:03d}.parquet", rows)
    return folder


@pytest.mark.parametrize("workers,delta", [(0, 1), (0, -1), (2, 1)])
def test_stale_counts_stop_with_one_clear_error(tmp_path, tokenizer, workers, delta):
    """A document whose token count is not its unit's (the data or tokenizer changed
    behind the counts), one token too long or too short, is a DataError naming the count
    file, not a silently shifted order; from a loader worker too, as one line. A damaged
    count file is measured again."""
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"id": f"d{i}", "text": f"Document {i}. " * (5 + i)}) + "\n" for i in range(6)))  # fmt: skip
    cache = tmp_path / "cache"
    c = cfg(tmp_path / "d.jsonl", length_index_dir=cache, num_workers=workers, shuffle="false")
    loader = build_dataloader(c, tokenizer, 0, 1)
    next(loader)
    loader.close()
    path = min(cache.rglob("*.npz"), key=lambda p: int(p.stem.split("-")[0]))  # the first unit
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["lengths"][0] += delta
    np.savez(path, **arrays)
    stale = build_dataloader(c, tokenizer, 0, 1)
    with pytest.raises(DataError, match=r"tokens, its unit's token counts \d+: the data or") as e:
        for _ in range(6):
            next(stale)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert path.name in str(e.value)
    stale.close()
    path.write_bytes(path.read_bytes()[:40])  # a truncated file
    again = build_dataloader(c, tokenizer, 0, 1)  # measured and written again
    next(again)
    again.close()
    with np.load(path) as z:
        assert z["lengths"][0] == arrays["lengths"][0] - delta


def test_the_first_step_measures_only_the_units_its_windows_lie_in(tmp_path, tokenizer):
    """A never-seen corpus of 512 units: the first step (8 windows) measures the units
    its windows lie in (at most 2 a window), and nothing more is on disk; later steps
    measure as they go. Negative control: the probe sees all 512 when every unit is
    asked for (``pass_tokens``, what the old first start did)."""
    folder = corpus(tmp_path / "c", files=32, docs=16)
    c = cfg(folder, length_index_dir=tmp_path / "counts", global_batch_size=8, streaming="true")
    loader = build_dataloader(c, tokenizer, 0, 1)
    assert len(loader.stream.orders[0].units(32)) == 512
    loader.next_step()
    loader.skipped_documents()  # what the metrics ask after each step: no unit measured
    measured = loader.stream.orders[0].counts.measured
    on_disk = len(list((tmp_path / "counts").rglob("*.npz")))
    assert 8 <= measured <= 16 and on_disk == measured, (measured, on_disk)
    for _ in range(4):
        loader.next_step()
    assert loader.stream.orders[0].counts.measured > measured
    everything = build_stream(replace(c.training, length_index_dir=str(tmp_path / "all")),
                              tokenizer)  # fmt: skip
    everything.orders[0].pass_tokens()
    assert everything.orders[0].counts.measured == 512


def test_counts_are_keyed_by_content_not_by_path(tmp_path, tokenizer):
    """The key follows a file's content signature, the tokenizer and the settings that
    change the counts (bad-data policy, the column, map-style or streaming units); the
    path and an unrelated setting keep it, so a corpus copied elsewhere reuses them."""
    training = cfg(tmp_path).training
    entry = {"files": [["a.jsonl", 10, 7]]}

    def key(e=entry, sha="sha-a", t=training, streaming=True, field="text"):
        return length_index.counts_key(e, 1, [0], sha, t, field, "stream" if streaming else "map")

    assert key() == key(t=replace(training, steps=99))
    assert key() == key({"files": [["elsewhere/b.jsonl", 10, 7]]})
    changed = [key({"files": [["a.jsonl", 11, 7]]}), key(sha="sha-b"),
               key(t=replace(training, bad_data="error")), key(streaming=False),
               key(field="tokens")]  # fmt: skip
    assert len({key(), *changed}) == 6


def test_a_copied_corpus_reuses_the_counts(tmp_path, tokenizer):
    """The same files under another folder read the counts the first measured: no unit
    is measured again. Negative control: another tokenizer setting measures them anew."""
    import shutil

    first = corpus(tmp_path / "a", files=2)
    c = cfg(first, length_index_dir=tmp_path / "counts", streaming="true")
    build_stream(c.training, tokenizer).orders[0].pass_tokens()
    shutil.copytree(first, tmp_path / "b")
    again = build_stream(replace(c.training, dataset_path=str(tmp_path / "b")), tokenizer)
    assert again.orders[0].pass_tokens() > 0 and again.orders[0].counts.measured == 0
    strict = build_stream(replace(c.training, bad_data="error"), tokenizer)
    strict.orders[0].pass_tokens()
    assert strict.orders[0].counts.measured == 32


MEASURE = textwrap.dedent("""
    import sys, time
    from helpers import cfg
    from torchtitan.data import build_stream
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    folder, counts, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stream = build_stream(cfg(folder, length_index_dir=counts, streaming="true").training,
                          Tokenizer(DEFAULT_TOKENIZER_PATH))
    order = stream.orders[0]
    measure = order.counts._measure
    def slow(unit, heartbeat=None, **piece):
        time.sleep(delay)
        return measure(unit, heartbeat, **piece)
    order.counts._measure = slow
    order.pass_tokens()
    print("measured", order.counts.measured, flush=True)
""")


def _measurer(folder, counts, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["test", "."])}
    return subprocess.Popen([sys.executable, "-c", MEASURE, str(folder), str(counts), str(delay)],
                            env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip


def test_a_kill_during_measuring_loses_only_the_units_in_flight(tmp_path, tokenizer):
    """A process measuring a corpus (64 units) is killed -9 part way: the units it wrote
    stay, and a relaunch measures only the rest, taking over the dead process's claim.
    Negative control: the relaunch in an empty folder measures all 64."""
    folder = corpus(tmp_path / "c", files=4, docs=16)
    counts = tmp_path / "counts"
    proc = _measurer(folder, counts, 0.05)
    deadline = time.monotonic() + 60
    while len(list(counts.rglob("*.npz"))) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = len(list(counts.rglob("*.npz")))
    assert 10 <= kept < 64 and list(counts.rglob("*.claim"))  # killed inside a unit
    relaunch = build_stream(cfg(folder, length_index_dir=counts, streaming="true").training,
                            tokenizer)  # fmt: skip
    relaunch.orders[0].pass_tokens()
    assert relaunch.orders[0].counts.measured == 64 - kept
    assert not list(counts.rglob("*.claim"))
    fresh = build_stream(cfg(folder, length_index_dir=tmp_path / "empty", streaming="true").training,
                         tokenizer)  # fmt: skip
    fresh.orders[0].pass_tokens()
    assert fresh.orders[0].counts.measured == 64


# Slow tier (two interpreter launches, 5 s): the ranks of every multi-rank launch in the
# fast tier share their measuring through the same claims.
@pytest.mark.slow
def test_two_processes_share_the_measuring_each_unit_once(tmp_path):
    """Two processes measuring one corpus at once hand the units out between them through
    the claims: together they measure each of the 64 units once."""
    folder = corpus(tmp_path / "c", files=4, docs=16)
    procs = [_measurer(folder, tmp_path / "counts", 0.02) for _ in range(2)]
    measured = [int(p.communicate(timeout=120)[0].split()[-1]) for p in procs]
    assert sum(measured) == 64, measured
    assert len(list((tmp_path / "counts").rglob("*.npz"))) == 64


def _claim(counts, unit, pid: int, **fields) -> str:
    """A claim on ``unit`` of a process ``pid`` of this machine (as ``claims.record``
    writes it, ``fields`` changed), as rank 7."""
    path = counts.path(unit) + ".claim"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**claims.record(rank="7"), "pid": pid, **fields}, f)
    return path


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def test_waiting_on_another_process_has_a_limit_and_names_it(tmp_path, tokenizer):
    """A unit claimed by a live process that never finishes: the wait ends after
    ``length_index_wait_seconds`` in one line naming rank, pid and host (and the units
    ahead are measured meanwhile). Negative control: a claim of a dead process of this
    machine is taken over at once."""
    folder = corpus(tmp_path / "c", files=1)
    c = cfg(folder, length_index_dir=tmp_path / "counts", length_index_wait_seconds=0.5,
            streaming="true")  # fmt: skip
    order = build_stream(c.training, tokenizer).orders[0]
    units = order.units(1)
    host = socket.gethostname()
    _claim(order.counts, units[0], os.getpid())
    with pytest.raises(
        DataError, match=rf"waited \d+ s for .* rank 7, host {host}, pid {os.getpid()}"
    ):
        order.counts.counts(units[0], units[1:4])
    assert order.counts.measured == 3  # the units ahead, measured while it waited
    _claim(order.counts, units[5], _dead_pid())
    assert order.counts.counts(units[5]).total > 0


def test_a_dead_pid_of_another_container_or_machine_is_waited_for(tmp_path, tokenizer):
    """The same host name is no evidence: a claim whose pid is free here but which was
    made in another pid namespace (another container on this machine) or on another
    machine (another boot id) may be a live measurer, judged by its heartbeat alone:
    waited for until ``length_index_wait_seconds``. Negative control: the same dead pid
    of this namespace is taken over at once."""
    folder = corpus(tmp_path / "c", files=1)
    c = cfg(folder, length_index_dir=tmp_path / "counts", length_index_wait_seconds=0.3,
            streaming="true")  # fmt: skip
    order = build_stream(c.training, tokenizer).orders[0]
    units = order.units(1)
    dead = _dead_pid()
    for u, other in ((0, {"pid_ns": "pid:[1]"}), (1, {"boot_id": "another-machine"})):
        _claim(order.counts, units[u], dead, **other)
        with pytest.raises(DataError, match="waited"):
            order.counts.counts(units[u])
    _claim(order.counts, units[2], dead)
    assert order.counts.counts(units[2]).total > 0 and order.counts.measured == 1


def test_a_torn_claim_is_judged_by_its_age(tmp_path, tokenizer, monkeypatch):
    """A claim left empty or half-written names no holder to ask: it is waited for while
    it is younger than ``CLAIM_STALE_S`` (0.6 s here) and taken over once it is older, so a
    later process never waits out ``length_index_wait_seconds`` on nobody. Negative
    control: a fresh one is not taken over before the limit."""
    monkeypatch.setattr(length_index, "CLAIM_STALE_S", 0.6)
    folder = corpus(tmp_path / "c", files=1)
    c = cfg(folder, length_index_dir=tmp_path / "counts", length_index_wait_seconds=30,
            streaming="true")  # fmt: skip
    order = build_stream(c.training, tokenizer).orders[0]
    units = order.units(1)
    for u, torn in ((0, ""), (1, '{"host": "h')):
        path = order.counts.path(units[u]) + ".claim"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(torn)
        old = time.time() - 5
        os.utime(path, (old, old))
        begin = time.monotonic()
        assert order.counts.counts(units[u]).total > 0
        assert time.monotonic() - begin < 0.5  # older than the limit: taken over at once
    path = order.counts.path(units[2]) + ".claim"
    open(path, "w").close()
    begin = time.monotonic()
    assert order.counts.counts(units[2]).total > 0
    assert 0.4 < time.monotonic() - begin < 10
    assert order.counts.measured == 3 and not list((tmp_path / "counts").rglob("*.claim"))


def _killed_child(run) -> int:
    """Run ``run()`` in a fork of this process (the imports and the built stream warm, so
    no interpreter start-up), which ``run`` ends by a SIGKILL of itself; its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it never returns into pytest
        try:
            run()
        finally:
            os._exit(3)  # run() did not kill itself
    _, status = os.waitpid(pid, 0)
    return status


def _sigkilled(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_measurer_killed_between_create_and_write_is_taken_over(tmp_path, tokenizer,
                                                                   monkeypatch):  # fmt: skip
    """A process killed -9 between a claim's exclusive create and its write (a file system
    without hard links: the fallback) leaves an empty claim; the next process takes the
    unit over within ``CLAIM_STALE_S`` (0.5 s here) and measures it, instead of waiting
    ``length_index_wait_seconds`` for nobody."""
    folder = corpus(tmp_path / "c", files=1)
    counts = tmp_path / "counts"
    c = cfg(folder, length_index_dir=counts, length_index_wait_seconds=30, streaming="true")
    order = build_stream(c.training, tokenizer).orders[0]

    def measure_killed_at_the_write():
        def no_links(*_):
            raise PermissionError("this file system has no hard links")

        dump, calls = claims.json.dump, []

        def killed(*args, **kw):
            calls.append(1)
            if len(calls) == 2:  # the write after the exclusive create: killed before it
                os.kill(os.getpid(), signal.SIGKILL)
            return dump(*args, **kw)

        os.link, claims.json.dump = no_links, killed
        order.counts.counts(order.units(1)[0])

    assert _sigkilled(_killed_child(measure_killed_at_the_write))
    (torn,) = counts.rglob("*.claim")
    assert torn.read_text() == ""
    monkeypatch.setattr(length_index, "CLAIM_STALE_S", 0.5)
    begin = time.monotonic()
    assert order.counts.counts(order.units(1)[0]).total > 0
    assert time.monotonic() - begin < 0.5 + 5
    assert order.counts.measured == 1 and not torn.exists()


def test_a_kill_while_counts_are_written_leaves_no_partial_file(tmp_path, tokenizer, caplog):
    """Counts are written aside and renamed into place: a process killed -9 half way
    through writing a unit's counts leaves no file under the unit's name (at most a
    stray temporary one), so the next process measures the unit without meeting a
    damaged file. (Written in place, the next process would find half a file there, warn
    and measure it again: a fallback that hides the partial write, so this test looks at
    the folder itself.)"""
    folder = corpus(tmp_path / "c", files=1)
    counts = tmp_path / "counts"
    c = cfg(folder, length_index_dir=counts, streaming="true")
    order = build_stream(c.training, tokenizer).orders[0]
    order.counts.share_tokens = False  # the counts alone are written (no tokens before them)

    def measure_killed_in_the_write():
        def killed(f, **arrays):  # half a file written, then kill -9
            f.write(b"PK" + bytes(100))
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        length_index.np.savez = killed
        order.counts.counts(order.units(1)[0])

    assert _sigkilled(_killed_child(measure_killed_in_the_write))
    written = [p for p in counts.rglob("*.npz") if not p.name.startswith(".")]
    assert written == [] and list(counts.rglob(".*.npz")), list(counts.rglob("*"))
    fresh = build_stream(c.training, tokenizer).orders[0]
    with caplog.at_level(logging.WARNING, logger=length_index.logger.name):
        assert fresh.counts.counts(fresh.units(1)[0]).total > 0
    assert fresh.counts.measured == 1 and "unreadable" not in caplog.text


def test_measuring_and_waiting_say_how_far_they_are(tmp_path, tokenizer, monkeypatch):
    """Every PROGRESS_EVERY_S, a process that measures says how many units and tokens a
    second, and one that waits says on whom. Negative control: without ``log`` (every
    rank but rank 0) nothing is said."""
    folder = corpus(tmp_path / "c", files=1)
    monkeypatch.setattr(length_index, "PROGRESS_EVERY_S", 0.0)
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    level = length_index.logger.level
    length_index.logger.setLevel(logging.INFO)
    length_index.logger.addHandler(handler)
    try:
        for log, where in ((False, "quiet"), (True, "loud")):
            order = build_stream(cfg(folder, length_index_dir=tmp_path / where).training,
                                 tokenizer).orders[0]  # fmt: skip
            order.counts.log = order.counts._progress.log = log
            order.pass_tokens()
            if not log:
                assert not said.getvalue()
    finally:
        length_index.logger.removeHandler(handler)
        length_index.logger.setLevel(level)
    lines = said.getvalue().splitlines()
    assert lines and "units measured here" in lines[-1] and "tokens/s" in lines[-1]


class _Ranks:
    """Two ranks in one process; rank 1 does not see what rank 0 wrote when ``blind``."""

    world = 2

    def __init__(self, rank: int, blind: bool):
        self.rank, self.blind = rank, blind

    def on_main(self, fn, *args):
        return fn(*args)

    def gather(self, obj) -> list:
        return [obj, not self.blind]


def test_a_folder_some_rank_does_not_see_is_named_in_a_warning(tmp_path, caplog):
    """A token-count folder rank 1 does not see (node-local in a multi-node job) gets a
    warning naming it and the rank, and the marker is removed. Negative control: a
    shared folder, no warning."""
    training = cfg(tmp_path, length_index_dir=tmp_path / "counts").training
    logger = logging.getLogger("torchtitan.data.plan")
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logger.addHandler(handler)
    try:
        check_shared_folder(training, _Ranks(0, blind=False))
        assert not said.getvalue()
        check_shared_folder(training, _Ranks(0, blind=True))
    finally:
        logger.removeHandler(handler)
    assert f"token-count folder {tmp_path / 'counts'} is not shared: ranks [1]" in said.getvalue()
    assert not list((tmp_path / "counts").glob(".job-*"))


def test_offline_preparation_leaves_a_job_nothing_to_measure(tmp_path, tokenizer):
    """``prepare`` (2 processes) measures every unit into the job's folder; a loader then
    measures none over a pass, and a second ``prepare`` finds nothing to do. Negative
    control: the same loader over an empty folder measures as it goes."""
    from torchtitan.data.prepare import prepare

    folder = corpus(tmp_path / "c", files=4)
    c = cfg(folder, length_index_dir=tmp_path / "counts", streaming="true", global_batch_size=8)
    done = prepare(c.training, tokenizer, num_proc=2, progress=False)
    assert done["units"] == done["missing"] == done["measured"] == 64
    assert not list((tmp_path / "counts").rglob("*.tokens"))  # no reader: no tokens kept
    loader = build_dataloader(c, tokenizer, 0, 1)
    for _ in range(10):
        loader.next_step()
    assert loader.stream.orders[0].counts.measured == 0
    assert prepare(c.training, tokenizer, num_proc=2, progress=False)["missing"] == 0
    cold = build_dataloader(replace(c, training=replace(c.training, length_index_dir=str(
        tmp_path / "empty"))), tokenizer, 0, 1)  # fmt: skip
    cold.next_step()
    assert cold.stream.orders[0].counts.measured > 0
