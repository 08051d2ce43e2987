"""Streaming sources: documents read straight from their files, a few blocks at a time.

Owns: cutting each file into *units*, the granules the global order shuffles and the
token counts are measured by (spec.py's ``rows_per_unit``: parquet row groups and
Arrow record batches cut into row ranges of at most ``UNIT_ROWS`` rows, and at least
``MIN_FILE_UNITS`` ranges a file; JSON lines cut into byte ranges of ``UNIT_BYTES`` in
the same way, a line belonging to the range its first byte lies in; a text file, or a
compressed JSON lines file, whole), and reading a unit's documents from a
position ``at``: a row of the unit's file (parquet, Arrow, text) or the byte offset of a
line (JSON lines). The token counts record each row's ``at``, so a read at any
position decodes at most the one block holding it.

A file's units depend on that file alone, so a file appended to a source adds units
after the others and changes none (a corpus may grow between runs). Cutting needs no
data read: block row counts come from the footers the data plan read once per job, a
JSON lines file's size from a stat.

Readers use pyarrow for parquet and Arrow IPC (``datasets.save_to_disk`` files) and
read bytes through ``fsspec`` when a path is a URL, so remote files need no copy.

Also owns fetching ahead (``BlockPrefetch``): the blocks of a remote source that the
loader says this process will decode next are fetched (and decoded) by a few threads
while the current step is read, and handed to the reader that asks for them, once: a
parquet row group (its column chunks), a text file, a JSON lines unit's byte range (one
ranged GET, and the line running past its end), an Arrow record batch (its file read
whole, once: the stream format has no index of its batches).

Never: tokenize, pack, or know about ranks and workers (windows.py does that), or decide
what comes next (the loader names the units; the prefetch only fetches them early). A row
group shared by the row-range units of a small corpus is decoded once per process
while any reader holds it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from torchtitan.data.index import counts_key
from torchtitan.data.order import LANES
from torchtitan.data.spec import (
    MIN_FILE_UNITS,
    BadText,
    DataError,
    SourceSpec,
    Units,
    check_column,
    is_remote,
    rows_per_unit,
    text_doc_id,
    token_arrays,
)

# A JSON lines unit is the lines that start in a byte range of this size (about the text
# of UNIT_ROWS web documents: a unit is measured in about a second).
UNIT_BYTES = 4 << 20
# And of at least this many bytes: a small file's ranges would mostly hold no line.
MIN_UNIT_BYTES = 4 << 10
# Decoded blocks a process keeps, per source, the last read. A lane reads one unit at a
# time and a unit lies in one block, so the lanes read at most LANES blocks at once; a
# row group cut into several units has them dealt round the files (order.pass_order), so
# in a corpus of up to LANES files its next unit comes while it is still kept and is not
# decoded again (in a corpus of many files they lie too far apart for any bound memory
# holds: each is decoded again, a few percent of tokenizing it). The bytes bound holds
# where row groups are large: LANES blocks of 2 MiB (512 rows of web text).
KEEP_BLOCKS = LANES
KEEP_BLOCK_BYTES = 64 << 20
# Bytes of JSON lines a cursor reads ahead at a time (whole lines, within its unit).
READ_BYTES = 1 << 20
# JSON lines units fetched ahead and being read, held by a reader (a source, a process):
# the lanes' units in turn, 4 MiB each at most (and a line past it).
KEEP_SPAN_BYTES = 64 << 20
# Bytes read from a JSON lines file to find the keys of its objects.
SAMPLE_BYTES = 1 << 20
# Bytes a fetch ahead of a JSON lines range asks for past the range's end, in the same
# GET, to finish the line running past it (a web document's line: a few KiB).
LINE_TAIL_BYTES = 16 << 10


# Compressed JSON lines are read whole (a unit is the file): a byte range of a compressed
# stream cannot be found without decompressing everything before it.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def _compressed(path: str) -> bool:
    return path.lower().endswith(_COMPRESSED)


# Bytes an object read through fsspec (a URL) fetches ahead of a read, and the most it
# keeps: s3fs's default would be 50 MiB ahead of every read ("readahead", one block), so a
# 1 MiB read of JSON lines fetched 51 MiB and a parquet row group its own bytes plus 50
# MiB (each decode opens the file anew). 4 MiB is a JSON lines unit (UNIT_BYTES): a
# unit's reads of READ_BYTES take one or two requests.
REMOTE_BLOCK_BYTES = 4 << 20


def _open_binary(path: str, ranged: bool = False):
    """A file's bytes, decompressed if its name says so; a URL through fsspec.

    The byte cache of an object, per open file: ``ranged`` (parquet: pyarrow asks for
    the exact ranges it decodes, the footer and then each column chunk of a row group in
    one read) none, each read one GET of just its bytes; otherwise one "readahead" block
    of at most ``REMOTE_BLOCK_BYTES`` past the read asked for (``READ_BYTES`` of JSON
    lines: at most 5 MiB held, per open stream, one open stream per reader), so
    sequential reads take one request per 4 MiB and nothing is fetched twice. Bound, per
    source and process, with the decoded blocks (``KEEP_BLOCKS``, ``KEEP_BLOCK_BYTES``):
    64 MiB of values plus 5 MiB of bytes. A local file is read as it is (no fsspec)."""
    if is_remote(path):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        raw = fs.open(inner, "rb", block_size=REMOTE_BLOCK_BYTES,
                      cache_type="none" if ranged else "readahead")  # fmt: skip
        compression = fsspec.utils.infer_compression(path)
        if compression is None:
            return raw
        return fsspec.compression.compr[compression](raw, mode="rb")
    if _compressed(path):
        import fsspec

        return fsspec.open(path, "rb", compression="infer").open()
    return open(path, "rb")


# Fetching ahead (BlockPrefetch), per source and process: threads that fetch and decode
# at once (each one GET stream of a row group's column chunks: a few requests in flight
# keep a link busy while the main thread tokenizes), and the blocks fetched ahead and not
# yet read, at most (in flight included), and their decoded bytes: a new fetch starts only
# below both. 64 blocks is two of each lane's next units, 4 steps of 8 windows ahead.
PREFETCH_THREADS = 4
PREFETCH_BLOCKS = 2 * LANES
PREFETCH_BYTES = 128 << 20


class BlockPrefetch:
    """The blocks of one remote source that this process will decode next (row groups,
    record batches, text files, JSON lines ranges: the reader's ``block_of`` names them,
    its ``fetch`` fetches one), fetched and decoded ahead by ``PREFETCH_THREADS``
    threads, each handed once to the read that asks for it (``take``) and dropped from
    here as it is (the source's own caches hold it from then on, as a block it decoded
    itself; a JSON lines reader its one range being read).

    The loader names the blocks (``want``: those of the units this process reads first in
    the steps it planned ahead, tagged with the step); blocks it already holds decoded are
    not asked. Nothing here changes what is read: a taken block is the one ``decode``
    would give, and a block asked but not yet fetched when its read comes is read there
    and never fetched again. What the steps read left untaken (a restart, a unit whose
    measured tokens served its read) is dropped once its step is read (``release``).

    Bounds, per source and process: ``PREFETCH_THREADS`` requests in flight;
    ``PREFETCH_BLOCKS`` blocks fetched and not taken; fetching stops while those hold
    ``PREFETCH_BYTES`` of decoded values (one block per thread more at most: 128 MiB +
    4 x a row group, ~140 MiB for web text in 2 MiB row groups; JSON lines ranges are
    held as bytes, 4 MiB each, so 128 + 16 MiB). An Arrow file read whole for one of
    its batches is held by the reader's own cache (``ArrowReader.KEEP_FILES``), with or
    without prefetch. The names waiting (``want``) are the loader's lookahead: O(prefetch steps x windows a step), a few hundred tuples.
    None of it grows with the corpus: the same at c4's 365 M documents (~1.4 M units) as at
    FineWeb's 15 T tokens; each rank fetches only the blocks of its own windows.
    """

    def __init__(self, source: StreamSource):
        self.source = source
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._wanted: OrderedDict[tuple[int, int], int] = OrderedDict()  # block -> step
        self._held: OrderedDict[tuple[int, int], tuple] = OrderedDict()  # block -> (future, step)
        # Counts, for tests and benchmarks: blocks fetched ahead, taken by a read, dropped;
        # the most held at once (in flight included), and the most fetches running at once.
        self.fetched = self.taken = self.dropped = 0
        self.peak_held = self.peak_in_flight = 0
        self._running = 0
        self._count_lock = threading.Lock()

    def __getstate__(self):  # a loader worker starts with its own threads and nothing asked
        return {**self.__dict__, "_pid": -1, "_pool": None, "_wanted": OrderedDict(),
                "_held": OrderedDict(), "_running": 0, "_count_lock": None}  # fmt: skip

    def __setstate__(self, state):
        self.__dict__.update(state, _count_lock=threading.Lock())

    def _executor(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():  # a forked loader worker fetches with its own threads
            self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="prefetch")
            self._pid = os.getpid()
            self._wanted.clear()
            self._held.clear()
        return self._pool

    def want(self, key: tuple, step: int):
        """Fetch the block ``key`` names ahead (``(file, block)``; for JSON lines
        ``(file, lo, hi)``, a unit's byte range): the read of ``step`` decodes it."""
        self._executor()
        if key not in self._wanted and key not in self._held:
            self._wanted[key] = step
        self._pump()

    def take(self, key: tuple):
        """The block fetched ahead (waiting for its fetch if in flight), or None: the caller
        decodes it, and it is no longer wanted (never fetched twice)."""
        self._wanted.pop(key, None)
        entry = self._held.pop(key, None) if self._pid == os.getpid() else None
        if entry is None:
            return None
        block, _ = entry[0].result()  # a fetch's error is the read's, raised here
        self.taken += 1
        self._pump()
        return block

    def release(self, step: int):
        """Drop what was wanted for steps up to ``step`` (read by now) and is not taken."""
        for key in [k for k, s in self._wanted.items() if s <= step]:
            del self._wanted[key]
        for key in [k for k, (_, s) in self._held.items() if s <= step]:
            future, _ = self._held.pop(key)
            future.cancel()
            self.dropped += 1
        self._pump()

    def clear(self):
        """Drop everything (the loader restarts from another position)."""
        self.release(1 << 62)

    def wait(self) -> int:
        """Wait for the fetches in flight (tests, benchmarks); the blocks held."""
        for future, _ in list(self._held.values()):
            if not future.cancelled():
                future.exception()
        return len(self._held)

    def _fetch(self, key: tuple) -> tuple[object, int]:
        with self._count_lock:
            self._running += 1
            self.peak_in_flight = max(self.peak_in_flight, self._running)
        try:
            return self.source._reader.fetch(self.source, key)
        finally:
            with self._count_lock:
                self._running -= 1

    def _pump(self):
        """Start fetches in the order wanted while the bounds allow."""
        while self._wanted and len(self._held) < PREFETCH_BLOCKS:
            held = sum(fut.result()[1] for fut, _ in self._held.values()
                       if fut.done() and not fut.cancelled() and fut.exception() is None)  # fmt: skip
            if held >= PREFETCH_BYTES:
                return
            key, step = self._wanted.popitem(last=False)
            self._held[key] = (self._pool.submit(self._fetch, key), step)
            self.fetched += 1
            self.peak_held = max(self.peak_held, len(self._held))


def _file_size(path: str) -> int:
    if is_remote(path):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        return int(fs.size(inner))
    return os.path.getsize(path)


def _remote_fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


class _Span:
    """The bytes of one JSON lines unit fetched ahead: ``data`` from byte ``start``."""

    __slots__ = ("key", "start", "data")

    def __init__(self, key: tuple, start: int, data: bytes):
        self.key, self.start, self.data = key, start, data


class _Block:
    """Decoded rows of one block (row group, record batch, file): ids and values."""

    __slots__ = ("ids", "values", "__weakref__")

    def __init__(self, ids: list | None, values):
        self.ids = ids
        self.values = values  # str (or BadText, None) per row, or int32 token arrays


def _doc_id(value) -> str:
    """Stable id for a document without an id column: a hash of its text or tokens."""
    if isinstance(value, np.ndarray):
        return hashlib.sha1(value.tobytes()).hexdigest()[:16]
    return text_doc_id(value)


class StreamSource:
    """A streaming source: its files as units, read in a seeded order per epoch.

    Nothing is loaded up front beyond what the unit list needs (parquet footers, Arrow
    record batch headers, file sizes). ``rows_decoded`` counts the rows (or JSON lines)
    this process decoded, for tests and benchmarks.
    """

    def __init__(
        self, spec: SourceSpec, text_field: str, id_field: str,
        block_rows: dict[int, list[int]] | None = None,
    ):  # fmt: skip
        self.spec = spec
        self.text_field = text_field
        self.id_field = spec.id_field or id_field  # a pretokenized source names its own
        # A pretokenized source (``spec.tokens_field``) yields token ids, not text.
        self.value_field = spec.tokens_field or text_field
        self._identity = spec.identity()
        self._reader = _READERS[spec.fmt](spec)
        self._starts: dict[int, tuple[int, ...]] = {}  # file -> first row of each block, total
        for f, counts in (block_rows or {}).items():  # from the data plan: no footer to read
            self._starts[f] = _starts_of(counts)
        self._units: dict[int, Units] = {}  # file -> its units
        self._decoded = weakref.WeakValueDictionary()  # (file, block) -> _Block held by a reader
        self._kept: OrderedDict[tuple[int, int], tuple] = OrderedDict()  # the last read
        self._kept_bytes = 0
        self.rows_decoded = 0
        # Remote blocks fetched ahead (row groups, record batches, text files, JSON lines
        # ranges); None where reads are local (a page cache does this already).
        remote = bool(spec.files) and is_remote(spec.files[0])
        self.prefetch = BlockPrefetch(self) if remote else None
        # From a data plan (``block_rows`` given): the column check was made once for the job.
        if block_rows is None:
            check_columns(spec, text_field)

    # ---- what the plan and the token counts ask of the source kind -------------------
    @staticmethod
    def fingerprint_fields() -> dict:
        """What the data fingerprint records of how this kind reads its sources."""
        return {"streaming": True}

    @staticmethod
    def inspect(spec: SourceSpec, path: str, text_field: str, first: bool) -> list[int] | None:
        """What the data plan keeps of one file: the rows of each of its blocks (None for
        JSON lines, whose units are byte ranges); the first file of a source is checked
        for the column read. Cost: one footer (or 1 MiB) read, and a schema for the first."""
        rows = inspect_file(spec, path)
        if first:
            check_columns(spec, text_field)
        return rows

    def count_keys(self, source_fingerprint: dict, tokenizer_sha256: str, training) -> list[str]:
        """The key of each file's token counts: a unit lies within one file, so a file's
        counts depend on that file alone (index.counts_key)."""
        files = len(self.spec.files)
        return [counts_key(source_fingerprint, files, [f], tokenizer_sha256, training,
                           self.value_field, "stream") for f in range(files)]  # fmt: skip

    def __getstate__(self):
        # Loader workers decode their own blocks; a weak cache does not pickle.
        return {**self.__dict__, "_decoded": None, "rows_decoded": 0, "_kept": OrderedDict(),
                "_kept_bytes": 0}  # fmt: skip

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._decoded = weakref.WeakValueDictionary()

    # ---- units ------------------------------------------------------------------------
    def extent(self) -> int:
        """What the source holds now, in the measure a pass is cut by: its files (a pass
        reads the files there were when it began; later ones join the next)."""
        return len(self.spec.files)

    def units(self, extent: int | None = None) -> Units:
        """The units ``(file, lo, hi)`` of the first ``extent`` files (all by default), in
        file order (``spec.Units``: O(blocks) integers): rows ``[lo, hi)`` of the file (bytes for JSON lines; ``hi = -1`` is
        the file's end). A pure function of those files, so it is the same on every start
        and does not change when files are appended. Cost: O(blocks) once per file and
        process (a stat per JSON lines file)."""
        count = len(self.spec.files) if extent is None else extent
        for f in range(count):
            if f not in self._units:
                self._units[f] = self._reader.file_units(self, f)
        return Units.join([self._units[f] for f in range(count)])

    def block_starts(self, f: int) -> tuple[int, ...]:
        """First row of each block of file ``f``, then its row count (cached per file)."""
        if f not in self._starts:
            self._starts[f] = _starts_of(self._reader.block_rows(self.spec.files[f]))
        return self._starts[f]

    # ---- reading ----------------------------------------------------------------------
    def read(self, unit: tuple[int, int, int], at: int):
        """``(docs, next_at, held)``: the documents of ``unit`` from position ``at`` on, as
        ``(at, next_at, doc_id, value)``, up to the end of one block (or ``READ_BYTES`` of
        JSON lines); where reading goes on after them (None: the unit is done); and the
        decoded block, which the caller holds while it reads the block's documents.

        Cost: one block decoded (none if another reader in this process holds it), never
        one before ``at``: a read at the end of a unit costs what one at its start does.
        """
        return self._reader.read(self, unit, at)

    def block(self, f: int, b: int) -> _Block:
        """Block ``b`` of file ``f``, decoded; shared while any reader holds it (the row
        ranges of one row group, read by several readers, decode it once)."""
        block = self._decoded.get((f, b))
        if block is None:
            block = self.prefetch.take((f, b)) if self.prefetch is not None else None
            if block is None:
                block = self._reader.decode(self, self.spec.files[f], b)
            self._decoded[(f, b)] = block
            self.rows_decoded += len(block.values)
        self._keep(f, b, block)
        return block

    def fetch_ahead(self, units: list, step: int):
        """The blocks ``units`` lie in, fetched ahead where this source does so (a remote
        one), unless this process holds them decoded: the read of ``step`` decodes them
        (``BlockPrefetch``). Cost: a bisect a unit."""
        if self.prefetch is None:
            return
        for unit in units:
            key = self._reader.block_of(self, unit)
            if key is not None:
                self.prefetch.want(key, step)

    def _keep(self, f: int, b: int, block: _Block):
        """Keep the blocks last read, ``KEEP_BLOCKS`` and ``KEEP_BLOCK_BYTES`` of their values
        at most: a block's
        units are taken by lanes one after the other, and decoding it again for each
        would cost a row group per unit."""
        kept = self._kept
        if (f, b) in kept:
            kept.move_to_end((f, b))
            return
        size = _block_bytes(block)
        kept[(f, b)] = (block, size)
        self._kept_bytes += size
        while (self._kept_bytes > KEEP_BLOCK_BYTES or len(kept) > KEEP_BLOCKS) and len(kept) > 1:
            _, (_, gone) = kept.popitem(last=False)
            self._kept_bytes -= gone

    def document(self, block: _Block, i: int) -> tuple[str, object]:
        value = block.values[i]
        doc_id = block.ids[i] if block.ids is not None else None
        return (str(doc_id) if doc_id is not None else _doc_id(value)), value


def _block_bytes(block: _Block) -> int:
    """About what a decoded block holds: its texts' characters (or token arrays' bytes)."""
    return sum(v.nbytes if isinstance(v, np.ndarray) else len(v) if isinstance(v, str) else 64
               for v in block.values) + 64 * len(block.values)  # fmt: skip


def _starts_of(counts: list[int]) -> tuple[int, ...]:
    return (0, *(int(x) for x in np.cumsum(counts, dtype=np.int64)))


def check_columns(spec: SourceSpec, text_field: str):
    """The source's first file has the column it is read from (JSON lines: if it names
    any). Cost: one schema or 1 MiB read."""
    columns = _READERS[spec.fmt](spec).columns(spec.files[0])
    if columns is not None:
        check_column(spec, spec.tokens_field or text_field, columns)


def inspect_file(spec: SourceSpec, path: str) -> list[int] | None:
    """The rows of each block of one file of a streaming source: the footer's row counts
    for parquet and Arrow (one block for a text file); None for JSON lines (its units are
    byte ranges). Cost: one footer read (none for JSON lines)."""
    reader = _READERS[spec.fmt](spec)
    if isinstance(reader, _RowReader):
        return [int(n) for n in reader.block_rows(path)]
    return None


class _RowReader:
    """Formats whose blocks' row counts are known without decoding (parquet, Arrow, text)."""

    def __init__(self, spec: SourceSpec):
        self.spec = spec

    def file_units(self, source: StreamSource, f: int) -> list[tuple[int, int, int]]:
        """File ``f``'s blocks, each cut into row ranges of at most ``rows_per_unit`` (of
        the file's rows) rows, of about equal size."""
        starts = source.block_starts(f)
        size = rows_per_unit(starts[-1])
        blocks = [(a, b) for a, b in zip(starts, starts[1:]) if b > a]
        return Units([f] * len(blocks), [a for a, _ in blocks], [b for _, b in blocks],
                     [-(-(b - a) // size) for a, b in blocks])  # fmt: skip

    def block_of(self, source: StreamSource, unit) -> tuple[int, int] | None:
        """The block ``(file, block)`` that ``unit`` lies in, or None where this process
        holds it decoded (nothing to fetch ahead)."""
        f, lo, _ = unit
        key = (f, bisect.bisect_right(source.block_starts(f), lo) - 1)
        return None if key in source._decoded else key

    def fetch(self, source: StreamSource, key: tuple[int, int]) -> tuple[_Block, int]:
        """Block ``key`` decoded (on a prefetch thread), and the bytes of its values."""
        f, b = key
        block = self.decode(source, source.spec.files[f], b)
        return block, _block_bytes(block)

    def read(self, source: StreamSource, unit, at: int):
        f, _, hi = unit
        starts = source.block_starts(f)
        end = starts[-1] if hi < 0 else min(hi, starts[-1])
        if at >= end:
            return [], None, None
        b = bisect.bisect_right(starts, at) - 1
        block = source.block(f, b)
        stop, base = min(end, starts[b + 1]), starts[b]
        docs = [(r, r + 1, *source.document(block, r - base)) for r in range(at, stop)]
        return docs, (stop if stop < end else None), block


class ParquetReader(_RowReader):
    """Parquet: a block is a row group, read with pyarrow (only the columns used)."""

    def columns(self, path: str) -> list[str]:
        import pyarrow.parquet as pq

        with _open_binary(path, ranged=True) as f:
            return list(pq.read_schema(f).names)

    def block_rows(self, path: str) -> list[int]:
        import pyarrow.parquet as pq

        with _open_binary(path, ranged=True) as f:
            meta = pq.ParquetFile(f).metadata
            return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def decode(self, source: StreamSource, path: str, b: int) -> _Block:
        import pyarrow.parquet as pq

        with _open_binary(path, ranged=True) as f:
            parquet = pq.ParquetFile(f)
            present = _present_columns(source, path, parquet.schema_arrow.names)
            table = parquet.read_row_group(b, columns=present)
        return _table_block(source, table)


class ArrowReader(_RowReader):
    """Arrow IPC files (``datasets.save_to_disk`` writes the stream format; the file
    format reads too): a block is a record batch, memory-mapped where the file is local."""

    KEEP_FILES = 8  # files whose (memory-mapped) batch list a process keeps

    def __init__(self, spec: SourceSpec):
        super().__init__(spec)
        self._batches: dict[str, list] = {}
        self._lock = threading.Lock()  # prefetch threads ask for batches too
        self._loading: dict[str, threading.Lock] = {}  # path -> held while it is read

    def __getstate__(self):  # a worker maps the files itself
        return {**self.__dict__, "_batches": {}, "_lock": None, "_loading": {}}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def batches(self, path: str) -> list:
        """The record batches of ``path``, read once while kept (``KEEP_FILES``), however
        many threads ask at once. A remote file is read whole, once (one stream of 4 MiB
        GETs): the stream format ``save_to_disk`` writes has no index of its batches, so
        a batch cannot be fetched alone; a prefetch thread asking for one of its batches
        fetches the file ahead."""
        with self._lock:
            if path in self._batches:
                return self._batches[path]
            loading = self._loading.setdefault(path, threading.Lock())
        with loading:  # a second thread asking waits for the first one's read
            with self._lock:
                if path in self._batches:
                    return self._batches[path]
            batches = _arrow_batches(path)
            with self._lock:
                if len(self._batches) >= self.KEEP_FILES:
                    self._batches.pop(next(iter(self._batches)))
                self._batches[path] = batches
                self._loading.pop(path, None)
        return batches

    def columns(self, path: str) -> list[str]:
        batches = self.batches(path)
        return list(batches[0].schema.names) if batches else []

    def block_rows(self, path: str) -> list[int]:
        return [batch.num_rows for batch in self.batches(path)]

    def decode(self, source: StreamSource, path: str, b: int) -> _Block:
        import pyarrow as pa

        batch = self.batches(path)[b]
        present = _present_columns(source, path, batch.schema.names)
        return _table_block(source, pa.Table.from_batches([batch]).select(present))


def _arrow_batches(path: str) -> list:
    import pyarrow as pa

    # On a memory map the batches are zero-copy: they only map the file's pages.
    with _open_binary(path) if is_remote(path) else pa.memory_map(path) as f:
        if f.read(6) == b"ARROW1":
            f.seek(0)
            reader = pa.ipc.open_file(f)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]
        f.seek(0)
        return list(pa.ipc.open_stream(f))


def _present_columns(source: StreamSource, path: str, names: list[str]) -> list[str]:
    """The value column and, where this file has it, the id column. The first file's
    columns were checked at open; a later file may differ, found here when it is read."""
    if source.value_field not in names:
        raise DataError(
            f"dataset {source.spec.where!r}: file {source.spec.relative_name(path)} has no "
            f"column {source.value_field!r} (columns: {names}); make every file hold it"
        )
    return [source.value_field] + ([source.id_field] if source.id_field in names else [])


def _table_block(source: StreamSource, table) -> _Block:
    column = table.column(source.value_field)
    has_id = source.id_field in table.column_names
    ids = table.column(source.id_field).to_pylist() if has_id else None
    if source.value_field != source.text_field:
        try:
            return _Block(ids, token_arrays(column))
        except (AttributeError, TypeError) as e:
            raise DataError(
                f"dataset {source.spec.where!r}: column {source.value_field!r} is not a list "
                f"of token ids ({e}); point tokens_field at such a column"
            ) from e
    try:
        return _Block(ids, column.to_pylist())
    except UnicodeDecodeError:  # find the undecodable rows
        return _Block(ids, [_decoded_or_bad(column, i) for i in range(len(column))])


def _decoded_or_bad(column, i: int):
    try:
        return column[i].as_py()
    except UnicodeDecodeError as e:
        return BadText(f"is not valid UTF-8 ({e})")


class TextReader(_RowReader):
    """Plain text: a file is one document (one block of one row)."""

    def columns(self, path: str) -> list[str]:
        return ["text"]

    def block_rows(self, path: str) -> list[int]:
        return [1]

    def decode(self, source: StreamSource, path: str, b: int) -> _Block:
        with _open_binary(path) as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            text = BadText(f"is not valid UTF-8 ({e})")
        return _Block(None, [text])


class JsonLinesReader:
    """JSON lines: a unit is a byte range of whole lines (or a whole file, which a
    compressed one always is). A position is the byte offset of a line: a resume seeks
    straight to it. Each line is decoded on its own, so one with invalid UTF-8 or JSON
    is a bad document (skipped and counted, or an error, by the packer's policy), not
    the end of the file."""

    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self._streams: dict[int, object] = {}  # file -> open compressed or remote stream
        # The units being read whose bytes were fetched ahead, each kept until it is read
        # through (the order's lanes read their units in turn, a read at a time), the
        # oldest let go beyond KEEP_SPAN_BYTES (it is then read from the file).
        self._spans: OrderedDict[tuple, _Span] = OrderedDict()

    def columns(self, path: str) -> list[str] | None:
        """The keys of the objects in the first MiB, or None if it has none."""
        with _open_binary(path) as f:
            head = f.read(SAMPLE_BYTES)
        keys: dict[str, None] = {}
        for line in head.split(b"\n"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                keys.update(dict.fromkeys(row))
        return list(keys) or None

    def file_units(self, source: StreamSource, f: int) -> list[tuple[int, int, int]]:
        """Byte ranges of ``UNIT_BYTES`` (smaller in a small file: at least
        ``MIN_FILE_UNITS`` ranges, of ``MIN_UNIT_BYTES`` at least): a unit holds the lines
        that start in its range
        (a line longer than a range leaves the ranges it covers empty). A compressed
        file is one unit. Cost: a stat, no data read."""
        path = self.spec.files[f]
        if _compressed(path):
            return Units([f], [0], [-1], [1])
        size = _file_size(path)
        step = max(MIN_UNIT_BYTES, min(UNIT_BYTES, -(-size // MIN_FILE_UNITS)))
        return Units([f], [0], [size], [max(1, -(-size // step))])

    def _stream(self, f: int, at: int):
        """File ``f`` open at byte ``at``. A compressed or remote file stays open between
        reads (one at a time per reader): seeking in it decompresses (or downloads)
        everything before ``at``, so reopening per read would cost O(position). A read
        further on seeks forward on the open stream (the gap only); one before it (a
        resume, a new pass) reopens. A local plain file is opened per read (a seek is
        free)."""
        path = self.spec.files[f]
        if not (is_remote(path) or _compressed(path)):
            fh = open(path, "rb")
            fh.seek(at)
            return fh
        fh = self._streams.pop(f, None)
        for other in self._streams.values():  # one open stream (and its buffers) at a time
            other.close()
        self._streams.clear()
        if fh is None or fh.tell() > at:
            if fh is not None:
                fh.close()
            fh = _open_binary(path)
        if fh.tell() < at:
            fh.seek(at)  # forward: decompresses (downloads) only the gap
        self._streams[f] = fh
        return fh

    def __getstate__(self):
        return {**self.__dict__, "_streams": {}, "_spans": OrderedDict()}  # a worker opens its own

    def block_of(self, source: StreamSource, unit) -> tuple[int, int, int] | None:
        """A unit's byte range is its block; none for a compressed file (read whole as a
        stream) or the unit being read."""
        f, lo, hi = unit
        if hi < 0 or (f, lo, hi) in self._spans:
            return None
        return f, lo, hi

    def fetch(self, source: StreamSource, key: tuple[int, int, int]) -> tuple[_Span, int]:
        """The bytes the reads of unit ``key`` use (on a prefetch thread): from the byte
        before its range (where its first line is found) to the end of the line running
        past its end. One ranged GET takes the range and ``LINE_TAIL_BYTES`` past it (at
        most the range's size), which holds that line's rest for most lines (a web
        document's line: a few KiB); a longer line takes further GETs, each twice the
        last. Bytes fetched: the range, the line running past it (which the next range's
        fetch holds too: it skips it) and the rest of the last GET past that line's end:
        at most a line and 16 KiB per range (~0.4 % of a 4 MiB range). Requests: one per
        range, and one more per doubling where a line outruns the tail."""
        f, lo, hi = key
        start = max(0, lo - 1)
        fs, inner = _remote_fs(self.spec.files[f])
        tail = max(1, min(LINE_TAIL_BYTES, hi - lo))
        data, size = b"", None
        while True:
            want = hi + tail - start - len(data)  # up to tail bytes past hi in all
            got = fs.cat_file(inner, start=start + len(data), end=start + len(data) + want)
            data += got
            newline = data.find(b"\n", hi - 1 - start)
            if newline >= 0:
                data = data[: newline + 1]
                break
            if len(got) < want:  # the file's end
                break
            size = int(fs.size(inner)) if size is None else size  # a long line: rare
            if start + len(data) >= size:
                break
            tail *= 2
        return _Span(key, start, data), len(data)

    def read(self, source: StreamSource, unit, at: int):
        f, lo, hi = unit
        if 0 <= hi <= at:
            return [], None, None
        span = self._span_for(source, unit)
        if span is not None:
            return self._read_span(source, unit, at, span)
        fh = self._stream(f, at)
        if at == lo and lo > 0:  # a range's first line is the first to start in it
            fh.seek(lo - 1)
            fh.readline()  # to the end of the line holding the byte before the range
            at = fh.tell()
            if 0 <= hi <= at:
                fh.close()
                self._streams.pop(f, None)
                return [], None, None
        data = fh.read(READ_BYTES if hi < 0 else max(1, min(READ_BYTES, hi - at)))
        if data and not data.endswith(b"\n"):
            data += fh.readline()  # finish the last line
        if f not in self._streams or not data:
            fh.close()
            self._streams.pop(f, None)
        if not data:
            return [], None, None
        return self._lines(source, unit, at, data)

    def _span_for(self, source: StreamSource, unit) -> _Span | None:
        """The bytes of ``unit`` fetched ahead, if they were: kept while it is read."""
        key = tuple(unit)
        if key in self._spans:
            self._spans.move_to_end(key)
            return self._spans[key]
        taken = source.prefetch.take(key) if source.prefetch is not None and key[2] >= 0 else None
        if taken is not None:
            self._spans[key] = taken
            held = sum(len(s.data) for s in self._spans.values())
            while held > KEEP_SPAN_BYTES and len(self._spans) > 1:
                held -= len(self._spans.popitem(last=False)[1].data)
        return taken

    def _read_span(self, source: StreamSource, unit, at: int, span: _Span):
        """``read`` on the bytes fetched ahead: the same lines, in the same reads, as from
        the file (the first line found after the byte before the range, ``READ_BYTES``
        and the rest of a line at a time)."""
        f, lo, hi = unit
        data, base = span.data, span.start
        if at == lo and lo > 0:
            newline = data.find(b"\n", lo - 1 - base)
            at = base + (newline + 1 if newline >= 0 else len(data))
            if hi <= at:
                self._spans.pop(span.key, None)
                return [], None, None
        begin = at - base
        cut = begin + max(1, min(READ_BYTES, hi - at))
        if cut < len(data) and data[cut - 1 : cut] != b"\n":
            newline = data.find(b"\n", cut)
            cut = newline + 1 if newline >= 0 else len(data)
        chunk = data[begin:cut]
        if not chunk:
            self._spans.pop(span.key, None)
            return [], None, None
        docs, next_at, _ = self._lines(source, unit, at, chunk)
        if next_at is None:
            self._spans.pop(span.key, None)
        return docs, next_at, None

    def _lines(self, source: StreamSource, unit, at: int, data: bytes):
        """The documents of the whole lines ``data`` holds, the first starting at ``at``."""
        f, _, hi = unit
        name = self.spec.relative_name(self.spec.files[f])
        docs, pos = [], at
        lines = data.split(b"\n")
        for line in lines[:-1] if data.endswith(b"\n") else lines:
            start, pos = pos, pos + len(line) + 1
            if 0 <= hi <= start:
                return docs, None, None
            if line.strip():
                docs.append((start, pos, *self._document(source, line, f"{name}@{start}")))
        source.rows_decoded += len(docs)
        return docs, (pos if hi < 0 or pos < hi else None), None

    def _document(self, source: StreamSource, line: bytes, where: str) -> tuple[str, object]:
        try:
            row = json.loads(line)
        except UnicodeDecodeError as e:
            return where, BadText(f"is not valid UTF-8 ({e})")
        except ValueError as e:
            return where, BadText(f"is not valid JSON ({e})")
        if not isinstance(row, dict):
            return where, BadText("is not a JSON object")
        value = row.get(source.value_field)
        if source.value_field != source.text_field and isinstance(value, list):
            value = np.asarray(value, dtype=np.int32)
        doc_id = row.get(source.id_field)
        return (str(doc_id) if doc_id is not None else _doc_id(value)), value


_READERS = {
    "parquet": ParquetReader,
    "arrow": ArrowReader,
    "text": TextReader,
    "json": JsonLinesReader,
}
