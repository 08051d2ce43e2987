"""Token counts: every document's token count, per unit, measured just in time and shared.

Owns: measuring one unit (each document tokenized as the window reader tokenizes it,
``[BOS] + text + [EOS]``, and 0 for a document the bad-data policy skips), the count
files in ``training.length_index_dir``, and handing the measuring out among every
process that needs counts.

- **Just in time, by pieces.** The global order (order.py) asks for a unit's counts up
  to the tokens a window needs when the window reaches them, so a corpus's first step
  waits for the first documents (``FIRST_PIECE_DOCS``) of the units its first windows
  lie in, never for whole units or the corpus. A unit is measured a piece at a time as
  its lane reads on (16, 48, 192 documents of a 256-row unit), each piece under a claim
  of its own; a unit of at most 64 rows, and any unit a tool asks for whole, is measured
  in one piece.
- **Shared, and surviving.** Each unit's counts are one file (while it is measured in
  pieces, a file a piece, ``<lo>-<hi>@<first document>.npz``, which the piece that ends
  the unit folds into the unit's file and deletes), written atomically
  (``os.replace``; in a bucket, ``s3://...``, one create-only PUT: storage.py), named
  by what they depend on: the content signature of the data
  file (size, CRC32 of its first and last MiB; not its path), the unit's range, the
  tokenizer and the reading settings (``counts_key``). A kill -9 loses at most the pieces
  being measured; a relaunch, another job, or another node reading the same folder
  reuses the rest, and goes on from the last piece written.
- **Dynamic work.** A process that needs a unit no one has measured claims it (a
  ``.claim`` file published whole, naming host, pid and rank, its mtime refreshed
  while it measures: ``torchtitan.io.claims``, the lease's rule) and measures it. Where
  another holds the claim, the process measures the next unclaimed units ahead of it
  meanwhile (the ranks of a job split the work of the steps ahead), and takes over a
  claim whose holder stopped refreshing it (``CLAIM_STALE_S``; a torn claim, empty or
  half-written, is judged by that age alone) or is a dead process of this machine and
  pid namespace. Waiting has a limit
  (``training.length_index_wait_seconds``) and ends in one line naming whom it waited for.

- **Tokenized once on the first pass.** The measuring process keeps the ids it tokenized
  (``UnitTokens``: a piece's tokens back to back, and its documents' ids) for the
  windows that read the unit: in its memory, and in a sidecar file beside the counts
  (``<lo>-<hi>@<first>.tokens``, an .npz written before them) for the other processes of the job, loader
  workers and ranks, which read the unit's windows too. A window reader takes a document's
  tokens from there and reads no text; the sidecar goes once its unit's lane finished
  it, a step later (``let_go``). A sidecar is a cache, never the truth: one that is missing,
  unreadable or of another length than the counts says nothing, and the document is read
  and tokenized as before.

- **Read ahead from a bucket.** Where the folder is a bucket, a process that looks up
  a unit's counts starts reading the count files of the units the order reaches next
  (``read_ahead``), so a lane that takes one finds it read; each is read once, by one
  plain GET of a presigned URL (``storage.read_bytes``: ~1.2 ms of the process's Python
  a file, against ~2.1 ms through s3fs, GIL that the main thread's tokenizing waits for).

Cost: a unit is tokenized once per corpus and tokenizer, by one process of all the jobs
that share the folder (twice at worst, when a claim is taken over); on the first pass,
its windows read those tokens instead of tokenizing again (a pass after the first
tokenizes each document once, to read it). A process keeps the
counts of ``KEEP_UNITS`` units: O(lookahead), never O(documents). On disk, 4 bytes per
document (12 for JSON lines, whose rows are found by byte offset): c4's 365 M documents
take 1.5 GB in ~360 K files of ~4 KB; FineWeb's ~23 B documents about 92 GB in 22 M
files (where a file system dislikes that many, prepare them offline with
``scripts/prepare_data.py`` on the file system the job reads). The sidecars of measured
tokens live only while their units are read: a source's lanes and the units measured
ahead of them, ``LANES + LOOKAHEAD`` = 64 units (and those a step finishes, until the
next step), ~0.4 MB each for web text (256 documents of ~700 tokens at 2 bytes; 4 bytes
where the vocabulary passes 65,536): about 25-50 MB a source at any time, whatever the
corpus (c4 or FineWeb alike), plus the units in flight when a process is killed (read and
deleted by the relaunch that continues them). In memory, a process that reads windows
keeps the same units at most, and never more than ``KEEP_TOKEN_BYTES`` a source. Pieces
cost files, not tokens: a 256-row unit measured in three pieces writes two piece files
(and deletes them) and takes three claims where a whole one takes one; locally a few
hundred microseconds a unit. In a bucket, a piece measured costs about nine requests
(two HEADs, claim PUT, two HEADs, its counts' PUT, the claim's GET and DELETE; a GET
and a PUT per ``HEARTBEAT_S`` of measuring), and two more on a first pass (its sidecar's
PUT and DELETE, and a GET by each other process that reads it), plus a GET of each
earlier piece by each process that reads on: about 30 a unit measured by a job, where
``scripts/prepare_data.py`` (whole units) takes about 8; a unit read is one GET (its
count file says which pieces kept a sidecar, so none is looked for where none was): c4
measured by a job ~40 M requests, FineWeb ~2.5 G (about $200 and $12,500 of S3 PUTs and
GETs: prepare a corpus that large once, every job then reads).

Never: choose an order, pack windows, or touch torch.distributed.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from torchtitan.data.packing import document_tokens
from torchtitan.data.spec import UNIT_ROWS, DataError
from torchtitan.io import claims, storage

logger = logging.getLogger(__name__)

COUNTS_VERSION = 2
CACHE_ENV = "TORCHTITAN_CACHE"
CLAIM_STALE_S = 60.0  # a claim whose holder has not refreshed it for this long is taken over
HEARTBEAT_S = 5.0  # how often a measuring process refreshes its claim
KEEP_UNITS = 256  # units' counts a process keeps in memory (a few lanes' lookahead)
# Measured tokens a process keeps in memory, a source: the units its lanes read and those
# measured ahead of them (order.LANES + order.LOOKAHEAD = 64 units of ~0.4 MB for web
# text, ~25 MB), with room for units of long documents; beyond it the least recently read
# unit is dropped and read back from its sidecar if needed again.
KEEP_TOKEN_BYTES = 96 << 20
KEEP_MISSES = 1024  # pieces known to have no sidecar (not looked for: their counts say so)
# A unit is measured in pieces (SourceCounts): the first of at least this many documents
# (a window of 2,049 tokens needs about 3 web documents; 16 cover the windows of a lane's
# first steps), each later one of at least PIECE_GROWTH - 1 times the documents before it
# (16, 48, 192 of 256: three pieces a unit, so a piece file and a claim more per unit
# than measuring it whole, and a first step that waits for 16 documents a unit).
FIRST_PIECE_DOCS = 16
PIECE_GROWTH = 4
# How long a process that leaves the measuring to its loader workers waits for a piece no
# one has claimed before it measures the piece itself (its workers plan the same steps
# ahead of it, so such a wait ends as soon as they start: seconds at most).
DEFER_S = 5.0
PROGRESS_EVERY_S = 30.0  # how often a waiting or measuring process says how far it is
# Count files in a bucket read ahead (SourceCounts.read_ahead): the next units of the order,
# at most this many reads held or in flight, on this many threads, per source and process.
READ_AHEAD_FILES = 64
READ_AHEAD_THREADS = 4


@dataclass
class UnitCounts:
    """The token count of each document of one unit, in reading order, and where the
    reader finds each (a row of the file, a JSON line's byte offset, a dataset row).

    Or of the unit's first documents only (``next_at`` >= 0: not ``complete``): a unit is measured in
    *pieces*, the first few documents first (``FIRST_PIECE_DOCS``, or as many as the
    windows that asked need), the rest as the lanes reach them (``next_at``: where the
    next piece reads from). ``pieces``: the first document of each piece these counts
    were put together from; ``sidecars``: those whose measured tokens were kept in a
    sidecar file (``SourceCounts.unit_tokens``)."""

    lengths: np.ndarray  # int32
    ats: np.ndarray  # int64
    next_at: int = -1  # where the next piece reads from; -1: these are the whole unit's
    pieces: tuple = (0,)
    sidecars: tuple = ()

    @cached_property
    def cum(self) -> np.ndarray:
        """Tokens up to and including each document."""
        return np.cumsum(self.lengths, dtype=np.int64)

    @property
    def complete(self) -> bool:
        return self.next_at < 0

    @property
    def total(self) -> int:
        """Tokens of the unit (of its documents measured, while not ``complete``)."""
        return int(self.cum[-1]) if len(self.lengths) else 0

    @cached_property
    def skipped(self) -> int:
        """Documents with no tokens (skipped by the bad-data policy)."""
        return int((self.lengths == 0).sum())

    def covers(self, upto: int | None) -> bool:
        """Whether these counts reach token ``upto`` (exclusive: at least ``upto`` tokens
        measured) or are the whole unit; ``upto`` None asks for the whole unit."""
        return self.complete or (upto is not None and self.total >= upto)

    def row_at(self, token: int) -> tuple[int, int]:
        """(row, token within it) of the unit's ``token``-th token. Cost: O(log rows)."""
        j = int(np.searchsorted(self.cum, token, side="right"))
        return j, token - (int(self.cum[j - 1]) if j else 0)

    def piece_of(self, row: int) -> int:
        """The first document of the piece ``row`` was measured in."""
        return self.pieces[bisect.bisect_right(self.pieces, row) - 1]

    def then(self, piece: UnitCounts, sidecar: bool) -> UnitCounts:
        """These counts followed by ``piece``, the piece measured from ``next_at`` (its
        tokens in a sidecar or not)."""
        first = len(self.lengths)
        return UnitCounts(
            np.concatenate([self.lengths, piece.lengths]), np.concatenate([self.ats, piece.ats]),
            piece.next_at, (*self.pieces, first),
            (*self.sidecars, first) if sidecar else self.sidecars,
        )  # fmt: skip


@dataclass
class UnitTokens:
    """The tokens of one piece of a unit as its measuring tokenized them: every document's
    tokens back to back (``ids``, the narrowest unsigned type that holds the vocabulary),
    and each document's id (``doc_ids``), in reading order, from the unit's document
    ``first`` on. Where document ``row`` lies in ``ids`` is its counts'
    (``UnitCounts.cum``, less the tokens before ``first``)."""

    ids: np.ndarray
    doc_ids: np.ndarray  # str
    lengths: np.ndarray  # int32: each document's tokens, as its counts hold them
    first: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes + self.doc_ids.nbytes + self.lengths.nbytes)

    def fits(self, counts: UnitCounts) -> bool:
        """Whether these are the tokens of the documents ``counts`` describe (a sidecar
        of other counts, e.g. left beside counts measured again, is not)."""
        end = self.first + len(self.lengths)
        return (len(self.ids) == int(self.lengths.sum()) and len(self.doc_ids) == len(self.lengths)
                and end <= len(counts.lengths)
                and np.array_equal(self.lengths, counts.lengths[self.first : end]))  # fmt: skip

    def document(self, counts: UnitCounts, row: int) -> tuple[str, np.ndarray]:
        """(doc_id, tokens as int32) of document ``row`` (of this piece)."""
        base = int(counts.cum[self.first - 1]) if self.first else 0
        end = int(counts.cum[row]) - base
        return str(self.doc_ids[row - self.first]), self.ids[
            end - int(counts.lengths[row]) : end
        ].astype(np.int32)


