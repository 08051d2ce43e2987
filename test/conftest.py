"""Shared fixtures: the real tokenizer, small real-text corpora, and ways to run training.

Training runs either in-process (``train_here``: one rank, ``train.main(argv)``, no
interpreter start-up) or as real multi-process jobs (``torchrun``). Metrics and
provenance are read back strictly (a duplicated step fails the read).

Two guards hold for every test:
- **A time limit.** A test may compute for ``UNIT_LIMIT_S`` in this process (a hang
  becomes one failure naming the test, and the session goes on); while a process it
  started still runs, the limit is ``LAUNCH_LIMIT_S`` (the launch's own timeout is the
  tighter bound). ``@pytest.mark.time_limit(seconds)`` sets another own-work limit.
- **No process left behind.** Every process this session starts carries
  ``SESSION_ENV`` in its environment, wherever it is re-parented; a test after which one
  is still alive (``LEFTOVER_GRACE_S`` after it ends) fails, naming them, and they are
  killed so that the next test starts clean.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import time
import uuid
from functools import cache
from pathlib import Path

import pytest

import train as train_script
from torchtitan import REPO_ROOT
from torchtitan.data.sources import open_source, resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchtitan.provenance import check_exactly_once, read_provenance
from torchtitan.runs import DEBUG_CONFIG, read_records
from torchtitan.runs import losses as losses  # noqa: PLC0414 - re-exported for the tests
from torchtitan.runs import torchrun as _torchrun

REPO = REPO_ROOT
CONFIG = ["--job.config_file", DEBUG_CONFIG]


# ---- guards: a time limit per test, and no process left behind --------------------------
UNIT_LIMIT_S = 60  # ~10x the longest in-process test on 2 cores
LAUNCH_LIMIT_S = 900  # a launch's own subprocess timeout is normally the bound
SLOW_UNIT_LIMIT_S = 600  # the slow tier's in-process scenarios
# An orphaned loader worker notices within a few seconds (the guard's own test sets less).
LEFTOVER_GRACE_S = float(os.environ.get("TORCHTITAN_TEST_LEFTOVER_GRACE_S", "10"))
SESSION_ENV = "TORCHTITAN_TEST_SESSIONS"
# This session's token, after those of the sessions that launched it (a pytest run by a
# test): every process started from here on carries it, and the enclosing sessions' too.
TOKEN = uuid.uuid4().hex
os.environ[SESSION_ENV] = ":".join(filter(None, [os.environ.get(SESSION_ENV), TOKEN]))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "time_limit(seconds): the test's own-work limit, in place of UNIT_LIMIT_S"
    )


def _carries_token(environ: bytes) -> bool:
    prefix = f"{SESSION_ENV}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return TOKEN.encode() in entry[len(prefix) :].split(b":")
    return False


def session_processes(launched_only: bool = False) -> list[tuple[int, str]]:
    """(pid, command line) of every live process this session started, however deep
    or re-parented: this process's children, and those whose environment carries this
    session's token (with ``launched_only``, only those: processes started with their
    own command, not forked from this one). Linux (/proc); elsewhere none are found.
    Cost: two small reads per process of this user."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            if state == b"Z":
                continue  # exited, waiting to be reaped: holds nothing
            # A process forked from this one (a loader worker) shows the environment this
            # one was started with, without the token: it is found as a child.
            if launched_only or int(ppid) != os.getpid():
                with open(f"/proc/{name}/environ", "rb") as f:
                    if not _carries_token(f.read()):
                        continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


class TimeLimitExceeded(BaseException):
    """A BaseException: a test's own ``except Exception`` (train.main's) cannot swallow it."""


def _limit_of(item) -> float:
    marker = item.get_closest_marker("time_limit")
    if marker is not None:
        return float(marker.args[0])
    return SLOW_UNIT_LIMIT_S if "slow" in item.keywords else UNIT_LIMIT_S


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm the test's time limit around its setup, call and teardown (SIGALRM: the main
    thread is interrupted wherever it is, so an endless Python loop fails its test)."""
    if not hasattr(signal, "setitimer"):
        return (yield)
    limit, begin = _limit_of(item), time.monotonic()

    def on_alarm(signum, frame):
        elapsed = time.monotonic() - begin
        # A launched job (not a loader worker forked from here: that is this test's own
        # work) runs: look again soon.
        if elapsed < LAUNCH_LIMIT_S and session_processes(launched_only=True):
            signal.setitimer(signal.ITIMER_REAL, 5.0)
            return
        # Once: a second alarm could land in the teardown (before it kills what the test
        # left) or in pytest's own hooks.
        raise TimeLimitExceeded(
            f"{item.nodeid} ran {elapsed:.0f} s, over its limit of {limit:.0f} s "
            f"(conftest.UNIT_LIMIT_S, or its time_limit mark)"
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Fail the test after which a process this session started is still alive."""
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := session_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, (
        f"{request.node.nodeid} left {len(left)} process(es) alive "
        f"{LEFTOVER_GRACE_S} s after it ended (killed now): "
        + "; ".join(f"pid {pid}: {cmd[:160]}" for pid, cmd in left)
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a CUDA GPU is visible; elsewhere they are
    skipped with the reason (scripts/gpu_check.sh runs them on a GPU machine)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def length_index_cache(tmp_path_factory):
    """Length indexes go to a folder of this session (jobs it launches inherit it), never
    to the user's cache."""
    import os

    from torchtitan.data.index import CACHE_ENV

    folder = tmp_path_factory.mktemp("cache")
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    yield folder
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_TOKENIZER_PATH)


