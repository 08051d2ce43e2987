"""A simulated source: units and token counts with no data behind them.

Owns ``SimulatedSource`` (files of equal row counts, cut into units as a streaming
source cuts them) and ``SimulatedCounts`` (counts computed from a unit's range, kept as
``index.SourceCounts`` keeps them), so the global order (order.py) can be walked at any
scale: the order's unit tests, and its memory at 10^9 documents
(``scripts/benchmarks/bench_order.py``), go through the data package's own ``SourceOrder``.

Never: read a file, or stand in for a source in training.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np

from torchtitan.data.index import KEEP_UNITS, UnitCounts
from torchtitan.data.spec import Units, rows_per_unit


class SimulatedSource:
    """``files`` files of ``rows`` documents each, cut by ``spec.rows_per_unit``.
    ``read`` does not exist: nothing is read."""

    def __init__(self, files: int, rows: int, name: str = "sim"):
        self.spec = SimpleNamespace(name=name, weight=1.0, identity=lambda: f"name:{name}")
        self.files, self.rows, self.per_unit = files, rows, rows_per_unit(rows)

    def extent(self) -> int:
        return self.files

    def units(self, extent: int | None = None) -> Units:
        count = self.files if extent is None else extent
        parts = -(-self.rows // self.per_unit)
        return Units(np.arange(count), np.zeros(count), np.full(count, self.rows),
                     np.full(count, parts))  # fmt: skip


class SimulatedCounts:
    """Token counts from a unit's range: lengths 1-7 times ``scale``, an empty (skipped)
    document now and then. ``measured`` counts the units asked for the first time."""

    def __init__(self, scale: int = 1):
        self._mem: OrderedDict[tuple, UnitCounts] = OrderedDict()
        self.measured, self.scale = 0, scale

    def counts(self, unit, ahead=(), upto: int | None = None) -> UnitCounts:
        """The whole unit's, whatever ``upto`` asks (nothing to measure)."""
        unit = tuple(int(x) for x in unit)
        hit = self._mem.get(unit)
        if hit is None:
            f, lo, hi = unit
            rows = np.arange(lo, hi, dtype=np.int64)
            lengths = ((rows * 5 + f * 3) % 8 * self.scale).astype(np.int32)
            hit = self._mem[unit] = UnitCounts(lengths, rows)
            self.measured += 1
            while len(self._mem) > KEEP_UNITS:
                self._mem.popitem(last=False)
        return hit

    def path(self, unit) -> str:
        return f"simulated/{unit}"
