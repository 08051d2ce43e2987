"""Fixtures (the real tokenizer, small real-text corpora, a length-index cache of the
session) and the two guards that hold for every test; the helpers tests share are in
helpers.py.

Test files mirror the package (``test/data/`` for ``torchtitan/data/``, ...) and are
imported in pytest's default ``prepend`` mode, each under its own basename, so a basename
is unique across the folders (pytest refuses a second one): a loader worker or a pickled
object finds its test module by that name. ``helpers`` is importable from every folder
(``pythonpath`` in pyproject.toml).

The guards:
- **A time limit.** A test may compute for ``UNIT_LIMIT_S`` in this process (a hang
  becomes one failure naming the test, and the session goes on); while a process it
  started still runs (a launched job, or a rank of ``helpers.rank_context``), the limit is
  ``LAUNCH_LIMIT_S`` (the test's own wait on it is the tighter bound), and the work after
  it has ``UNIT_LIMIT_S`` again. The ranks' forkserver starts before the first test.
  ``@pytest.mark.time_limit(seconds)`` sets another limit for both.
- **No process left behind.** Every process this session starts carries
  ``SESSION_ENV`` in its environment, wherever it is re-parented; a test after which one
  is still alive (``LEFTOVER_GRACE_S`` after it ends) fails, naming them, and they are
  killed so that the next test starts clean (a dead loader worker reaped, so that
  torch's SIGCHLD handler does not raise in pytest's own code).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    bundled_documents,
    heavy_tailed_documents,
    rank_context,
    start_rank_server,
    write_jsonl,
)

from harness import machine, tiers
from torchtitan.data.pretokenized_write import pretokenize
from torchtitan.data.sources import resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

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

# One compute thread per test process (unless OMP_NUM_THREADS says otherwise): the suite
# runs one xdist worker per core, and torch's default of a thread per core in each worker
# had the workers' OpenMP threads spinning against each other (8 in-process training
# steps of the debug model, with the other core busy: 0.6 CPU-s on one thread, 2-9 CPU-s
# on two). train.main and the processes the tests start read the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# ``datasets``' cache (the Arrow copy ``load_dataset`` makes of a map-style source's files,
# a lock file each, the downloads' records) goes to a folder of this process, removed at
# its end, as on CI's fresh machine; never to the user's. Set before ``datasets`` is
# imported (it derives its paths once), and inherited by every job a test launches. The
# suite's runs had left ~5,000 entries (1.7 GB) in the user's cache in a day.
DATASETS_CACHE = tempfile.mkdtemp(prefix="torchtitan-test-datasets-")
os.environ["HF_DATASETS_CACHE"] = DATASETS_CACHE


def pytest_unconfigure(config):
    shutil.rmtree(DATASETS_CACHE, ignore_errors=True)


def pytest_report_header(config):
    """The CPU at the top of the run ("cpu: Intel(R) Xeon(R) Processor, AVX-512 (torch
    capability AVX512), 2 cores"): a failure that depends on the kernels torch picks, or on
    the cores, reads with the machine it happened on."""
    return f"cpu: {machine.describe(machine.cpu_facts())}"


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


SERVER_COMMANDS = (b"from multiprocessing.forkserver import main",
                   b"from multiprocessing.resource_tracker import main")  # fmt: skip


def _multiprocessing_servers() -> set[int]:
    """multiprocessing's forkserver (``helpers.rank_context``) and resource tracker: they
    serve the worker's later tests and end with it. Found by what they are, a child of this
    process started with a server's command, not by the pid a server object holds: the
    issue's "forkserver" left alive was a rank (forked from the server, a rank shows the
    server's command line), and a server this process started through another object
    (one restarted, or a fresh ``ForkServer``) holds a pid the module's object does not.
    A server started by a rank or a launched job is that job's, and is counted."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    known = ((multiprocessing.forkserver._forkserver, "_forkserver_pid"),
             (multiprocessing.resource_tracker._resource_tracker, "_pid"))  # fmt: skip
    found = {pid for server, name in known if (pid := getattr(server, name, None)) is not None}
    for child in _children(os.getpid()):
        with contextlib.suppress(OSError):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if any(command in f.read() for command in SERVER_COMMANDS):
                    found.add(child)
    return found


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