def bundled_documents(source: str, count: int, max_chars: int = 1200) -> list[dict]:
    """Real documents from the bundled corpus, shortened so tests cross many boundaries."""
    import datasets

    files = resolve_source(name=source).files
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    return [
        {"id": ds[i]["id"], "text": ds[i]["text"][: 200 + (i * 97) % max_chars]}
        for i in range(count)
    ]


def write_jsonl(folder: Path, docs: list[dict], files: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per_file = (len(docs) + files - 1) // files
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            for doc in docs[f * per_file : (f + 1) * per_file]:
                out.write(json.dumps(doc) + "\n")
    return folder


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """24 short real documents (Shakespeare) in two jsonl files."""
    return write_jsonl(
        tmp_path_factory.mktemp("small") / "shakespeare", bundled_documents("shakespeare", 24)
    )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """8 very short real documents: a rank's shards wrap into a new epoch within ~15 sequences."""
    return write_jsonl(
        tmp_path_factory.mktemp("tiny") / "shakespeare", bundled_documents("shakespeare", 8, 300)
    )


@pytest.fixture(scope="session")
def dozen_corpus(tmp_path_factory) -> Path:
    """12 very short real documents: 12 automatic shards, so 1, 2, 3, 4, 6 or 12 consumers."""
    return write_jsonl(
        tmp_path_factory.mktemp("dozen") / "shakespeare", bundled_documents("shakespeare", 12, 300)
    )


@pytest.fixture(scope="session")
def second_corpus(tmp_path_factory) -> Path:
    """16 short real documents (KJV) in two jsonl files, for mixing."""
    return write_jsonl(tmp_path_factory.mktemp("second") / "kjv", bundled_documents("kjv", 16))


def heavy_tailed_documents(count: int, seed: int = 0) -> list[dict]:
    """``count`` documents of real text (KJV and Shakespeare) whose lengths are heavy-tailed
    like a web corpus's: log-normal characters, median ~500, from 60 to ~12,000."""
    import numpy as np

    text = "\n".join(
        d["text"] for s in ("kjv", "shakespeare") for d in bundled_documents(s, 40, 30000)
    )
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(500), 1.1, count), 60, 12000).astype(int)
    starts = rng.integers(0, len(text) - 12001, count)
    return [
        {"id": f"h{i:04d}", "text": text[a : a + n]} for i, (a, n) in enumerate(zip(starts, sizes))
    ]


@pytest.fixture(scope="session")
def heavy_corpus(tmp_path_factory) -> Path:
    """240 documents of heavy-tailed lengths in three jsonl files."""
    return write_jsonl(tmp_path_factory.mktemp("heavy") / "heavy", heavy_tailed_documents(240), 3)


@cache
def opened(corpus: str, seed: int = 7, shuffle: bool = True, streaming: bool = False):
    """One opened source per corpus and order, shared by every dataset a test builds."""
    return open_source(resolve_source(path=corpus), "text", "id", seed, shuffle, streaming)


def torchrun(
    args: list, nproc: int = 2, timeout: int = 300, script: str = "train.py"
) -> subprocess.CompletedProcess:
    """Launch a real multi-process job; returns the finished process (check returncode)."""
    return _torchrun(nproc, list(args), script=script, timeout=timeout)


def shim_env(folder: Path, code: str, **env: str) -> dict:
    """The environment of a launched job whose every interpreter runs ``code`` first (a
    ``sitecustomize`` module in ``folder``): a probe wrapped around the real code, to
    count or slow it, never a stand-in for it."""
    import os

    from torchtitan.runs import run_env

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(code)
    return {**run_env(), "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)]), **env}


def train(dump, *extra, nproc=2, expect_ok=True) -> subprocess.CompletedProcess:
    """The debug config as a real ``nproc``-rank torchrun job."""
    proc = torchrun([*CONFIG, "--job.dump_folder", str(dump), *map(str, extra)], nproc=nproc)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_main(argv: list) -> tuple[int, str]:
    """``train.main(argv)`` in this process: (exit status, what it wrote to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = train_script.main([str(a) for a in argv])
        except SystemExit as e:  # config errors exit before anything is built
            status = e.code
    return status, err.getvalue()


def train_here(dump, *extra, expect_ok=True) -> tuple[int, str]:
    """The debug config as one in-process rank (no interpreter start-up)."""
    status, log = run_main([*CONFIG, "--job.dump_folder", dump, *extra])
    if expect_ok:
        assert status == 0, log[-4000:]
    return status, log


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def read_jsonl(path) -> list[dict]:
    return read_records(path)


def assert_exactly_once(dump):
    reports = check_exactly_once(read_provenance(str(Path(dump) / "provenance")))
    assert reports and all(r.duplicate_tokens == 0 and r.gaps == 0 for r in reports.values()), (
        reports
    )
