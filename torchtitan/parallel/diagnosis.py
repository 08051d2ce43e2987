"""Which rank failed, and why: said through the job's c10d store when a rank fails or a
collective breaks.

Owns: refusing a torchrun restart (``torchrun_restart_problem``), recording this rank's
failure for the others (``report_failure``), reading another's (``failed_peer``),
telling a broken collective (``collective_broke``) and naming the ranks that stopped
answering (``why_collective_broke``). Cost: nothing per step; O(ranks) store look-ups
once, after a failure.

Never: make process groups or run collectives.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from torchtitan.parallel.groups import ParallelDims


def _attempt() -> str:
    # torchrun keeps its store across restarts of the worker group: keys are per attempt.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def torchrun_restart_problem() -> str | None:
    """One line when torchrun has restarted the job's processes (``--max-restarts``), else
    None. Not supported: on torch 2.13 with gloo, restarted ranks mostly fail to form
    their process group again after a rank was killed (they dial the dead attempt's
    addresses: "Connection refused"), or hang; see the README. The scheduler's requeue
    starts the job afresh and resumes it."""
    if _attempt() == "0":
        return None
    return (
        f"torchrun restarted the job (attempt {_attempt()}), which it cannot survive: its "
        "process groups do not form again in restarted processes; launch with "
        "--max-restarts 0 and let the scheduler requeue the job (it resumes from the last "
        "checkpoint)"
    )


def _failure_key() -> str:
    return f"torchtitan/first_failure/{_attempt()}"


def _broken_key(rank: int) -> str:
    return f"torchtitan/saw_collective_break/{_attempt()}/{rank}"


def report_failure(dims: ParallelDims, message: str):
    """Record that this rank failed, and why, for the other ranks (the first report wins)."""
    if dims.store is None:
        return
    try:
        dims.store.compare_set(_failure_key(), "", f"{dims.rank}\n{message}")
    except RuntimeError:
        pass  # the store is gone: the job is ending anyway


def _reported_failure(dims: ParallelDims) -> tuple[int, str] | None:
    if dims.store.check([_failure_key()]):
        rank, _, message = dims.store.get(_failure_key()).decode().partition("\n")
        return int(rank), message
    return None


def failed_peer(dims: ParallelDims) -> str | None:
    """'rank N failed: <its message>' if another rank reported a failure already (it
    reports before it exits, and its exit is what breaks this rank), else None."""
    try:
        failure = None if dims.store is None else _reported_failure(dims)
    except RuntimeError:
        return None  # the store is gone: the job is ending anyway
    if failure is None or failure[0] == dims.rank:
        return None
    return f"rank {failure[0]} failed: {failure[1]}"


def collective_broke(error: BaseException) -> bool:
    """True when ``error``, or an error it wraps, is a collective or store operation that
    timed out or lost its peer (gloo says so only in its message)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError) or "gloo/transport" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _gloo_reason(error: BaseException) -> str:
    """'Timed out waiting 10000ms for recv operation to complete', from gloo's message."""
    text = str(error)
    at = text.find("gloo/transport")
    line = text[at:].split("] ", 1)[-1] if at >= 0 else text
    return line.split(". This is typically")[0].splitlines()[0][:200]


def why_collective_broke(dims: ParallelDims, error: BaseException,
                         wait_s: float = 3.0) -> str | None:  # fmt: skip
    """Why a collective broke on this rank, in one line: another rank's reported failure,
    or the ranks that did not answer. None when every rank answered and none reported a
    failure (then the cause is this rank's own, and its traceback says more).

    Every rank whose collective breaks says so in the store; a rank that is stopped
    (SIGSTOP), hung, or dead never does, and after ``wait_s`` it is named. ``wait_s``
    covers ranks whose own wait ran out a little later; it is short because torchrun
    sends SIGTERM as soon as one rank exits. Cost: O(ranks) store look-ups per poll.
    """
    if dims.store is None:
        return None
    peers = [_broken_key(r) for r in range(dims.world_size) if r != dims.rank]
    deadline = time.monotonic() + wait_s
    try:
        dims.store.set(_broken_key(dims.rank), "1")
        while True:
            if dims.store.check([_failure_key()]):
                return failed_peer(dims)
            if dims.store.check(peers):
                return None
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        silent = [r for r in range(dims.world_size)
                  if r != dims.rank and not dims.store.check([_broken_key(r)])]  # fmt: skip
    except RuntimeError:
        return None  # the store is gone: the job is ending anyway
    if not silent:  # the last ones answered just now
        return None
    names = ", ".join(map(str, silent))
    return (
        f"rank{'s' if len(silent) > 1 else ''} {names} stopped answering: a collective "
        f"failed ({_gloo_reason(error)}) and {'they' if len(silent) > 1 else 'it'} did not "
        f"report it within {wait_s:.0f} s (stopped, hung or killed; see its log, and "
        "comm.train_timeout_seconds for how long a collective waits)"
    )
