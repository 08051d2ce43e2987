"""What a measurement ran on, and how much of the machine other work took meanwhile: what
every benchmark records beside its figures (``harness.bench``), and what the test session
prints at its top (``test/conftest.py``), so that a figure or a failure reads with its
machine.

Owns: the CPU's model and vector level (``/proc/cpuinfo``'s flags, and torch's own
``torch.backends.cpu.get_cpu_capability()``), a reading of the machine's CPU time
(``/proc/stat``, the CPUs this process may run on) and of this process tree's
(``/proc/<pid>/stat``: itself, the children it reaped, its live descendants), and the
arithmetic that turns two readings into the share of the machine *others* used between
them.

Never: measure a figure or decide what one means (a benchmark's own work); sleep on its
own (a reading is a snapshot: the caller takes one before and one after its measured
part, except ``sample``, which is asked to wait). Linux only: elsewhere the CPU is
``platform.processor()``, the level "other", and the load unknown (0 %, quiet).

Cost: a reading scans ``/proc`` once (a small read per process of the machine, to find
this tree's live descendants): a few ms, taken twice a run.

What it cannot see: a descendant re-parented away from this tree (a daemon that forked
twice) counts as others' work, as does steal time (a hypervisor's other guests: they
take the same cores).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

# A figure is from a quiet machine when others used at most this share of its capacity.
QUIET_PCT = 5.0

# /proc/stat's columns: user nice system idle iowait irq softirq steal guest guest_nice.
# guest and guest_nice are already inside user and nice; idle and iowait are not busy.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
_COUNTED_COLUMNS = 8


@dataclass(frozen=True)
class Reading:
    """One snapshot, in clock ticks (USER_HZ, the unit of /proc/stat and /proc/<pid>/stat)."""

    at: float  # time.monotonic()
    busy: int  # the machine's CPUs (those this process may run on), busy
    total: int  # the same CPUs, counted in all (busy + idle): the capacity
    own: int  # this process tree's CPU time


# ---- the CPU ----------------------------------------------------------------------------


def vector_level(flags: set[str]) -> str:
    """A CPU's vector level from its flags (/proc/cpuinfo's ``flags``): "AVX-512", "AVX2"
    or "other"."""
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "other"


def cpu_of(cpuinfo: str) -> tuple[str, set[str]]:
    """The model name and the flags of the first processor in /proc/cpuinfo's text ("" and
    no flags where it names none, as on some ARM machines)."""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif not line.strip() and model:
            break  # the end of the first processor's block
    return model, flags


def cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_facts() -> dict:
    """{"cpu", "vector", "torch_capability", "cores"}: the model, its vector level, what
    torch's CPU kernels dispatch to here, and the CPUs this process may use."""
    try:
        model, flags = cpu_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = "", set()
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception as e:  # the header and the report still print where torch cannot
        capability = f"unknown ({type(e).__name__})"
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "vector": vector_level(flags),
        "torch_capability": capability,
        "cores": cores(),
    }


def describe(facts: dict) -> str:
    """One line: "Intel(R) Xeon(R) Processor, AVX-512 (torch capability AVX512), 2 cores"."""
    return (
        f"{facts['cpu']}, {facts['vector']} (torch capability {facts['torch_capability']}), "
        f"{facts['cores']} cores"
    )


# ---- the load ---------------------------------------------------------------------------


def machine_ticks(stat: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """(busy, total) ticks in /proc/stat's text: summed over the ``cpuN`` lines of ``cpus``,
    or the aggregate ``cpu`` line where ``cpus`` is None."""
    busy = total = 0
    for line in stat.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *values = line.split()
        if (name == "cpu") != (cpus is None):
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in values[:_COUNTED_COLUMNS]]
        busy += sum(ticks[i] for i in _BUSY_COLUMNS if i < len(ticks))
        total += sum(ticks)
    return busy, total


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/<pid>/stat's fields from the state on (field 3; the name may hold spaces)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def process_ticks(pid: int) -> int:
    """CPU ticks of one process: its own (utime + stime, every thread) and those of the
    children it reaped (cutime + cstime). 0 where it is gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0
    return sum(int(x) for x in fields[11:15])  # fields 14-17: utime stime cutime cstime


def descendants(pid: int) -> list[int]:
    """The live (or not yet reaped) processes below ``pid``, at any depth."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(name))[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def tree_ticks(pid: int | None = None) -> int:
    """CPU ticks of ``pid``'s tree (default: this process): its own and its reaped
    children's, plus every descendant not yet reaped (whose own reaped children are in its
    count). Its own stat is read first: a child reaped during the scan is missed rather
    than counted twice, which errs towards calling the machine busy."""
    pid = os.getpid() if pid is None else pid
    own = process_ticks(pid)
    return own + sum(process_ticks(child) for child in descendants(pid))


def read() -> Reading:
    """A snapshot of the machine's and this process tree's CPU time (zeros off Linux)."""
    try:
        stat = Path("/proc/stat").read_text()
    except OSError:
        return Reading(time.monotonic(), 0, 0, 0)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy, total = machine_ticks(stat, cpus)
    if total == 0:  # cpuN lines missing (a restricted /proc): the aggregate
        busy, total = machine_ticks(stat)
    return Reading(time.monotonic(), busy, total, tree_ticks())


def others_busy_pct(start: Reading, end: Reading) -> float:
    """The share of the machine's capacity between two readings that processes outside
    this tree kept busy, in %: (the machine's busy ticks - this tree's) / its ticks in all.
    0.0 where no tick passed."""
    span = end.total - start.total
    if span <= 0:
        return 0.0
    others = (end.busy - start.busy) - (end.own - start.own)
    return max(0.0, 100.0 * others / span)


def load_between(start: Reading, end: Reading) -> dict:
    """{"others_busy_pct", "quiet", "wall_s"} of the span between two readings."""
    pct = others_busy_pct(start, end)
    return {"others_busy_pct": round(pct, 1), "quiet": pct <= QUIET_PCT,
            "wall_s": round(end.at - start.at, 2)}  # fmt: skip


def sample(seconds: float) -> dict:
    """``load_between`` over ``seconds`` from now (this process sleeps meanwhile)."""
    start = read()
    time.sleep(seconds)
    return load_between(start, read())