def session_processes(launched_only: bool = False) -> list[tuple[int, str]]:
    """(pid, what it is) of every live process this session started, however deep or
    re-parented: this process's children, and those whose environment carries this
    session's token (with ``launched_only``, only those: a launched job or a rank of
    ``helpers.rank_context``, not a loader worker forked from this process).
    multiprocessing's servers, which outlive a test by design, are not counted. A process
    forked without an exec shows its parent's command line (a rank, the forkserver's; a
    loader worker, pytest's), so each is named with its parent. Linux (/proc); elsewhere
    none are found. Cost: two small reads per process of this user."""
    found, servers = [], _multiprocessing_servers()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) == os.getpid() or int(name) in servers:
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
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or another user's
            continue
        if int(ppid) in servers:
            command = f"a rank forked from the forkserver (pid {int(ppid)}): {command}"
        elif int(ppid) == os.getpid():
            command = f"forked from this test process (a loader worker?): {command}"
        found.append((int(name), command))
    return found


def _kill(pids: list[int]) -> None:
    """SIGKILL ``pids`` and reap those that are this process's multiprocessing children
    (loader workers). torch's DataLoader handles SIGCHLD in this process by raising for a
    worker of a live iterator that died of a signal (``_error_if_any_worker_fails``); the
    test's failure keeps its iterator alive, so the handler raised wherever the signal
    landed: in pytest's report of the teardown, and under xdist the worker stopped on an
    INTERNALERROR with the test unnamed. While the kill runs, SIGCHLD has no handler; once
    the workers are reaped the handler finds nothing to raise for."""
    import multiprocessing

    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for child in multiprocessing.active_children():
            if child.pid in pids:
                child.join(timeout=30)
    finally:
        signal.signal(signal.SIGCHLD, previous)


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
    launched = [False]  # the last alarm found a launched job running

    def on_alarm(signum, frame):
        elapsed = time.monotonic() - begin
        # A launched job or a rank of helpers.rank_context (not a loader worker forked
        # from here: that is this test's own work) runs: look again soon. The test's own
        # wait on it (a launch's timeout, a queue's) is the tighter bound; a rank counted
        # as this test's work failed DDP's 3-rank test at 60 s beside two CPU hogs.
        if elapsed < max(LAUNCH_LIMIT_S, limit) and session_processes(launched_only=True):
            launched[0] = True
            signal.setitimer(signal.ITIMER_REAL, 5.0)
            return
        # It ended since the last look: the work after it (a fixture reading what the
        # job wrote) gets the test's own limit, not what the launch left of it (a
        # 4-rank launch of 65 s on a slow machine failed in its last second otherwise).
        if launched[0]:
            launched[0] = False
            signal.setitimer(signal.ITIMER_REAL, limit)
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
    _kill([pid for pid, _ in left])
    assert not left, (
        f"{request.node.nodeid} left {len(left)} process(es) alive "
        f"{LEFTOVER_GRACE_S} s after it ended (killed now): "
        + "; ".join(f"pid {pid}: {what[:200]}" for pid, what in left)
    )


