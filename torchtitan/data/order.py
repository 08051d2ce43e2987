"""The global order: one endless token stream per source, and which source each window reads.

Owns: a source's stream (``SourceOrder``): epoch after epoch, its units in a seeded
order per epoch (a permutation of documents, or of a streaming source's blocks), each
unit's rows in order, each row's tokens; finding the document and token at any offset
of it (a binary search over the length index, never a replay); and the choice of the
source of every global window (``MixSchedule``), a function of the window's index alone.

The order is global: it depends on the corpus, the seed and the weights, never on the
ranks, workers, batch size or sequence length. Every document of a source is read once
per pass, and a pass begins only when the one before it has been read whole, so no
document repeats before its source has been read through. A position in it is a few
integers (the windows taken, a token offset per source), which every rank shares.

Never: read or tokenize documents (windows.py), or know about ranks and batches.
"""

from __future__ import annotations

import numpy as np

from torchtitan.data.index import SourceIndex
from torchtitan.data.spec import DataError, epoch_order


class SourceOrder:
    """The token stream of one source over its length index."""

    EPOCHS_KEPT = 2  # epochs whose prefix sums are kept (a window may span two)

    def __init__(self, index: SourceIndex, name: str, seed: int, identity: str, shuffle: bool):
        self.index = index
        self.name = name
        self.seed, self.identity, self.shuffle = seed, identity, shuffle
        self.unit_tokens, self.unit_skipped = index.unit_totals()
        self.epoch_tokens = int(self.unit_tokens.sum())
        self.epoch_skipped = int(self.unit_skipped.sum())
        if self.epoch_tokens == 0:
            raise DataError(
                f"dataset {name!r} has no usable document (all {len(index.lengths)} are empty, "
                "null or undecodable); point it at data"
            )
        self._epochs: dict[int, tuple] = {}
        self._unit_cum: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The units of ``epoch`` in reading order."""
        return epoch_order(self.index.units, self.seed, self.identity, epoch, self.shuffle)

    def units_of(self, epoch: int) -> np.ndarray:
        """The units of ``epoch`` in reading order, kept with the epoch's prefix sums."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(unit order, tokens before each unit, skipped documents before each unit) of
        ``epoch``. Cost: O(units), once per epoch per process."""
        if epoch not in self._epochs:
            if len(self._epochs) >= self.EPOCHS_KEPT:
                self._epochs.pop(min(self._epochs))
            order = self.order(epoch)
            tokens = np.concatenate([[0], np.cumsum(self.unit_tokens[order])])
            skipped = np.concatenate([[0], np.cumsum(self.unit_skipped[order])])
            self._epochs[epoch] = (order, tokens, skipped)
        return self._epochs[epoch]

    def _row_cum(self, unit: int) -> np.ndarray:
        """Tokens up to and including each row of ``unit`` (the last unit's is kept)."""
        if self._unit_cum is None or self._unit_cum[0] != unit:
            lo, hi = self.index.rows(unit)
            self._unit_cum = (unit, np.cumsum(self.index.lengths[lo:hi], dtype=np.int64))
        return self._unit_cum[1]

    def locate(self, offset: int) -> tuple[int, int, int, int, int]:
        """``(epoch, k, unit, row, token)`` of the token at ``offset``: the ``k``-th unit of
        the epoch's order, its document ``row`` (in index order) and the token in it.
        Documents of no tokens (skipped ones) are never located. Cost: O(log units +
        rows of the unit)."""
        epoch, r = divmod(int(offset), self.epoch_tokens)
        order, before, _ = self._epoch(epoch)
        k = int(np.searchsorted(before, r, side="right")) - 1
        unit = int(order[k])
        within = r - int(before[k])
        cum = self._row_cum(unit)
        j = int(np.searchsorted(cum, within, side="right"))
        token = within - (int(cum[j - 1]) if j else 0)
        return epoch, k, unit, self.index.rows(unit)[0] + j, token

    def skipped_before(self, offset: int) -> int:
        """Documents skipped (no tokens) before ``offset`` since the stream's start."""
        epoch, r = divmod(int(offset), self.epoch_tokens)
        order, before, skipped = self._epoch(epoch)
        k = int(np.searchsorted(before, r, side="right")) - 1
        unit = int(order[k])
        lo, _ = self.index.rows(unit)
        j = int(np.searchsorted(self._row_cum(unit), r - int(before[k]), side="right"))
        in_unit = int((self.index.lengths[lo : lo + j] == 0).sum())
        return epoch * self.epoch_skipped + int(skipped[k]) + in_unit

    def epoch_of(self, offset: int) -> int:
        return int(offset) // self.epoch_tokens


# A Weyl sequence u_g = frac(g * alpha + beta) in 64-bit fixed point: alpha = 1/phi,
# whose multiples spread most evenly (the discrepancy of n draws is O(log n / n)).
_ALPHA = np.uint64(0x9E3779B97F4A7C15)


class MixSchedule:
    """The source of global window ``g``: the interval of cumulative weights that
    ``frac(g / phi + seed)`` falls in.

    A pure function of ``g``, so any rank finds the source of any window without
    knowing the others, and a resume on any layout continues it. Every source's share
    of any ``n`` consecutive windows is within O(log n) windows of its weight: after
    10,000 windows, well inside 1 %."""

    def __init__(self, weights: list[float], seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if (w <= 0).any() or not np.isfinite(w).all():
            raise DataError(f"source weights must be positive, got {list(weights)}")
        cumulative = np.cumsum(w / w.sum())
        # Bounds in the same fixed point as the draws: the choice is exact integer math.
        self.bounds = (cumulative * 2.0**53).astype(np.uint64) << np.uint64(11)
        self.bounds[-1] = np.uint64(2**64 - 1)
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
        return np.minimum(chosen, self.count - 1).astype(np.int64)