def measure_unit(source, tokenizer, unit, bad_data: str, heartbeat=None, keep: bool = False,
                 at: int | None = None, docs: int | None = None,
                 upto: int | None = None):  # fmt: skip
    """Counts of one unit, or of one piece of it: its documents read from ``at`` (the
    unit's start by default) and tokenized (the ``heartbeat`` called every
    ``HEARTBEAT_S`` on the way), up to the unit's end, or, given ``docs`` and ``upto``,
    until at least ``docs`` documents and ``upto`` tokens are measured (then
    ``complete`` is False, and ``next_at`` where the rest begins). With ``keep``,
    ``(counts, UnitTokens)``, the tokens kept for the windows that read them. Cost: the
    documents read and tokenized once (a unit of ~256 web documents: about a second);
    kept, their tokens held until it returns (~0.4 MB for 256 web documents)."""
    lengths, ats = [], []
    parts, doc_ids = [], []
    at = unit[1] if at is None else at
    tokens_so_far = 0

    def enough() -> bool:
        return docs is not None and len(lengths) >= docs and tokens_so_far >= (upto or 0)

    beat = time.monotonic()
    while at is not None:
        read, next_at, _ = source.read(unit, at)
        for start, _, doc_id, value in read:
            if enough():
                next_at = start  # the rest is a later piece's
                break
            tokens = document_tokens(tokenizer, doc_id, value, source.spec.name, bad_data)
            lengths.append(0 if tokens is None else len(tokens))
            tokens_so_far += lengths[-1]
            ats.append(start)
            if keep:
                doc_ids.append(doc_id)
                if tokens is not None:
                    parts.append(tokens)
        at = next_at
        if at is not None and enough():  # the rest is a later piece's
            break
        if heartbeat is not None and time.monotonic() - beat > HEARTBEAT_S:
            heartbeat()
            beat = time.monotonic()
    counts = UnitCounts(np.array(lengths, dtype=np.int32), np.array(ats, dtype=np.int64),
                        -1 if at is None else int(at))  # fmt: skip
    if not keep:
        return counts
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    narrow = np.uint16 if not len(ids) or int(ids.max()) < 1 << 16 else np.uint32
    return counts, UnitTokens(ids.astype(narrow), np.array(doc_ids, dtype=str), counts.lengths)


