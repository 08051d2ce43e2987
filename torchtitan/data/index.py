"""The length index: every document's token count, per source, in the order of its units.

Owns: the units a source is shuffled by (a map-style document, or a streaming source's
block of rows, cut the same way for every layout), measuring a share of them (each
document tokenized as the window reader will tokenize it, ``[BOS] + text + [EOS]``, and
0 for a document the bad-data policy skips), putting the shares of all ranks together,
and the cache on disk that spares later starts the measuring.

The global order (order.py) needs these counts to seek: the window at token offset ``o``
of a source is found by a binary search over them, never by reading what comes before.
Their cost is paid once per corpus and tokenizer: O(documents / ranks) tokenization per
rank on the first start, then O(documents) integers read from the cache per start.

Never: choose an order, pack windows, or touch torch.distributed (train.py moves the
shares between ranks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from torchtitan.data.packing import document_tokens
from torchtitan.data.spec import DataError

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
# A streaming source is shuffled by units: whole files when it has at least this many,
# else blocks (row groups, record batches, byte ranges of JSON lines) cut to at least
# this many. A constant, so the units (and the order) never depend on the layout.
STREAM_UNITS = 64
CACHE_ENV = "TORCHTITAN_CACHE"


@dataclass
class SourceIndex:
    """Token counts of one source's documents, units concatenated in unit order.

    ``unit_rows`` holds the first row of each unit and the row count (``U + 1``
    values); None when every unit is one document (map-style). ``row_at`` holds, per
    row, where the streaming reader finds it (a row of its file, or a JSON line's byte
    offset); None for map-style. Memory: 4 bytes per document (+ 8 for streaming)."""

    lengths: np.ndarray
    unit_rows: np.ndarray | None = None
    row_at: np.ndarray | None = None

    @property
    def units(self) -> int:
        return len(self.lengths) if self.unit_rows is None else len(self.unit_rows) - 1

    def rows(self, unit: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of ``unit``."""
        if self.unit_rows is None:
            return unit, unit + 1
        return int(self.unit_rows[unit]), int(self.unit_rows[unit + 1])

    def unit_totals(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, skipped documents) of every unit. Cost: O(documents)."""
        if self.unit_rows is None:
            return self.lengths.astype(np.int64), (self.lengths == 0).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        zeros = np.concatenate([[0], np.cumsum(self.lengths == 0, dtype=np.int64)])
        return np.diff(starts[self.unit_rows]), np.diff(zeros[self.unit_rows])

    def arrays(self) -> dict[str, np.ndarray]:
        out = {"lengths": self.lengths}
        if self.unit_rows is not None:
            out["unit_rows"], out["row_at"] = self.unit_rows, self.row_at
        return out


def source_units(source) -> list:
    """The units of an opened source, in unit order: a map-style source's document
    indices, or a streaming source's ``(file, lo, hi)`` ranges."""
    if source.streaming:
        return source.units(STREAM_UNITS)
    return range(len(source))


def read_unit(source, unit) -> list[tuple[int, str, object]]:
    """``(at, doc_id, value)`` of every row of one unit, in order. Cost: the unit's blocks
    decoded (a map-style unit is one document)."""
    if not source.streaming:
        return [(int(unit), *source.document(int(unit)))]
    rows, at = [], unit[1]
    while at is not None:
        docs, at, _ = source.read(unit, at)
        rows += [(start, doc_id, value) for start, _, doc_id, value in docs]
    return rows


MAP_BATCH = 256  # map-style documents read per call while measuring


PROGRESS_EVERY_S = 30.0  # how often a rank that measures says how far it is


class Progress:
    """Says, at most every ``PROGRESS_EVERY_S`` seconds, how far one rank's measuring of
    a source is: units done of its share, tokens a second, and the time left at that rate.
    A corpus's first start may measure for hours; without it the log is silent."""

    def __init__(self, name: str, units: int, log: bool):
        self.name, self.units, self.log = name, units, log
        self.done = self.tokens = 0
        self.begin = self.last = time.monotonic()

    def advance(self, units: int, tokens: int):
        self.done, self.tokens = self.done + units, self.tokens + tokens
        now = time.monotonic()
        if not self.log or now - self.last < PROGRESS_EVERY_S or self.done >= self.units:
            return
        self.last = now
        rate = self.done / max(now - self.begin, 1e-9)
        logger.info(
            "measuring the length index of %s: %d of this rank's %d units, %.0f tokens/s, "
            "about %.0f s left (the first step waits for the slowest rank; later starts read "
            "the counts from the cache)",
            self.name, self.done, self.units, self.tokens / max(now - self.begin, 1e-9),
            (self.units - self.done) / max(rate, 1e-9),
        )  # fmt: skip


