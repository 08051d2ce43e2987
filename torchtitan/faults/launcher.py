"""A rank whose launcher died stops: the launcher's death becomes a SIGTERM to the rank.

torchrun starts every rank in a session of its own, so a SIGKILL of torchrun alone (an
OOM kill, a node agent's ``kill -9``) reaches no rank: without this, the ranks train on
as orphans, hold the folder's lease and write checkpoints that a relaunch then resumes
from, past where the user stopped.

Owns: watching the parent. A daemon thread compares ``os.getppid()`` with the launcher's
pid every ``POLL_S``; once the rank was handed to another parent (init or a subreaper:
the launcher is gone) it logs one line and sends this process ``SIGTERM``. What follows
is the preemption path (``checkpoint.save_on_signal``, SIGTERM by default): every rank of
the job agrees to stop after the same step and that step's checkpoint is written, then
the rank exits and its loader workers with it (their own watchdog sees their parent
go). Without SIGTERM among the save signals, SIGTERM's default action ends the rank. A
rank whose peers cannot agree (a peer gone too) stops through the broken collective.

Only under torchrun (``TORCHELASTIC_RUN_ID`` set): a plain ``python train.py`` is the
user's own process. Under Slurm with ``srun torchrun``, torchrun is the step's task and
its death ends the step: Slurm signals and then kills every process of the step (its
cgroup) after ``KillWait``, so the ranks save within that window if SIGTERM reaches them
first, and nothing outlives the step either way. With ``srun python train.py`` (no
torchrun) the ranks are the tasks themselves and Slurm's own rules apply.

Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that started the rank ends, which
in a launcher that starts ranks from a worker thread is not the launcher's death.

Cost: one ``getppid`` a second on a daemon thread; nothing on the training thread.

Never: save, exit the process or touch the process group itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger("torchtitan")

# The launcher's death is noticed within this: a few debug-model steps (a getppid a poll).
POLL_S = 0.2


class LauncherWatch:
    """Watch the launcher (this process's parent when started) until ``close()``."""

    def __init__(self, poll_s: float = POLL_S, signum: int = signal.SIGTERM):
        self.launcher = os.getppid()
        self.poll_s, self.signum = poll_s, signum
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.wait(self.poll_s):
            if os.getppid() != self.launcher:
                self.fired = True
                logger.warning(
                    "the launcher (pid %d) is gone: this rank stops as on %s", self.launcher,
                    signal.Signals(self.signum).name,
                )  # fmt: skip
                os.kill(os.getpid(), self.signum)
                return

    def close(self):
        self._stop.set()
        self._thread.join()


def watch_launcher() -> LauncherWatch | None:
    """Start watching this rank's launcher, if torchrun started it (else None)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    return LauncherWatch()
