"""The batch-size schedule: the global batch of every step and its split over the
data-parallel ranks and their micro-batches.

Owns: parsing ``training.batch_size_schedule`` (``parse_schedule``) and
``training.skip_steps`` (``parse_skip_steps``), the global batch at
a step, the micro-batches a rank accumulates, each rank's slice of a step's windows, and
the warning for a split that leaves one rank much busier than the mean
(``BatchSchedule``). A function of the step and the layout only: every rank computes
the same split without talking to the others.

Cost: O(schedule points) per step. Never: read data, choose windows (order.py) or hold
a position (loader.py).
"""

from __future__ import annotations

import logging

from torchtitan.data.spec import DataError

logger = logging.getLogger(__name__)

# Above this (busiest rank's sequences / the mean) an uneven split is said at the start.
IMBALANCE_WARNING = 1.15


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``"0:256,2000:512"`` -> [(0, 256), (2000, 512)]. Raises ValueError naming the part."""
    points = []
    for part in text.split(","):
        step, sep, size = part.strip().partition(":")
        if not sep or not step.strip().isdigit() or not size.strip().isdigit():
            raise ValueError(f"{part.strip()!r} is not step:sequences")
        points.append((int(step), int(size)))
    if points[0][0] != 0:
        raise ValueError("the first point must be at step 0")
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ValueError("steps must increase")
    if any(size < 1 for _, size in points):
        raise ValueError("every global batch must be at least 1 sequence")
    return points


def parse_skip_steps(text: str, first_index: int = 1) -> list[tuple[int, int]]:
    """``"101-300,451-460"`` (training steps, first-last, inclusive; a single step alone)
    -> [(101, 200), (451, 10)]: (first step, steps). ``first_index`` 0: window indices
    (``training.skip_windows``), which count from 0. Raises ValueError naming the part."""
    skips = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        last = last or first
        if not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"{part!r} is not first-last")
        a, b = int(first), int(last)
        if a < first_index or b < a:
            raise ValueError(f"{part!r}: they count from {first_index} and last >= first")
        skips.append((a, b - a + 1))
    return skips


class BatchSchedule:
    """The global batch of every step and its split over ranks and micro-batches."""

    def __init__(self, points: list[tuple[int, int]], micro: int, dp_world: int,
                 dp_rank: int = 0):  # fmt: skip
        self.points, self.micro, self.dp_world = points, micro, dp_world
        for _, size in points:
            if size < dp_world:
                raise DataError(
                    f"a global batch of {size} sequences cannot give each of {dp_world} "
                    "data-parallel ranks one; raise training.global_batch_size (or the "
                    f"schedule's entry) to at least {dp_world}"
                )
            if self.imbalance(size) > IMBALANCE_WARNING and dp_rank == 0:
                even = size // dp_world * dp_world
                logger.warning(
                    "a global batch of %d over %d data-parallel ranks gives %d or %d sequences a "
                    "rank: the busiest does %.2f x the mean each step; %d (or a multiple of %d) "
                    "splits evenly", size, dp_world, size // dp_world, -(-size // dp_world),
                    self.imbalance(size), max(even, dp_world), dp_world,
                )  # fmt: skip

    @classmethod
    def from_config(cls, training, dp_world: int, dp_rank: int = 0) -> BatchSchedule:
        t = training
        if t.batch_size_schedule:
            points = parse_schedule(t.batch_size_schedule)
        else:
            points = [(0, t.global_batch_size or t.batch_size * dp_world)]
        return cls(points, t.batch_size, dp_world, dp_rank)

    def imbalance(self, global_batch: int) -> float:
        """The busiest rank's sequences over the mean: ``ceil(G / R) / (G / R)``."""
        return -(-global_batch // self.dp_world) / (global_batch / self.dp_world)

    def global_batch(self, step: int) -> int:
        """Sequences of the step made after ``step`` completed steps."""
        return next(size for start, size in reversed(self.points) if start <= step)

    def accumulation(self, global_batch: int) -> int:
        """Micro-batches per rank in a step of ``global_batch``: the same on every rank (FSDP
        and DDP run collectives per micro-batch), as many as the ranks with the fewest
        windows need. A rank with one window more puts it in one of them, which then
        holds up to ``training.batch_size + 1`` (only when the split is uneven)."""
        return -(-(global_batch // self.dp_world) // self.micro)

    def largest_micro(self, global_batch: int) -> int:
        most = -(-global_batch // self.dp_world)
        return -(-most // self.accumulation(global_batch))

    def rank_slice(self, global_batch: int, rank: int) -> tuple[int, int]:
        """The windows ``[lo, hi)`` of a step that data-parallel ``rank`` reads."""
        base, extra = divmod(global_batch, self.dp_world)
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (rank < extra)

    def micro_sizes(self, windows: int, accumulation: int) -> list[int]:
        base, extra = divmod(windows, accumulation)
        return [base + (i < extra) for i in range(accumulation)]