def measure(
    source, tokenizer, units: list[int], bad_data: str, log: bool = False
) -> dict[int, tuple]:
    """``unit -> (lengths, row_at)`` of the given units (indices into ``source_units``);
    with ``log``, progress on the way (``Progress``).

    Cost: every document of those units read and tokenized once."""
    all_units = source_units(source)
    progress = Progress(source.spec.name, len(units), log)
    out = {}
    if not source.streaming:
        for i in range(0, len(units), MAP_BATCH):
            chunk = units[i : i + MAP_BATCH]
            for u, (doc_id, value) in zip(chunk, source.documents(chunk)):
                out[u] = (np.array([_length(tokenizer, doc_id, value, source, bad_data)]), None)
            progress.advance(len(chunk), sum(int(out[u][0][0]) for u in chunk))
        return out
    for u in units:
        rows = read_unit(source, all_units[u])
        lengths = [_length(tokenizer, doc_id, value, source, bad_data) for _, doc_id, value in rows]
        out[u] = (np.array(lengths, dtype=np.int32), np.array([r[0] for r in rows], dtype=np.int64))
        progress.advance(1, sum(lengths))
    return out


def _length(tokenizer, doc_id, value, source, bad_data) -> int:
    tokens = document_tokens(tokenizer, doc_id, value, source.spec.name, bad_data)
    return 0 if tokens is None else len(tokens)


def assemble(source_unit_count: int, streaming: bool, measured: dict[int, tuple]) -> SourceIndex:
    """One source's index from the measured units of every share. Raises DataError if a
    unit is missing (a share lost on the way would otherwise shift every later count)."""
    missing = [u for u in range(source_unit_count) if u not in measured]
    if missing:
        raise DataError(f"no rank measured units {missing[:5]}: the length index is incomplete")
    parts = [measured[u] for u in range(source_unit_count)]
    lengths = (
        np.concatenate([p[0] for p in parts]).astype(np.int32) if parts else np.zeros(0, np.int32)
    )
    if not streaming:
        return SourceIndex(lengths)
    counts = [len(p[0]) for p in parts]
    unit_rows = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    row_at = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    return SourceIndex(lengths, unit_rows, row_at.astype(np.int64))


# ---- the cache ----------------------------------------------------------------------
def cache_dir(configured: str) -> str:
    """``training.length_index_dir``, else ``$TORCHTITAN_CACHE/length_index``, else
    ``~/.cache/torchtitan/length_index``."""
    if configured:
        return configured
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "torchtitan"
    )
    return os.path.join(root, "length_index")


def index_key(source_fingerprint: dict, tokenizer_sha256: str, training) -> str:
    """What a source's lengths depend on: its files' signatures, the tokenizer, the
    column read, streaming or not (the units), the bad-data policy, this format."""
    t = training
    what = [INDEX_VERSION, source_fingerprint["files"], source_fingerprint["identity"],
            tokenizer_sha256, t.text_field, t.id_field, t.streaming, t.bad_data, STREAM_UNITS]  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def load_cached(folder: str, key: str) -> SourceIndex | None:
    """The cached index of ``key``, or None. Cost: O(documents) bytes read."""
    path = os.path.join(folder, f"{key}.npz")
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as z:
            return SourceIndex(z["lengths"], z.get("unit_rows"), z.get("row_at"))
    except Exception as e:  # noqa: BLE001 - a damaged cache file is measured again
        logger.warning("length index %s is unreadable (%r): measuring again", path, e)
        return None


def save_cached(folder: str, key: str, index: SourceIndex):
    """Write atomically (a file of another pid's is never seen half-written)."""
    try:
        os.makedirs(folder, exist_ok=True)
        # A unique name: writers on other hosts sharing the folder never meet.
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".npz", dir=folder)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **index.arrays())
        os.replace(tmp, os.path.join(folder, f"{key}.npz"))
    except OSError as e:  # a read-only cache costs the next start a measuring, nothing else
        logger.warning("cannot write the length index to %s (%s)", folder, e)