# Modules whose tests start torchft's threads in the test process (see the hook below).
TORCHFT_IN_PROCESS = {"test_fault_tolerance", "test_ft_moments"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the tier counts see every test
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a CUDA GPU is visible; elsewhere they are
    skipped with the reason (scripts/gpu_check.sh runs them on a GPU machine). The
    tiers' counts are kept for test_docs (harness/tiers.py). Tests that
    share a module-scoped fixture (one launch serving many checks) stay on one xdist
    worker, so the fixture is built once."""
    import torch

    tiers.remember(config, items)
    for item in items:
        if shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # Tests that run torchft in their own process (its Rust runtime and servers, an
    # in-process lighthouse) leave its threads in the xdist worker; a later test there
    # that forks from the worker can inherit a lock one of them held, and its child
    # crashes or hangs (seen twice in a fast-tier run, in forked ranks). Ranks now start
    # from the forkserver (helpers.rank_context), but loader workers still fork from the
    # test process, as they do in a job: these tests are dispatched last.
    items.sort(key=lambda item: item.module.__name__ in TORCHFT_IN_PROCESS)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start the ranks' forkserver once the tests are known, before the first: its
    start-up is no test's work (helpers.start_rank_server)."""
    if any(getattr(getattr(item, "module", None), "rank_context", None) is rank_context
           for item in session.items):  # fmt: skip
        start_rank_server()


def shares_a_module_fixture(item) -> bool:
    """Whether the test uses a fixture of module scope (built once for its module)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope == "module" for chain in defs for d in chain)


@pytest.fixture(scope="session", autouse=True)
def length_index_cache(tmp_path_factory):
    """Length indexes go to a folder of this session (jobs it launches inherit it), never
    to the user's cache."""
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


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Calls of the tokenizer by text, in this process (measuring and reading both go
    through packing.encode_document)."""
    from torchtitan.data import packing

    seen: Counter = Counter()
    real = packing.encode_document

    def counting(tokenizer, text):
        seen[text] += 1
        return real(tokenizer, text)

    monkeypatch.setattr(packing, "encode_document", counting)
    return seen


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """24 short real documents (Shakespeare) in two jsonl files."""
    return write_jsonl(
        tmp_path_factory.mktemp("small") / "shakespeare", bundled_documents("shakespeare", 24)
    )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """8 very short real documents in two jsonl files: a pass of the corpus is a few
    dozen windows of 32 tokens, so a few steps cross passes."""
    return write_jsonl(
        tmp_path_factory.mktemp("tiny") / "shakespeare", bundled_documents("shakespeare", 8, 300)
    )


@pytest.fixture(scope="session")
def dozen_corpus(tmp_path_factory) -> Path:
    """12 very short real documents in two jsonl files: runs of 1 to 4 ranks (an elastic
    chain, the 4-rank layouts) read it through within a few steps and cross passes."""
    return write_jsonl(
        tmp_path_factory.mktemp("dozen") / "shakespeare", bundled_documents("shakespeare", 12, 300)
    )


@pytest.fixture(scope="session")
def second_corpus(tmp_path_factory) -> Path:
    """16 short real documents (KJV) in two jsonl files, for mixing."""
    return write_jsonl(tmp_path_factory.mktemp("second") / "kjv", bundled_documents("kjv", 16))


@pytest.fixture(scope="session")
def heavy_corpus(tmp_path_factory) -> Path:
    """240 documents of heavy-tailed lengths in three jsonl files."""
    return write_jsonl(tmp_path_factory.mktemp("heavy") / "heavy", heavy_tailed_documents(240), 3)


@pytest.fixture(scope="session")
def pretokenized(tmp_path_factory, tiny_corpus, tokenizer) -> Path:
    """tiny_corpus, pretokenized in this process."""
    out = tmp_path_factory.mktemp("pretok") / "tok"
    pretokenize(resolve_source(path=str(tiny_corpus)), tokenizer, str(out), workers=1)
    return out


@pytest.fixture(autouse=True)
def _project_logger_as_new():
    """Each test starts with the project's logger as a fresh process has it: an in-process
    ``train.main()`` (train.setup_logging) gives it a handler, a level and no propagation,
    which would hide its lines from a later test's ``caplog``."""
    project = logging.getLogger("torchtitan")
    project.handlers, project.propagate = [], True
    project.setLevel(logging.NOTSET)
    yield