# ---- where counts live ---------------------------------------------------------------
def cache_dir(configured: str) -> str:
    """``training.length_index_dir``, else ``$TORCHTITAN_CACHE/length_index``, else
    ``~/.cache/torchtitan/length_index``."""
    if configured:
        return configured
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "torchtitan"
    )
    return os.path.join(root, "length_index")


def counts_key(source_fingerprint: dict, files: int, which: list[int], tokenizer_sha256: str,
               training, value_field: str, units: str) -> str:  # fmt: skip
    """The key of the token counts of data files ``which`` of a source, from the source's
    fingerprint entry (its ``files`` data files, then its stamps): those files' content
    signatures (a remote file, unsigned, by its name and the source's revision stamps),
    the tokenizer, the column read, the bad-data policy and how units are cut (``units``,
    the source kind's name for it). Never the path: a corpus moved or copied elsewhere
    keeps its counts. Which files share a key is the source's to say (its
    ``count_keys``)."""
    t = training
    settings = [COUNTS_VERSION, tokenizer_sha256, value_field, t.bad_data, UNIT_ROWS, units]
    entries = source_fingerprint["files"]
    stamps = entries[files:]  # per file, then the source's stamps
    content = [entries[f][1:] if len(entries[f]) > 1 else entries[f] for f in which]
    what = json.dumps([settings, content, stamps], sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:32]


