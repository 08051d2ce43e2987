"""A fault-tolerant job at scale, windows only: the real split (``replica_steps.split_loader``,
``BatchSchedule.rank_slice``) and the real try of a step (``replica_steps.StepTry``: the
rewind of an uncommitted step), driven by a simulated quorum through random deaths,
joins and heals, and checked from the spans every committed step read.

What is simulated: the quorum (who is alive, who takes part, who dies during a step,
whose vote fails), and the loader reduced to what the split decides: ``WindowLoader``
holds a ``windows.Position`` (windows taken) and the step number, as
``ParallelDataLoader`` does, and a step hands out the spans ``[lo, hi)`` of global
windows that each of its group's ranks reads (the loader's ``plan_steps`` reads the
same slice of ``stream.advance``'s windows). No torch, no data: a thousand groups of
eight ranks over 10,000 steps in about a minute.

The check (``check_step``): the spans of a committed step's participants, in quorum
order, tile exactly ``[start, start + G)`` where ``start`` is where the uninterrupted
run's step begins (the sum of the schedule's earlier global batches); so every
committed step reads the uninterrupted run's windows, every window once.

Events a step may bring, at random: groups that die before its quorum, during the step
(nobody commits: every participant rewinds) or after their commit; several in one
step; dead groups started again (fresh: step 0, position 0), which heal at the next
quorum from its first participant at the highest step, also while others heal or die
in that same step; and votes that fail with everybody alive.

Never: train, read data, or decide anything the real code decides.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from torchtitan.data.schedule import BatchSchedule
from torchtitan.data.windows import Position
from torchtitan.faults.replica_steps import StepTry, split_loader


class RankLoader:
    """What ``split_loader`` reads and sets of one rank's loader: its data-parallel rank,
    world and schedule (the group's ranks share the ``WindowLoader``'s position)."""

    def __init__(self, group: WindowLoader, schedule: BatchSchedule):
        self.group, self.schedule = group, schedule
        self.dp_rank, self.dp_world = 0, schedule.dp_world

    def reshard(self, dp_rank: int, schedule: BatchSchedule):
        self.dp_rank, self.dp_world, self.schedule = dp_rank, schedule.dp_world, schedule
        self.group.reshards += 1
        self.group._slices = {}


class WindowLoader:
    """A group's loader reduced to the split: its position and step (as
    ``ParallelDataLoader``'s), and the spans each of its ranks reads in a step."""

    def __init__(self, schedule: BatchSchedule, group_world: int):
        self.ranks = [RankLoader(self, schedule) for _ in range(group_world)]
        self.position, self.step = Position(), 0
        self.reshards = 0
        self._slices: dict[int, np.ndarray] = {}  # global batch -> the ranks' [lo, hi)

    def seek(self, position: Position):
        self.position = position.copy()

    def set_step(self, step: int):
        self.step = step

    def next_step(self) -> np.ndarray:
        """Every rank's ``[lo, hi)`` of the step's global windows (``rank_slice`` of its
        own schedule, as the loader's ``plan_steps`` takes them)."""
        first = self.ranks[0].schedule
        size = first.global_batch(self.step)
        slices = self._slices.get(size)
        if slices is None:
            slices = np.array([r.schedule.rank_slice(size, r.dp_rank) for r in self.ranks])
            self._slices[size] = slices
        spans = slices + self.position.windows
        self.position, self.step = Position(self.position.windows + size), self.step + 1
        return spans


@dataclass
class Group:
    gid: int
    loader: WindowLoader
    attempt: StepTry
    alive: bool = True
    back_at: int = -1  # the step it starts again at, while dead
    spans: np.ndarray | None = None


@dataclass
class Report:
    groups: int
    ranks: int
    steps: int
    committed: int = 0
    uncommitted: int = 0
    deaths: int = 0
    deaths_in_a_step_most: int = 0
    joins: int = 0
    heals: int = 0
    heals_with_death: int = 0  # a heal's step in which a group died (not committed)
    joins_while_healing: int = 0  # quorums with more than one group healing
    participants_min: int = 0
    participants_max: int = 0
    reshards: int = 0  # split_loader calls that changed a rank's split
    split_s: list = field(default_factory=list)  # per rank's split_loader (sampled steps)
    rewind_s: list = field(default_factory=list)  # per StepTry.settle(False)
    check_s: float = 0.0
    seconds: float = 0.0

    def summary(self) -> dict:
        us = lambda xs: float(np.median(xs) * 1e6) if xs else 0.0  # noqa: E731
        return {k: v for k, v in self.__dict__.items() if k not in ("split_s", "rewind_s")} | {
            "split_us_median": us(self.split_s), "rewind_us_median": us(self.rewind_s),
            "split_calls": len(self.split_s), "rewinds": len(self.rewind_s),
        }  # fmt: skip


def check_step(step: int, start: int, size: int, spans: list[np.ndarray]):
    """The committed step's spans, in quorum order, tile ``[start, start + size)``."""
    s = np.concatenate(spans)
    lo, hi = s[:, 0], s[:, 1]
    if lo[0] != start or hi[-1] != start + size or np.any(lo[1:] != hi[:-1]) or np.any(hi < lo):
        bad = np.flatnonzero(lo[1:] != hi[:-1])
        raise AssertionError(
            f"step {step}: spans do not tile [{start}, {start + size}) "
            f"(first {lo[0]}, last {hi[-1]}, first break after span {bad[:1].tolist()})"
        )


