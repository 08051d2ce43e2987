"""torchtitan/faults/launcher.py: a rank whose launcher died gets SIGTERM within a few seconds.

The whole path (torchrun killed -9 mid-run: every rank saves, no process is left, the
relaunch is exact) is in the slow tier (test_train.py); this is the watch alone, in a
process tree laid out as torchrun lays it out: the rank in a session of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO

from torchtitan.tools.launch import run_env

RANK = textwrap.dedent("""
    import os, signal, sys, time
    from torchtitan.faults.launcher import LauncherWatch
    def stop(signum, frame):
        with open(sys.argv[1], "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    if sys.argv[2] == "watch":
        LauncherWatch(poll_s=0.1)
    print(os.getpid(), flush=True)
    time.sleep(60)
""")

# The launcher: starts the rank in a session of its own (as torchrun does) and waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    print(rank.stdout.readline().strip(), flush=True)
    rank.wait()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "unwatched"])
def test_a_rank_whose_launcher_is_killed_gets_sigterm(tmp_path, watch):
    """SIGKILL of the launcher alone: the watched rank gets SIGTERM (its handler runs)
    within 1.5 s. Negative control: an unwatched rank lives on as an orphan."""
    said = tmp_path / "signal"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, RANK, str(said), "watch" if watch else "none"],
        cwd=REPO, env=run_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    rank = int(launcher.stdout.readline())
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 1.5
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        if watch:
            assert not _alive(rank) and said.read_text() == "SIGTERM"
        else:
            assert _alive(rank) and not said.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGKILL)


def test_only_a_torchrun_rank_is_watched(monkeypatch):
    """A plain ``python train.py`` is the user's own process: no watch."""
    from torchtitan.faults.launcher import watch_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    watch = watch_launcher()
    assert watch is not None and watch.launcher == os.getppid() and not watch.fired
    watch.close()