class SourceCounts:
    """One source's unit counts, read from the shared folder or measured where missing.

    ``keys[f]`` names file ``f``'s counts (map-style: ``keys[0]``, the source's; the
    source's ``count_keys``); a unit's
    counts are ``<folder>/<key>/<lo>-<hi>.npz``. ``measure(unit)`` measures one unit
    (``measure_unit`` by default). ``measured`` counts the pieces this process measured
    (tests and benchmarks read it).

    **By pieces.** A window needs a unit's counts only up to its own tokens, so a unit is
    measured a piece at a time, each under a claim of its own: the first
    ``FIRST_PIECE_DOCS`` documents (or as many as the window that asked needs), then
    ``PIECE_GROWTH - 1`` times the documents before it, and so on (16, 48, 192 of a
    256-row unit). A piece that does not end the unit is a file of its own,
    ``<lo>-<hi>@<first document>.npz`` (its counts and where the next piece reads from);
    the piece that ends it writes the unit's file, whole, and deletes the others. A
    corpus's first step so waits for a few documents of each unit its windows lie in,
    never for whole units. Asked for a whole unit (``prepare_data``, ``pass_tokens``),
    it is one piece.

    With ``share_tokens`` (a stream that reads windows sets it; tools that only measure,
    such as prepare_data, do not), a piece measured here keeps its tokens for the window
    readers: ``unit_tokens`` gives them (this process's, else the sidecar another wrote),
    ``let_go`` lets them go once the unit's lane finished it."""

    def __init__(self, source, tokenizer, bad_data: str, folder: str, keys: list[str],
                 wait_s: float = 600.0, log: bool = False, measure=None):  # fmt: skip
        self.source, self.tokenizer, self.bad_data = source, tokenizer, bad_data
        self.folder, self.keys, self.wait_s, self.log = folder, keys, wait_s, log
        self._measure = measure or self._measure_unit
        self._mem: OrderedDict[tuple, UnitCounts] = OrderedDict()
        self.measured = 0
        self._writable = True
        self._tokens: dict[tuple, str] = {}  # (unit, piece) -> the token of this process's claim
        self._progress = _Progress(source.spec.name, log)
        # A pretokenized source's documents are framed, not tokenized: nothing to share.
        self.share_tokens = not getattr(source.spec, "tokens_field", "")
        # (unit, first document of the piece) -> its measured tokens
        self._unit_tokens: OrderedDict[tuple, UnitTokens] = OrderedDict()
        self._unit_token_bytes = 0
        self._no_tokens: OrderedDict[tuple, None] = OrderedDict()  # pieces with no sidecar
        self._sidecars: set = set()  # the pieces whose sidecar this process wrote, not yet gone
        # Whether this process keeps measured tokens in memory, and measures what no one has:
        # not a process that reads no window (a rank's main process whose loader workers
        # read). Its sidecars would serve, but its workers plan the same steps ahead of it
        # and measure them anyway: it waits for their counts, and measures only a piece no
        # one claimed for DEFER_S (its workers stuck or gone), so it never holds decoded
        # blocks of its own (streaming.KEEP_BLOCK_BYTES a process).
        self.keeps_tokens = True
        self.measures = True
        # Count files read ahead (a folder in a bucket): unit -> its read in flight or done;
        # off once one is missing (a corpus measured as it is read has none ahead).
        self._ahead: OrderedDict[tuple, object] = OrderedDict()
        self._ahead_pool, self._ahead_pid = None, -1
        self.reads_ahead = storage.is_remote(folder)

    def __getstate__(self):
        # A worker reads its own, and holds no claim of its parent's.
        return {**self.__dict__, "_mem": OrderedDict(), "measured": 0, "_tokens": {},
                "_unit_tokens": OrderedDict(), "_unit_token_bytes": 0,
                "_no_tokens": OrderedDict(), "_sidecars": set(), "_ahead": OrderedDict(),
                "_ahead_pool": None, "_ahead_pid": -1}  # fmt: skip

    def read_ahead(self, units):
        """Start reading the count files of ``units`` (those the order reaches next) where
        the folder is a bucket, so that a lane taking one finds it read: one GET each, on
        ``READ_AHEAD_THREADS`` threads, at most ``READ_AHEAD_FILES`` held or in flight (the
        oldest dropped past that: ~4 KB each, O(lookahead) per source and process, whatever
        the corpus). Off for the rest of the process once a file read ahead is missing (a
        corpus measured as it is read: its next units have none yet). Each file read ahead is
        read once: ``_load`` takes it."""
        if not self.reads_ahead:
            return
        if self._ahead_pid != os.getpid():  # a forked worker reads with its own threads
            from concurrent.futures import ThreadPoolExecutor

            self._ahead_pool = ThreadPoolExecutor(READ_AHEAD_THREADS, "count-read-ahead")
            self._ahead_pid, self._ahead = os.getpid(), OrderedDict()
        for unit in units:
            unit = tuple(int(x) for x in unit)
            if unit in self._mem or unit in self._ahead:
                continue
            while len(self._ahead) >= READ_AHEAD_FILES:
                self._ahead.popitem(last=False)[1].cancel()
            self._ahead[unit] = self._ahead_pool.submit(_read_or_none, self.path(unit))

    def _read_ahead_bytes(self, unit) -> bytes | None:
        """The bytes of ``unit``'s count file read ahead, once; None: read it now."""
        future = self._ahead.pop(unit, None) if self._ahead_pid == os.getpid() else None
        if future is None or future.cancelled():
            return None
        data = future.result()
        if data is None:  # missing (or the store did not answer): read in line, ahead no more
            self.reads_ahead = False
            self._ahead.clear()
        return data

    def _measure_unit(self, unit, heartbeat=None, **piece):
        return measure_unit(self.source, self.tokenizer, unit, self.bad_data, heartbeat,
                            keep=self.share_tokens, **piece)  # fmt: skip

    def path(self, unit) -> str:
        f, lo, hi = (int(x) for x in unit)
        return storage.join(self.folder, self.keys[f], f"{lo}-{hi}.npz")

    def piece_path(self, unit, first: int) -> str:
        """Where the counts of the piece of ``unit`` from its document ``first`` lie while
        the unit is not measured whole."""
        return self.path(unit)[: -len(".npz")] + f"@{first}.npz"

    def claim_path(self, unit, first: int = 0) -> str:
        """The claim of measuring ``unit`` from its document ``first`` (from its start:
        the unit's claim)."""
        return (self.piece_path(unit, first) if first else self.path(unit)) + ".claim"

    def tokens_path(self, unit, first: int = 0) -> str:
        """Where the sidecar of the tokens of ``unit``'s piece from its document ``first``
        lies (while its unit is read)."""
        return self.piece_path(unit, first)[: -len(".npz")] + ".tokens"  # an .npz of its own

    def counts(self, unit, ahead=(), upto: int | None = None) -> UnitCounts:
        """The counts of ``unit`` (a ``(file, lo, hi)`` of the source's units): the whole
        unit, or, given ``upto``, at least its documents that hold its first ``upto``
        tokens (``UnitCounts.covers``). Where no one measured them yet, this process
        measures the next piece, or, if another holds its claim, measures the first piece
        of the first unclaimed units of ``ahead`` (the units the order reaches next, or a
        function that lists them) while it waits. Raises DataError after ``wait_s``
        seconds of waiting on others."""
        if not isinstance(unit, tuple):
            unit = tuple(int(x) for x in unit)
        hit = self._mem.get(unit)
        if hit is not None and hit.covers(upto):
            self._mem.move_to_end(unit)
            return hit
        listed = []  # the units ahead, listed once and only if needed (it walks the order)

        def units_ahead():
            if not listed:
                listed.append(ahead() if callable(ahead) else ahead)
            return listed[0]

        if self.reads_ahead and ahead:
            self.read_ahead(units_ahead())
        found = self._follow(unit, hit)
        if not found.covers(upto):
            ahead = units_ahead()
            found = self._obtain(unit, found, upto, [tuple(int(x) for x in u) for u in ahead])
        self._keep(unit, found)
        return found

    def has(self, unit) -> bool:
        """Whether the unit's counts exist whole (in memory or in the folder)."""
        unit = tuple(int(x) for x in unit)
        hit = self._mem.get(unit)
        return (hit is not None and hit.complete) or storage.exists(self.path(unit))

    def _keep(self, unit, counts: UnitCounts):
        self._mem[unit] = counts
        self._mem.move_to_end(unit)
        while len(self._mem) > KEEP_UNITS:
            self._mem.popitem(last=False)

    def _follow(self, unit, known: UnitCounts | None) -> UnitCounts:
        """What the folder holds of ``unit`` beyond ``known``: its whole counts, else
        ``known`` (or nothing: ``_nothing``) followed by the pieces written since. Cost:
        a read a piece (the unit's file first)."""
        if known is not None and known.complete:
            return known
        whole = self._load(unit)
        if whole is not None:
            return whole
        known = known if known is not None else _nothing(unit)
        while True:
            piece = self._load_piece(unit, len(known.lengths))
            if piece is None:
                return known
            known = known.then(*piece)

    def _obtain(self, unit, known: UnitCounts, upto: int | None, ahead: list) -> UnitCounts:
        begin = time.monotonic()
        delay, i = 0.01, 0
        # A process that leaves the measuring to its loader workers looks for their counts
        # often (a stat or a GET a poll, only while it waits on them).
        longest = 0.5 if self.measures or storage.is_remote(self.folder) else 0.05
        while True:
            first = len(known.lengths)
            turn = self.measures or time.monotonic() - begin > DEFER_S
            if turn and self._claim(unit, first):
                known = self._measure_claimed(unit, known, upto)
                if known.covers(upto):
                    return known
                continue
            found = self._follow(unit, known)
            if found is not known:  # written meanwhile
                known = found
                if known.covers(upto):
                    return known
                continue
            # Another process measures it: measure what no one measures yet meanwhile.
            while self.measures and i < len(ahead):
                other, i = ahead[i], i + 1
                if other not in self._mem and self._claim(other, 0):
                    self._keep(other, self._measure_claimed(other, _nothing(other), 0))
                    break
            else:
                waited = time.monotonic() - begin
                if waited > self.wait_s:
                    raise DataError(
                        f"waited {waited:.0f} s for the token counts of unit {unit} of dataset "
                        f"{self.source.spec.name!r}, which {self._holder(unit, first)} is "
                        f"measuring ({self.claim_path(unit, first)}); check that process, or "
                        "raise training.length_index_wait_seconds"
                    )
                self._progress.waiting(unit, self._holder(unit, first), waited)
                time.sleep(delay)
                delay = min(longest, delay * 2)

    def _load(self, unit) -> UnitCounts | None:
        path = self.path(unit)
        data = self._read_ahead_bytes(unit) if self._ahead else None
        try:
            if data is None:
                data = storage.read_bytes(path)
            with np.load(io.BytesIO(data)) as z:
                lengths = z["lengths"]
                ats = z["ats"] if "ats" in z.files else unit[1] + np.arange(len(lengths))
                pieces = tuple(int(x) for x in z["pieces"]) if "pieces" in z.files else (0,)
                sidecars = tuple(int(x) for x in z["sidecars"]) if "sidecars" in z.files else ()
            return UnitCounts(lengths, ats.astype(np.int64), -1, pieces, sidecars)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file is measured again
            if data is None and storage.is_remote(path):
                return None  # the store did not answer (a network error): its file is kept
            logger.warning("token counts %s are unreadable (%r): measuring them again", path, e)
            _remove(path)
            return None

    def _load_piece(self, unit, first: int) -> tuple[UnitCounts, bool] | None:
        """(counts of the piece from document ``first``, whether it has a sidecar), or
        None where it is not written (or is damaged: measured again)."""
        path = self.piece_path(unit, first)
        data = None
        try:
            data = storage.read_bytes(path)
            with np.load(io.BytesIO(data)) as z:
                piece = UnitCounts(z["lengths"], z["ats"].astype(np.int64), int(z["next_at"][0]))
                return piece, "sidecar" in z.files
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file is measured again
            if data is None and storage.is_remote(path):
                return None
            logger.warning("token counts %s are unreadable (%r): measuring them again", path, e)
            _remove(path)
            return None

    # ---- claims (torchtitan.io.claims: the lease's rule) -------------------------------
    def _claim(self, unit, first: int = 0) -> bool:
        """Claim measuring ``unit`` from its document ``first`` for this process (True),
        unless the unit's counts or that piece exist or another live process holds it.
        Takes over a claim whose holder is gone (``claims.gone``: not refreshed for
        ``CLAIM_STALE_S``, a torn claim included, or a dead process of this machine and
        pid namespace)."""
        path, piece = self.path(unit), self.piece_path(unit, first)

        def written() -> bool:
            return storage.exists(path) or storage.exists(piece)

        if written():
            return False
        claim = self.claim_path(unit, first)
        record = claims.record(rank=os.environ.get("RANK", "0"))
        for _ in range(3):
            try:
                storage.makedirs(storage.dirname(path))
                if claims.create(claim, record):
                    break
                seen = claims.read(claim)
            except OSError as e:  # a read-only folder: measure here, keep it in memory
                self._cannot_write(e)
                return not written()
            if seen is None:
                continue  # released meanwhile: the counts are there, or it can be made
            why = claims.gone(seen, CLAIM_STALE_S)
            if why is None:
                return False
            if claims.take_over(claim, seen, record, CLAIM_STALE_S):
                logger.warning("token counts %s: taking over the claim of %s: %s", path,
                               claims.describe(seen.record), why)  # fmt: skip
                break
        else:
            return False
        self._tokens[(unit, first)] = record["token"]
        if written():  # measured between the check and the claim
            self._release(unit, first)
            return False
        return True

    def _release(self, unit, first: int = 0):
        claims.release(self.claim_path(unit, first), self._tokens.pop((unit, first), ""))

    def _holder(self, unit, first: int = 0) -> str:
        try:
            seen = claims.read(self.claim_path(unit, first))
        except OSError:
            seen = None
        return claims.describe(seen.record) if seen is not None else "another process"

    def _measure_claimed(self, unit, known: UnitCounts, upto: int | None) -> UnitCounts:
        """Measure the piece of ``unit`` after ``known`` (claimed), write it, and return
        ``known`` followed by it. ``upto`` None: the rest of the unit in one piece."""
        first = len(known.lengths)
        claim = self.claim_path(unit, first)
        piece = {"at": known.next_at}
        # A unit of a few rows (at most PIECE_GROWTH x FIRST_PIECE_DOCS: 64) is measured
        # whole: its pieces would cost more files and claims than the rows they defer (a
        # JSON lines unit is a byte range, never this small).
        small = first == 0 and 0 < unit[2] - unit[1] <= PIECE_GROWTH * FIRST_PIECE_DOCS
        if (
            upto is not None and not small
        ):  # a piece at a time, each PIECE_GROWTH times the documents
            piece.update(docs=max(FIRST_PIECE_DOCS, (PIECE_GROWTH - 1) * first),
                         upto=max(0, upto - known.total))  # fmt: skip
        try:
            counts = self._measure(
                unit,
                heartbeat=lambda: claims.touch(claim, self._tokens.get((unit, first))),
                **piece,
            )
            sidecar = False
            if isinstance(counts, tuple):  # and the tokens measured, for the readers
                counts, tokens = counts
                tokens.first = first
                self._keep_tokens(unit, tokens)
                # Before the counts: a process that finds the counts finds these too.
                sidecar = self._write_tokens(unit, tokens)
            whole = known.then(counts, sidecar)
            if whole.complete:
                self._write(unit, whole)
                for other in whole.pieces[:-1]:  # the pieces before: the unit's file has them
                    _remove(self.piece_path(unit, other))
            else:
                self._write_piece(unit, first, counts, sidecar)
        finally:
            self._release(unit, first)
        self.measured += 1
        self._progress.measured(counts.total)
        return whole

    # ---- measured tokens, shared with the window readers -------------------------------
    def unit_tokens(self, unit, counts: UnitCounts, row: int = 0) -> UnitTokens | None:
        """The tokens of the piece of ``unit`` that holds document ``row``, as its measuring
        process kept them: this process's own, else the sidecar another process wrote
        (read once, then kept); None where there are none, or none that fit ``counts``
        (the reader then tokenizes the document). Cost: a lookup; the first time a piece
        is asked, one small file read."""
        key = (unit, counts.piece_of(row))
        hit = self._unit_tokens.get(key)
        if hit is not None:
            self._unit_tokens.move_to_end(key)
            return hit
        if not self.share_tokens or key[1] not in counts.sidecars or key in self._no_tokens:
            return None
        tokens = self._load_tokens(*key)
        if tokens is None or not tokens.fits(counts):
            self._no_sidecar(key)
            return None
        self._keep_tokens(unit, tokens)
        return tokens

    def has_tokens(self, unit) -> bool:
        """Whether this process keeps measured tokens of ``unit`` (a piece of it)."""
        return any(key[0] == unit for key in self._unit_tokens)

    def let_go(self, units: list, sidecars: list):
        """``units``' measured tokens leave this process's memory, and the sidecars of
        ``sidecars`` are deleted: the stream calls it as it plans, for the units its lanes
        finished a step before and two steps before (TokenStream._let_go_finished). Not as
        soon as a unit's last token is read: a step's windows are read grouped by the unit
        each starts in, so at the end of a pass, where a window goes on in another lane's
        unit, a window of that unit's earlier tokens may be read after the one that ends
        it. Cost: one unlink (or DELETE) a piece, in the process that wrote its sidecar;
        a scan of the pieces kept (a few hundred at most)."""
        gone = {tuple(int(x) for x in unit) for unit in units}
        for key in [k for k in self._unit_tokens if k[0] in gone]:
            self._unit_token_bytes -= self._unit_tokens.pop(key).nbytes
        gone = {tuple(int(x) for x in unit) for unit in sidecars}
        for key in [k for k in self._sidecars if k[0] in gone]:  # by the process that wrote it
            self._sidecars.discard(key)
            _remove(self.tokens_path(*key))

    def _no_sidecar(self, key: tuple):
        self._no_tokens[key] = None
        while len(self._no_tokens) > KEEP_MISSES:
            self._no_tokens.popitem(last=False)

    def _keep_tokens(self, unit, tokens: UnitTokens):
        if not self.keeps_tokens:
            return
        key = (unit, tokens.first)
        old = self._unit_tokens.pop(key, None)
        self._unit_token_bytes += tokens.nbytes - (old.nbytes if old is not None else 0)
        self._unit_tokens[key] = tokens
        self._no_tokens.pop(key, None)
        while self._unit_token_bytes > KEEP_TOKEN_BYTES and len(self._unit_tokens) > 1:
            _, gone = self._unit_tokens.popitem(last=False)
            self._unit_token_bytes -= gone.nbytes

    def _load_tokens(self, unit, first: int) -> UnitTokens | None:
        try:
            data = storage.read_bytes(self.tokens_path(unit, first))
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                return UnitTokens(z["ids"], z["doc_ids"], z["lengths"], first)
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - a torn or foreign sidecar: tokenize instead
            return None

    def _write_tokens(self, unit, tokens: UnitTokens) -> bool:
        if self._writable:
            arrays = {"ids": tokens.ids, "doc_ids": tokens.doc_ids, "lengths": tokens.lengths}
            if self._write_whole(self.tokens_path(unit, tokens.first), arrays):
                self._sidecars.add((tuple(int(x) for x in unit), tokens.first))
                return True
        return False

    def _write(self, unit, counts: UnitCounts):
        if not self._writable:
            return
        arrays = {"lengths": counts.lengths}
        if not np.array_equal(counts.ats, unit[1] + np.arange(len(counts.lengths))):
            arrays["ats"] = counts.ats  # JSON lines: byte offsets
        if counts.sidecars:  # a reader looks for a piece's sidecar only where one was written
            arrays["pieces"] = np.asarray(counts.pieces, dtype=np.int32)
            arrays["sidecars"] = np.asarray(counts.sidecars, dtype=np.int32)
        self._write_whole(self.path(unit), arrays)

    def _write_piece(self, unit, first: int, counts: UnitCounts, sidecar: bool):
        if not self._writable:
            return
        arrays = {"lengths": counts.lengths, "ats": counts.ats,
                  "next_at": np.array([counts.next_at], dtype=np.int64)}  # fmt: skip
        if sidecar:
            arrays["sidecar"] = np.ones(1, dtype=np.uint8)
        self._write_whole(self.piece_path(unit, first), arrays)

    def _write_whole(self, path: str, arrays: dict) -> bool:
        """``arrays`` as one .npz at ``path``, published whole (storage.publish: written
        aside and renamed onto it, or one create-only PUT in a bucket): a reader sees the
        whole file or none."""
        try:
            storage.makedirs(storage.dirname(path))
            storage.publish(path, lambda f: np.savez(f, **arrays))
            return True
        except OSError as e:
            self._cannot_write(e)
            return False

    def _cannot_write(self, error: OSError):
        if self._writable:
            logger.warning(
                "cannot write token counts to %s (%s): this process measures what it reads "
                "and keeps it in memory; set training.length_index_dir to a writable folder",
                self.folder, error,
            )  # fmt: skip
        self._writable = False