def simulate(groups: int, ranks: int, steps: int, *, seed: int = 0, batch_per_rank: int = 4,
             schedule: list | None = None, death_rate: float = 1e-4, burst_rate: float = 2e-3,
             vote_fail_rate: float = 1e-3, back_after: tuple = (20, 300)) -> Report:  # fmt: skip
    """``steps`` committed steps of ``groups`` x ``ranks``; raises AssertionError naming
    the first committed step whose windows are not the uninterrupted run's. Each group
    dies with ``death_rate`` a step; with ``burst_rate`` a step several (2-8) die at
    once; a dead group starts again after ``back_after`` steps (uniform)."""
    quiet = logging.getLogger("torchtitan.data.schedule")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # an uneven split's warning, at every participant change
    try:
        return _simulate(groups, ranks, steps, seed, batch_per_rank, schedule, death_rate,
                         burst_rate, vote_fail_rate, back_after)  # fmt: skip
    finally:
        quiet.setLevel(level)


def _simulate(groups, ranks, steps, seed, batch_per_rank, schedule, death_rate, burst_rate,
              vote_fail_rate, back_after) -> Report:  # fmt: skip
    rng = np.random.default_rng(seed)
    begin = time.perf_counter()
    # A global batch that rarely splits evenly: uneven slices are where off-by-ones live.
    points = schedule or [(0, batch_per_rank * ranks * groups + 3),
                          (steps // 2, batch_per_rank * ranks * groups + 7 * ranks + 1)]  # fmt: skip
    base = BatchSchedule(points, batch_per_rank, ranks)
    report = Report(groups, ranks, steps)
    fleet = []
    for gid in range(groups):
        loader = WindowLoader(base, ranks)
        fleet.append(Group(gid, loader, StepTry(loader)))
    done, start, tries = 0, 0, 0  # committed steps, where the next one begins
    report.participants_min = groups
    while done < steps:
        tries += 1
        if tries > steps * 3:
            raise AssertionError("the simulated job makes no progress")
        for g in fleet:  # restarts: fresh, healed at this quorum
            if not g.alive and g.back_at <= done:
                g.alive, g.loader, report.joins = True, WindowLoader(base, ranks), report.joins + 1
                g.attempt = StepTry(g.loader)
        dying = set(np.flatnonzero(rng.random(groups) < death_rate).tolist())
        if rng.random() < burst_rate:
            dying |= set(rng.choice(groups, size=int(rng.integers(2, 9)), replace=False).tolist())
        alive = [g for g in fleet if g.alive]
        # when a death lands: before the quorum (0), during the step (1), after the commit (2)
        moment = {gid: int(rng.integers(0, 3)) for gid in dying}
        before = [g for g in alive if moment.get(g.gid) == 0]
        participants = [g for g in alive if moment.get(g.gid) != 0]
        for g in before:
            _die(g, done, rng, back_after, report)
        if not participants:
            continue
        report.participants_min = min(report.participants_min, len(participants))
        report.participants_max = max(report.participants_max, len(participants))
        # the quorum: heal those behind from the first participant at the highest step
        top = max(g.loader.step for g in participants)
        source = next(g for g in participants if g.loader.step == top)
        behind = [g for g in participants if g.loader.step < top]
        for g in behind:  # the heal's contents: the loader's position and step
            g.loader.seek(source.loader.position)
            g.loader.set_step(source.loader.step)
        report.heals += len(behind)
        report.joins_while_healing += len(behind) > 1
        n = len(participants)
        timed = rng.random() < 0.01  # the cost, sampled on 1% of the steps
        for i, g in enumerate(participants):
            t0 = time.perf_counter()
            for r, rank in enumerate(g.loader.ranks):  # each rank's own split_loader
                split_loader(rank, i, n, r, ranks)
            if timed:
                report.split_s.append((time.perf_counter() - t0) / ranks)
            g.attempt.begin()
            g.spans = g.loader.next_step()
        died_during = [g for g in participants if moment.get(g.gid) == 1]
        committed = not died_during and rng.random() >= vote_fail_rate
        report.heals_with_death += bool(behind) and bool(died_during)
        for g in participants:
            if committed:
                g.attempt.settle(True)
            elif moment.get(g.gid) != 1:  # a survivor of the step rewinds
                t0 = time.perf_counter()
                g.attempt.settle(False)
                report.rewind_s.append(time.perf_counter() - t0)
        if committed:
            size = base.global_batch(done)
            t0 = time.perf_counter()
            check_step(done + 1, start, size, [g.spans for g in participants])
            report.check_s += time.perf_counter() - t0
            done, start = done + 1, start + size
            report.committed += 1
        else:
            report.uncommitted += 1
        for g in died_during + [g for g in participants if moment.get(g.gid) == 2]:
            _die(g, done, rng, back_after, report)
        report.deaths_in_a_step_most = max(report.deaths_in_a_step_most, len(dying))
    report.seconds = time.perf_counter() - begin
    report.reshards = sum(g.loader.reshards for g in fleet)  # (the groups' last lives)
    return report


def _die(g: Group, done: int, rng, back_after: tuple, report: Report):
    if g.alive:
        g.alive, g.back_at = False, done + int(rng.integers(*back_after))
        report.deaths += 1
