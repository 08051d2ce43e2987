"""The suite's own guards (conftest.py): a hang is one failure naming its test, a launch
may outlast the unit limit while its process runs, and a process left alive fails the
test that left it. Checked on a planted session: pytest run on planted tests, with this
suite's conftest as its plugin. In the slow tier: the guards act on every test of the
fast one, and a second pytest session costs what a torchrun launch does."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import REPO

from torchtitan.tools.launch import run_env

PLANTED = """
import subprocess, sys, time
import pytest

@pytest.mark.time_limit(1)
def test_endless():
    while True:
        pass

@pytest.mark.time_limit(0.5)
def test_launch_outlasting_the_limit():
    assert subprocess.run([sys.executable, "-c", "import time; time.sleep(2)"]).returncode == 0

@pytest.mark.time_limit(1)
def test_work_after_a_launch_that_outlasted_the_limit():
    end = time.monotonic() + 6.5  # across the alarm at 6 s, which finds the launch gone
    assert subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"]).returncode == 0
    while time.monotonic() < end:
        pass

def test_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

from helpers import rank_context

def _report(out):
    import os
    out.put(os.environ.get("PLANTED"))

def _outlive(out):
    out.put("started")
    time.sleep(120)

def test_a_rank_sees_its_tests_environment(monkeypatch):
    for value in ("one", "two"):  # the forkserver started before the first test
        monkeypatch.setenv("PLANTED", value)
        ctx = rank_context()
        out = ctx.Queue()
        rank = ctx.Process(target=_report, args=(out,))
        rank.start()
        assert out.get(timeout=60) == value
        rank.join()

def _work(out):
    time.sleep(4)
    out.put("done")

@pytest.mark.time_limit(2)
def test_a_rank_outlasting_the_limit():
    ctx = rank_context()
    out = ctx.Queue()
    rank = ctx.Process(target=_work, args=(out,))
    rank.start()
    assert out.get(timeout=60) == "done"
    rank.join()

def test_leaves_a_rank():
    ctx = rank_context()
    out = ctx.Queue()
    ctx.Process(target=_outlive, args=(out,)).start()
    assert out.get(timeout=60) == "started"

import torch
from torch.utils.data import DataLoader, IterableDataset

class Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(2)

@pytest.mark.parametrize("run", range(3))  # the signal lands in pytest's code by chance
def test_fails_while_its_loader_workers_run(run):
    loader = iter(DataLoader(Endless(), batch_size=2, num_workers=2))
    next(loader)
    assert False, "planted failure"

def test_after_them():
    pass
"""


@pytest.mark.slow
def test_a_hang_fails_its_test_and_a_leftover_process_fails_the_test_that_left_it(tmp_path):
    """An endless loop fails its own test at its limit and the session goes on; a test
    whose launched process or rank runs past the unit limit passes (the forkserver's
    start-up, before the first test, in no test's limit), and so does its own work
    after the launch within the limit again; a test that leaves a
    process alive errors at teardown, naming it, and the process is killed; so does one
    that leaves a rank of ``helpers.rank_context`` alive, while the forkserver and
    multiprocessing's resource tracker, which serve later tests, fail none, and the
    leftover is named as a rank of the forkserver (a rank shows the server's command
    line). A rank runs with its test's environment, not the forkserver's. A test that
    fails while its loader workers run is reported by name under xdist, its killed
    workers reaped before torch's SIGCHLD handler can raise in pytest's code (it had
    raised in 1 of 2 such sessions: INTERNALERROR, the test unnamed). The session runs
    under ``-n 2`` as the suite does. Negative controls: the planted passing tests pass."""
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = {**run_env(), "PYTHONPATH": f"{REPO}:{REPO / 'test'}",
           "TORCHTITAN_TEST_LEFTOVER_GRACE_S": "0.5"}  # fmt: skip
    begin = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
         "-rA", "-n", "2", str(tmp_path / "test_planted.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    took = time.monotonic() - begin
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "FAILED test_planted.py::test_endless" in out and "over its limit of 1 s" in out
    assert "PASSED test_planted.py::test_launch_outlasting_the_limit" in out
    assert "PASSED test_planted.py::test_work_after_a_launch_that_outlasted_the_limit" in out
    assert "ERROR test_planted.py::test_leaves_a_process" in out
    assert "test_planted.py::test_leaves_a_process left 1 process(es) alive" in out
    assert "PASSED test_planted.py::test_a_rank_sees_its_tests_environment" in out
    assert "PASSED test_planted.py::test_a_rank_outlasting_the_limit" in out
    assert "ERROR test_planted.py::test_leaves_a_rank" in out
    assert "test_planted.py::test_leaves_a_rank left 1 process(es) alive" in out
    assert "a rank forked from the forkserver" in out
    for run in range(3):
        assert f"FAILED test_planted.py::test_fails_while_its_loader_workers_run[{run}]" in out
        assert f"ERROR test_planted.py::test_fails_while_its_loader_workers_run[{run}]" in out
    assert "INTERNALERROR" not in out + proc.stderr, (out + proc.stderr)[-3000:]
    assert "PASSED test_planted.py::test_after_them" in out
    assert took < 240, took
    left = subprocess.run(["pgrep", "-f", "import time; time.sleep(120)"], capture_output=True)
    assert left.returncode == 1, "the leftover process was not killed"
