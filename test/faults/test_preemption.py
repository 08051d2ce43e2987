"""The preemption agreement across ranks, on two forked gloo processes (no launcher, no
training): a signal to one rank stops every rank after the same step.

The end-to-end scenarios (a DDP job with loader workers signalled on one rank, then on
every process; a pipeline stage; the preemption campaign) are in the slow tier
(test_train.py); this is the fast test of the property they rest on.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import torch.distributed as dist
from helpers import rank_context, rank_results

from torchtitan.faults.preemption import Preemption

SIGNAL_AT = 3  # the step after which rank 1 receives its signal


def _rank(rank: int, store: str, agree: bool, out) -> None:
    """One rank's loop: after each step ask ``requested()``; rank 1 is signalled after
    step SIGNAL_AT. Reports the step it stopped after (None: it trained to the end)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        group = dist.new_group(backend="gloo") if agree else None
        dims = SimpleNamespace(rank=rank, control_group=group)
        preemption = Preemption(dims, ["SIGUSR1"])
        stopped = None
        for step in range(1, 9):
            if rank == 1 and step == SIGNAL_AT:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.requested():  # with the control group: the step's collective
                stopped = step
                break
        preemption.close()
        out.put((rank, stopped, preemption.received))
    finally:
        dist.destroy_process_group()


def stops(tmp_path, agree: bool) -> dict:
    ctx = rank_context()
    out = ctx.Queue()
    store = tmp_path / ("store_agree" if agree else "store_alone")
    procs = [ctx.Process(target=_rank, args=(r, str(store), agree, out)) for r in range(2)]
    for p in procs:
        p.start()
    return {rank: (stopped, received) for rank, stopped, received in rank_results(out, procs)}


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Rank 1 alone is signalled during step 3: both ranks stop after step 3, rank 0
    without having received anything. Negative control: without the control group's
    all-reduce (each rank on its own flag, what parallel.any_rank returning its own
    flag would do), rank 1 stops alone and rank 0 trains on to the end (in a real job it
    would then hang in the next collective)."""
    results = stops(tmp_path, agree=True)
    assert results == {0: (SIGNAL_AT, None), 1: (SIGNAL_AT, "SIGUSR1")}, results
    alone = stops(tmp_path, agree=False)
    assert alone == {0: (None, None), 1: (SIGNAL_AT, "SIGUSR1")}, alone


# A torchrun worker that stopped on the agreement, then signalled while the interpreter
# tears down (after it has put SIG_DFL back for Python handlers): it must still exit 0.
LATE_SIGNAL = """
import os, signal, sys, time
from types import SimpleNamespace
from torchtitan.faults.preemption import Preemption

class Late:
    # Runs while __main__'s globals are cleared, after signal handling has ended (what
    # it needs is bound now: the globals may be gone by then).
    def __del__(self, os=os, kill=signal.SIGTERM, sleep=time.sleep, mark=sys.argv[2]):
        os.kill(os.getpid(), kill)
        sleep(0.2)
        os.close(os.open(mark, os.O_CREAT | os.O_WRONLY))

preemption = Preemption(SimpleNamespace(rank=0, control_group=None), ["SIGTERM"])
if sys.argv[1] == "agreed":
    preemption.said_stop(5, written=False)
preemption.close()
late = Late()
"""


def test_a_signal_after_the_agreed_stop_cannot_end_the_rank_with_a_signal_status(tmp_path):
    """Two groups signalled 100 ms apart stop after the same step; the second group's
    signal can land while its rank is already exiting, after the interpreter has put
    SIG_DFL back for Python handlers: the rank (a torchrun worker) must still exit 0,
    else torchrun reports the job failed. Negative control: a rank that did not stop on
    the agreement gets its previous handler (SIG_DFL) back, and the same late signal
    ends it with -SIGTERM."""
    import subprocess
    import sys

    env = {**os.environ, "TORCHELASTIC_RUN_ID": "late"}
    for how, code in (("agreed", 0), ("not_stopped", -signal.SIGTERM)):
        mark = tmp_path / how
        done = subprocess.run([sys.executable, "-c", LATE_SIGNAL, how, str(mark)], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == code, (how, done.returncode, done.stderr[-2000:])
        assert mark.exists() == (code == 0), how
