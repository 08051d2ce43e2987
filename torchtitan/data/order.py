"""The global order: one endless token stream per source, and which source each window reads.

Owns: a source's stream (``SourceOrder``) and its position (``Cursor``), and the choice
of the source of every global window (``MixSchedule``), a function of the window's
index and the weights of the step that takes it (``MixByStep``: the weights by step).

A source's stream, pass after pass: the units of the pass (cut from the files, or rows,
the source held when the pass began) in a seeded order per pass, read by ``LANES``
*lanes* at once. Each lane reads one unit at a time, row after row; a lane that finishes
its unit takes the next unit of the order. Consecutive windows of the source go round
the lanes, one window each, so ``LANES`` consecutive windows come from as many units
(files, where a corpus has many): a step of a corpus written a file per domain mixes
its domains. A window that ends a lane's unit goes on in the lane's next unit, or, when
the pass has no unit left, in the next live lane; the next pass begins when every lane
has finished, so every token is read once per pass and nothing repeats before the pass
is read whole.

The order is global: a function of the corpus, the seed and the weights, never of the
ranks, workers, batch size or sequence length (a window is ``seq_len + 1`` tokens taken
where the previous one of its lane ended). The cursor is a few integers per lane: a
resume on any layout is a seek to it, never a replay. Walking it needs the token count
of each unit a lane takes, and only those (index.py measures them just in time): a
corpus's first step waits for the units its windows lie in.

Cost per process: the order of the pass being read (4 bytes a unit, 8 kept for two
passes; c4's ~1.4 M units: 11 MB; 10^9 documents, ~3.9 M units: 31 MB, and about 150 MB
while a pass's order is made), the units computed from the blocks (O(blocks)), and the
counts of the units the lanes read (index.KEEP_UNITS at most). Walking costs O(1) per
window plus O(log rows) per unit.

Never: read or tokenize documents (windows.py), or know about ranks and batches.
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field

import numpy as np

from torchtitan.data.spec import DataError

LANES = 32  # units a source's stream reads at once (the mix of a step)
LOOKAHEAD = LANES  # units ahead a process measures while it waits on another's
MAX_FINISHED = 4096  # finished units a walk records for the stream (a step finishes few)


@dataclass
class Cursor:
    """Where one source's stream stands. ``lanes`` holds ``[slot, k, token]`` per live
    lane: the lane's slot (0 .. LANES - 1), the index in the pass order of its unit and
    the tokens of it already read; empty before a pass begins. ``extent`` is what of the
    source the pass reads (files, or rows: ``Source.extent``; -1 before it begins).
    ``tokens`` and ``skipped`` are running totals of the stream (tokens read; documents
    skipped in finished units), for the metrics."""

    pass_: int = 0
    extent: int = -1
    taken: int = 0  # units of the pass order taken by lanes
    turn: int = 0  # the slot the next window starts at (or the first live one after it)
    lanes: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    skipped: int = 0

    def copy(self) -> Cursor:
        return Cursor(self.pass_, self.extent, self.taken, self.turn,
                      [list(lane) for lane in self.lanes], self.tokens, self.skipped)  # fmt: skip

    def to_list(self) -> list[int]:
        flat = [x for lane in self.lanes for x in lane]
        return [self.pass_, self.extent, self.taken, self.turn, self.tokens, self.skipped, *flat]

    @staticmethod
    def from_list(values: list[int]) -> Cursor:
        v = [int(x) for x in values]
        lanes = [v[i : i + 3] for i in range(6, len(v), 3)]
        return Cursor(v[0], v[1], v[2], v[3], lanes, v[4], v[5])


class SourceOrder:
    """The token stream of one source: its units in pass order, read by lanes."""

    def __init__(self, source, counts, seed: int, identity: str, shuffle: bool,
                 lanes: int = LANES):  # fmt: skip
        self.source, self.counts = source, counts
        self.name = source.spec.name
        # Unshuffled, the stream is the units as they lie, read one after another.
        self.seed, self.identity, self.shuffle = seed, identity, shuffle
        self.lanes = lanes if shuffle else 1
        self._units: tuple[int, list] | None = None  # (extent, units) of the last pass
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        # Units whose lane read their last token in the fills since the owner took them
        # (``take_finished``): what the stream lets go once their step is read.
        self.finished: list = []

    def units(self, extent: int) -> list:
        """The units a pass over ``extent`` reads (those of the last extent asked, kept)."""
        if self._units is None or self._units[0] != extent:
            self._units = (extent, self.source.units(extent))
        return self._units[1]

    def order(self, pass_: int, extent: int) -> np.ndarray:
        """The units (indices into ``units(extent)``) of a pass over ``extent``, in reading
        order (``pass_order``; the last two passes' kept)."""
        key = (pass_, extent)
        if key not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            files = self.units(extent).files()
            self._orders[key] = pass_order(files, self.seed, self.identity, pass_, self.shuffle)
        return self._orders[key]

    def unit(self, cursor: Cursor, k: int) -> tuple[int, tuple]:
        """(index, unit) of the ``k``-th unit of the cursor's pass."""
        units = self.units(cursor.extent)
        u = int(self.order(cursor.pass_, cursor.extent)[k])
        return u, units[u]

    def unit_counts(self, cursor: Cursor, k: int, upto: int | None = None):
        """The counts of the ``k``-th unit of the cursor's pass, whole or (``upto``) at least
        up to its token ``upto`` (measured now if no one has; while another process
        measures it, this one measures the units after it)."""
        units = self.units(cursor.extent)
        order = self.order(cursor.pass_, cursor.extent)

        def ahead() -> list:
            return [units[u] for u in order[k + 1 : k + 1 + LOOKAHEAD]]

        return self.counts.counts(units[order[k]], ahead, upto)

    def _begin(self, cursor: Cursor):
        cursor.extent = self.source.extent()
        count = len(self.units(cursor.extent))
        if count == 0:
            raise DataError(f"dataset {self.name!r} has no documents; point it at data")
        lanes = min(self.lanes, count)
        cursor.lanes = [[slot, slot, 0] for slot in range(lanes)]
        cursor.taken, cursor.turn = lanes, 0

    def fill(self, cursor: Cursor, need: int) -> list[tuple]:
        """Take the next window of ``need`` tokens, moving ``cursor``: its pieces
        ``(pass, k, u, start, end, unit)``, tokens ``[start, end)`` of ``unit``, the
        ``u``-th of the pass's units and the ``k``-th of its order. Cost: O(pieces), plus the counts
        of any unit a lane takes."""
        pieces, fresh, took = [], False, 0
        if not cursor.lanes:
            self._begin(cursor)
            fresh = True
        i = next((j for j, lane in enumerate(cursor.lanes) if lane[0] >= cursor.turn), 0)
        start_slot = cursor.lanes[i][0]
        while need:
            lane = cursor.lanes[i]
            _, k, token = lane
            # Counts up to a token past the window's end: a unit measured in pieces ends
            # here only if it has no token more (index.SourceCounts), as a whole one would.
            counts = self.unit_counts(cursor, k, token + need + 1)
            take = min(need, counts.total - token)
            if take > 0:
                u, unit = self.unit(cursor, k)
                pieces.append((cursor.pass_, k, u, token, token + take, unit))
                lane[2] += take
                need -= take
                took += take
                cursor.tokens += take
            if lane[2] < counts.total:  # counts in part hold a token past it (asked above)
                continue
            if len(self.finished) < MAX_FINISHED:  # a walk without a stream taking them
                self.finished.append(self.unit(cursor, k)[1])
            cursor.skipped += counts.skipped
            if cursor.taken < len(self.units(cursor.extent)):
                lane[1:] = [cursor.taken, 0]  # the lane takes the next unit of the order
                cursor.taken += 1
                continue
            del cursor.lanes[i]  # the pass has no unit left for it
            if cursor.lanes:
                i %= len(cursor.lanes)
                continue
            if fresh and not took:
                raise DataError(
                    f"dataset {self.name!r} has no usable document (every one is empty, null "
                    "or undecodable); point it at data"
                )
            cursor.pass_ += 1
            cursor.extent = -1
            if need:
                self._begin(cursor)
                fresh, took, i = True, 0, 0
        live = [lane[0] for lane in cursor.lanes]
        cursor.turn = min((s for s in live if s > start_slot), default=0)
        return pieces

    def take_finished(self) -> list:
        """The units whose lanes finished them since the last call."""
        out, self.finished = self.finished, []
        return out

    def pass_tokens(self, extent: int | None = None) -> int:
        """Tokens of one pass over ``extent`` (all the source holds now, by default). Cost:
        every unit's counts, measured where missing: O(corpus) on a corpus's first start,
        so for tools and tests, never the training path."""
        units = self.units(self.source.extent() if extent is None else extent)
        # No lane reads these units now: their measured tokens are not kept for one.
        keeping = getattr(self.counts, "share_tokens", False)
        if keeping:
            self.counts.share_tokens = False
        try:
            return sum(self.counts.counts(unit).total for unit in units)
        finally:
            if keeping:
                self.counts.share_tokens = True

    def pass_read(self, cursor: Cursor) -> float:
        """The share of the cursor's pass read, by units (a unit a lane is in counts its
        share of tokens read; while only its first pieces are measured, the share of its
        rows, or bytes, before the lane's document): 0 before the pass begins. For the
        metrics. Cost: O(lanes), over counts the lanes have (measured already)."""
        if not cursor.lanes:
            return 0.0
        done = cursor.taken - len(cursor.lanes)
        for _, k, token in cursor.lanes:
            if not token:
                continue
            counts = self.unit_counts(cursor, k, token)
            if counts.complete:
                done += token / counts.total
                continue
            _, lo, hi = self.unit(cursor, k)[1]
            row, _ = counts.row_at(token)
            at = int(counts.ats[row]) if row < len(counts.ats) else counts.next_at
            done += min(max((at - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 0.0
        return done / len(self.units(cursor.extent))

    def skipped_before(self, cursor: Cursor) -> int:
        """Documents skipped (no tokens) before ``cursor`` since the stream's start."""
        partial = 0
        for _, k, token in cursor.lanes:
            if token == 0:  # a lane not begun on its unit: nothing passed (and nothing
                continue  # to measure here: its counts may not exist yet)
            counts = self.unit_counts(cursor, k, token)
            j = int(np.searchsorted(counts.cum, token, side="right"))
            partial += int((counts.lengths[:j] == 0).sum())
        return cursor.skipped + partial


def pass_order(files: np.ndarray, seed: int, identity: str, pass_: int,
               shuffle: bool) -> np.ndarray:  # fmt: skip
    """A pass's units in reading order, given each unit's file: the files in a seeded
    order, each file's units in a seeded order, and the units dealt round the files (the
    first unit of every file, then the second, ...). Consecutive units, which the lanes
    read at once, so come from distinct files while files last: a step mixes as many
    files as it has lanes. Without ``shuffle``, the units as they lie. Cost: O(units log
    units), once per pass and process."""
    count = len(files)
    if not shuffle:
        return np.arange(count, dtype=np.int32)
    # zlib.crc32 rather than hash(): str hashes are salted per process.
    rng = np.random.default_rng([seed, zlib.crc32(identity.encode()), pass_])
    file_rank = rng.permutation(int(files.max()) + 1 if count else 0).astype(np.int32)[files]
    # Grouped by file (in the files' order), each file's units in a random order.
    by_file = np.lexsort((rng.random(count, dtype=np.float32), file_rank)).astype(np.int32)
    ranked = file_rank[by_file]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]]).astype(np.int32)
    del ranked
    round_of = np.empty(count, dtype=np.int32)
    round_of[by_file] = np.arange(count, dtype=np.int32) - np.repeat(
        starts, np.diff(np.r_[starts, count]).astype(np.int64)
    )
    del by_file, starts
    return np.lexsort((file_rank, round_of)).astype(np.int32)


# A Weyl sequence u_g = frac(g * alpha + beta) in 64-bit fixed point: alpha = 1/phi,
# whose multiples spread most evenly (the discrepancy of n draws is O(log n / n)).
_ALPHA = np.uint64(0x9E3779B97F4A7C15)


class MixSchedule:
    """The source of global window ``g``: the interval of cumulative weights that
    ``frac(g / phi + seed)`` falls in.

    A pure function of ``g``, so any rank finds the source of any window without
    knowing the others, and a resume on any layout continues it. Every source's share
    of any ``n`` consecutive windows is within O(log n) windows of its weight: after
    10,000 windows, well inside 1 %. A source of weight 0 (retired) has an empty
    interval: no window goes to it."""

    def __init__(self, weights: list[float], seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or not np.isfinite(w).all() or not (w > 0).any():
            raise DataError(
                f"source weights must be >= 0, finite and not all 0, got {list(weights)}"
            )
        cumulative = np.cumsum(w / w.sum())
        # Bounds in the same fixed point as the draws: the choice is exact integer math.
        self.bounds = (cumulative * 2.0**53).astype(np.uint64) << np.uint64(11)
        # The last source of positive weight ends at the top (1.0 wraps to 0 in 64 bits):
        # sources of weight 0 after it keep an empty interval.
        self.last = int(np.flatnonzero(w > 0)[-1])
        self.bounds[self.last :] = np.uint64(2**64 - 1)
        self.beta = np.uint64((seed * 0x632BE59BD9B4E019 + 0x1B873593) % 2**64)
        self.count = len(w)

    def sources(self, first: int, count: int) -> np.ndarray:
        """Source index of windows ``first .. first + count - 1``. Cost: O(count)."""
        if self.count == 1:
            return np.zeros(count, dtype=np.int64)
        g = np.arange(first, first + count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = g * _ALPHA + self.beta  # wraps modulo 2**64, as intended
        chosen = np.searchsorted(self.bounds, u, side="right")
        return np.minimum(chosen, self.last).astype(np.int64)


class MixByStep:
    """The weights of every step, and the ``MixSchedule`` of a step's windows.

    ``base``: the sources' own weights (``training.datasets``), in effect before the
    first point. ``points``: ``(step, {name: weight}, ramp)`` in increasing steps; from
    ``step`` the weights move in a straight line from those in effect there to the
    point's (normalized; a source it does not name is at 0), reaching them at ``step +
    ramp`` (at once for ramp 0), and stay until the next point. A pure function of the
    step: the same on any layout, and a resume at any step continues it.

    The source of window ``g`` is ``MixSchedule(weights(s)).sources(g)`` for the step
    ``s`` that takes it: the draws ``frac(g / phi + seed)`` run on across the steps, so
    over any ``n`` windows of constant weights each source's share is within O(log n)
    windows of its weight, from any window on (right after a change, too).

    Cost: O(points) to build, O(log points + sources) per step; one ``MixSchedule``
    kept per distinct weights of the last steps (a ramp makes one a step)."""

    def __init__(self, names: list[str], base: list[float], points: list[tuple], seed: int):
        self.names, self.seed = list(names), seed
        self.base = tuple(float(w) for w in base)
        self.points = []  # (step, ramp, weights normalized, the weights before it)
        before = _normalized(self.base)
        for step, weights, ramp in points:
            unknown = sorted(set(weights) - set(self.names))
            if unknown:
                raise DataError(
                    f"training.mix_schedule at step {step} names {unknown}, which are not "
                    f"sources of this run (sources: {self.names}); name sources of "
                    "training.datasets"
                )
            w = _normalized(tuple(float(weights.get(n, 0.0)) for n in self.names))
            self.points.append((int(step), int(ramp), w, before))
            before = w
        self.steps = [p[0] for p in self.points]
        self._mixes: dict[tuple, MixSchedule] = {}

    def weights(self, step: int) -> tuple[float, ...]:
        """The weights of ``step`` (the step that follows ``step`` steps taken), one per
        source: the base weights as given before the first point, normalized after."""
        i = bisect.bisect_right(self.steps, step) - 1
        if i < 0:
            return self.base
        start, ramp, w, before = self.points[i]
        if ramp == 0 or step >= start + ramp:
            return w
        t = (step - start) / ramp
        return tuple(a + (b - a) * t for a, b in zip(before, w))

    def at(self, step: int) -> MixSchedule:
        """The mix of ``step``'s windows."""
        weights = self.weights(step)
        mix = self._mixes.get(weights)
        if mix is None:
            if len(self._mixes) >= 4:
                self._mixes.pop(next(iter(self._mixes)))
            mix = self._mixes[weights] = MixSchedule(list(weights), self.seed)
        return mix

    def changes(self) -> list[int]:
        """The steps at which the weights begin to change."""
        return list(self.steps)


def _normalized(weights: tuple[float, ...]) -> tuple[float, ...]:
    total = sum(weights)
    if not total > 0:
        raise DataError(f"source weights {list(weights)} are all 0; give one a weight > 0")
    return tuple(w / total for w in weights)