def _nothing(unit) -> UnitCounts:
    """The counts of no document of ``unit``: what its first piece follows."""
    return UnitCounts(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), int(unit[1]),
                      (), ())  # fmt: skip


class _Progress:
    """At most every ``PROGRESS_EVERY_S``: units this process measured and their tokens a
    second, or whom it has been waiting on. Without it a long wait is a silent one."""

    def __init__(self, name: str, log: bool):
        self.name, self.log = name, log
        self.units = self.tokens = 0
        self.begin = self.last = time.monotonic()

    def _due(self) -> bool:
        now = time.monotonic()
        if not self.log or now - self.last < PROGRESS_EVERY_S:
            return False
        self.last = now
        return True

    def measured(self, tokens: int):
        self.units, self.tokens = self.units + 1, self.tokens + tokens
        if self._due():
            logger.info(
                "token counts of %s: %d units measured here, %.0f tokens/s (later starts "
                "read them from training.length_index_dir)",
                self.name, self.units, self.tokens / max(time.monotonic() - self.begin, 1e-9),
            )  # fmt: skip

    def waiting(self, unit, holder: str, waited: float):
        if self._due():
            logger.info("token counts of %s: waiting %.0f s for unit %s, measured by %s",
                        self.name, waited, unit, holder)  # fmt: skip


def _remove(path: str):
    storage.remove(path)


def _read_or_none(path: str) -> bytes | None:
    """A file's bytes, or None where it is missing or the store did not answer (the read
    in line then says why)."""
    try:
        return storage.read_bytes(path)
    except Exception:  # noqa: BLE001 - the read in line raises it, on the main thread
        return None
