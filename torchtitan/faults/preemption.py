"""Save on preemption: a signal to any process of the job stops every rank at the same step.

Owns: the signal handlers (``checkpoint.save_on_signal``, default SIGTERM and
SIGUSR1), the agreement at each step boundary and the stop. A handler only raises a
flag; the training loop asks ``requested()`` after every step, which combines the
flags of all ranks in one small all-reduce on the control group, so every rank stops
after the same step; the loop has that step's checkpoint written, and ``said_stop``
says so.

Cost: one 4-byte gloo all-reduce per step on the control group (a CPU tensor:
no device sync), independent of model size; O(log ranks) latency.

A signal while a peer is gone (killed: torchrun SIGTERMs the rest) ends without a
save: the agreement, or the save's own collectives, break at once (parallel.py names
the peer), and DCP publishes a checkpoint only after every rank wrote its part.

Never: save or close the checkpoint (the loop decides), decide what it holds, or exit
the process (train.py returns).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from torchtitan import parallel

logger = logging.getLogger("torchtitan")


class Preemption:
    def __init__(self, dims: parallel.ParallelDims, signal_names: list[str]):
        self.dims = dims
        self.received: str | None = None
        self.last_check_s = 0.0  # what the last agreement cost the loop
        self._previous = {}
        self._across = None  # the replica groups the stop is agreed with (fault tolerance)
        self.stopped = False  # the loop stopped on the agreement (said_stop)
        for name in signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        # A second signal while stopping changes nothing: the flag is already up.
        self.received = self.received or signal.Signals(signum).name

    def agree_across(self, replicas):
        """Fault tolerance: agree on the stop across the replica groups too. The group's
        flag travels in its committed step's cross-group all-reduce (``replicas.commit``):
        a signalled group leaves after that step and the others train on, unless fewer
        than ``min_replica_groups`` would be left, in which case every group stops after
        that same step (a scheduler preempting the whole job, node by node), however far
        apart the signals land."""
        self._across = replicas
        replicas.asked_to_stop = lambda: self.received is not None

    def requested(self) -> bool:
        """True on every rank once any rank has received a signal (call at every step)."""
        if not self._previous:  # no signal configured (the same on every rank): no collective
            return False
        begin = time.perf_counter()
        across = self._across
        # Under fault tolerance only the agreed flag counts: a group that stopped on its
        # own flag would leave the others waiting for a quorum that cannot come.
        flag = self.received is not None if across is None else across.stop_agreed
        stop = parallel.any_rank(self.dims, flag)
        self.last_check_s = time.perf_counter() - begin
        return stop

    def said_stop(self, step: int, written: bool = True):
        """Log the stop after ``step``: its checkpoint written here, or (fault tolerance:
        another group writes the job's) not."""
        self.stopped = True
        why = self.received or "signal to another rank"
        if written:
            logger.warning("preempted at step %d: checkpoint step-%d written (%s)", step, step, why)
        else:
            logger.warning("preempted at step %d (%s): no checkpoint from this replica group "
                           "(only the lowest live one writes the job's)", step, why)  # fmt: skip

    def close(self):
        """Put the previous handlers back, unless the job stopped on a signal in a
        torchrun worker (which exits after the loop): then the stop signals are ignored
        until it exits, so that a signal landing while it finishes (a scheduler
        signalling node by node, after the ranks or groups agreed to stop) cannot end it
        with a signal's exit status. Ignored, not handled: the interpreter puts SIG_DFL
        back for every Python handler before it tears its modules down (process groups,
        torchft's manager: a fraction of a second), and a signal then ended the rank
        with -15. One plain process (tests call ``train.main`` in theirs) gets its
        handlers back."""
        keep_out = self.stopped and os.environ.get("TORCHELASTIC_RUN_ID")
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if keep_out else handler)
        self._previous = {}
