"""The token stream: windows of ``seq_len + 1`` tokens read at positions of the global order.

Owns: the job's position (``Position``: windows taken and each source's cursor), where
a given number of windows leaves it (``TokenStream.advance``: which source each window
reads, by the mix, and its pieces, by the source's order), reading a window's pieces
(the documents that hold those tokens, tokenized, and the provenance span of every
piece), the documents a process keeps read ahead, and the check that a document still
has the token count its unit's counts hold (a stale count would shift every later
window, so it stops the run).

Which rank reads window ``g`` is the loader's concern: any process can read any window,
knowing only the position.

A process holds, per source, the decoded rows of at most ``KEEP_READS`` units (each
read is the rest of a unit's rows in its block, at most ``UNIT_ROWS``, or ``READ_BYTES``
of JSON lines, or ``READ_ROWS`` dataset rows), consumed rows dropped as the lanes move
on: with 32 lanes of 256-row units, about 32 x 128 documents; the tokens of
``KEEP_TOKENS`` documents; for parquet and Arrow, the blocks last decoded
(streaming.KEEP_BLOCKS, KEEP_BLOCK_BYTES); and, on a first pass, the tokens measured for the
units its lanes read (index.SourceCounts.unit_tokens), which its windows read instead of
the text.

Never: touch torch.distributed, the DataLoader or checkpoint files; decide which rank
reads which window.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan.data.order import LANES, Cursor, MixByStep, SourceOrder
from torchtitan.data.packing import document_tokens
from torchtitan.data.spec import DataError

logger = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the job's stream stands: windows taken, and each source's cursor. The whole
    loader state: a few integers per lane, the same on every rank. ``retired``: the
    cursors (``Cursor.to_list``) of sources an earlier run read and this one's list
    does not hold, by name, carried from checkpoint to checkpoint so that a source that
    comes back continues where it stopped (a few integers per lane per such source)."""

    windows: int = 0
    cursors: list[Cursor] = field(default_factory=list)
    retired: dict[str, list[int]] = field(default_factory=dict)

    def copy(self) -> Position:
        return Position(self.windows, [c.copy() for c in self.cursors],
                        {k: list(v) for k, v in self.retired.items()})  # fmt: skip

    def tokens(self) -> list[int]:
        """Tokens read from each source since the data started."""
        return [c.tokens for c in self.cursors]


class DocumentReader:
    """One source's documents by (unit, row), read ahead in order, a few kept tokenized."""

    # Units whose rows read ahead are kept: one a lane (a lane reads one unit at a time),
    # and a few for the lanes that took a new unit while their last read is still kept.
    KEEP_READS = LANES + 8
    # Documents kept tokenized: a lane's last ones outlive a round of the other lanes, so
    # that a document cut by a window boundary is tokenized once (each window touches
    # about two; eight a lane leaves room for windows shorter than the documents).
    KEEP_TOKENS = 8 * LANES
    TRIM = 64  # rows a kept read drops at once once they are behind the lane

    def __init__(self, source, order: SourceOrder, tokenizer, bad_data: str,
                 share_measured: bool = True):  # fmt: skip
        self.source, self.order = source, order
        self.tokenizer, self.bad_data = tokenizer, bad_data
        # Read a document from the tokens its unit's measuring kept, where there are some
        # (off: every document read and tokenized here, as before the first pass shared).
        self.share_measured = share_measured
        self.name = source.spec.name
        # Keyed by what a unit is, its range (file, lo, hi), never by its index in a pass:
        # a map-style pass over a grown corpus cuts other ranges, so the same index of
        # another pass is other rows.
        self._reads: OrderedDict[tuple, list] = OrderedDict()  # unit -> [first row, docs]
        self._tokens: OrderedDict[tuple, tuple] = OrderedDict()  # (unit, row) -> document

    def __getstate__(self):
        # A worker starts with no documents of its own process's reads.
        return {**self.__dict__, "_reads": OrderedDict(), "_tokens": OrderedDict()}

    def document(self, unit: tuple, row: int, counts) -> tuple[str, np.ndarray]:
        """(doc_id, tokens) of ``row`` of ``unit`` (its range), whose counts are ``counts``."""
        key = (unit, row)
        hit = self._tokens.get(key)
        if hit is not None:
            return hit
        # On a first pass, the tokens its measuring kept (index.SourceCounts.unit_tokens):
        # no text read, nothing tokenized again.
        measured = self._measured(unit, counts, row)
        if measured is not None:
            return measured.document(counts, row)
        doc_id, value = self._raw(unit, row, counts)
        tokens = document_tokens(self.tokenizer, doc_id, value, self.name, self.bad_data)
        expected = int(counts.lengths[row])
        if (0 if tokens is None else len(tokens)) != expected:
            raise DataError(
                f"document {doc_id!r} of dataset {self.name!r} has "
                f"{0 if tokens is None else len(tokens)} tokens, its unit's token counts "
                f"{expected}: the data or the tokenizer changed behind the counts; delete "
                f"{self.order.counts.path(unit)} (or training.length_index_dir) to measure it "
                "again, or resume with the original data"
            )
        self._tokens[key] = (doc_id, tokens)
        if len(self._tokens) > self.KEEP_TOKENS:
            self._tokens.popitem(last=False)
        return doc_id, tokens

    def _measured(self, unit: tuple, counts, row: int):
        if not self.share_measured:
            return None
        unit_tokens = getattr(self.order.counts, "unit_tokens", None)
        return unit_tokens(unit, counts, row) if unit_tokens is not None else None

    def reads_text(self, unit: tuple, counts) -> bool:
        """Whether reading ``unit`` (whose counts are ``counts``) decodes its text: not
        where the tokens its measuring kept may serve it (here, or in a sidecar)."""
        if not self.share_measured:
            return True
        if getattr(counts, "sidecars", ()):
            return False
        has_tokens = getattr(self.order.counts, "has_tokens", None)
        return has_tokens is None or not has_tokens(unit)

    def let_go(self, units: list, sidecars: list):
        """The measured tokens of ``units`` leave this process, and ``sidecars``' files go
        (index.SourceCounts.let_go)."""
        let_go = getattr(self.order.counts, "let_go", None)
        if let_go is not None and (units or sidecars):
            let_go(units, sidecars)

    def _raw(self, unit: tuple, row: int, counts) -> tuple[str, object]:
        kept = self._reads.get(unit)
        if kept is not None and kept[0] <= row < kept[0] + len(kept[1]):
            self._reads.move_to_end(unit)
        else:
            kept = self._read(unit, row, counts)
        first, docs = kept
        if row - first >= self.TRIM:  # the lane is past these rows
            kept[0], kept[1] = row, docs[row - first :]
            first, docs = kept
        return docs[row - first]

    def _read(self, unit: tuple, row: int, counts) -> list:
        """The rows of one read of ``unit`` from ``row`` on, kept in place of the unit's
        last read. Checked against the counts' positions: a file that changed under the
        same signature stops the run here."""
        docs, _, _ = self.source.read(unit, int(counts.ats[row]))
        if not docs:
            raise DataError(
                f"dataset {self.name!r}: unit {unit} has no document at row {row}, which its "
                "token counts hold: the data changed behind the counts; delete "
                f"{self.order.counts.path(unit)} (or training.length_index_dir)"
            )
        docs = docs[: len(counts.ats) - row]
        for i, (at, *_) in enumerate(docs):
            if at != int(counts.ats[row + i]):
                raise DataError(
                    f"dataset {self.name!r}: a document of unit {unit} starts at {at}, its "
                    f"token counts say {int(counts.ats[row + i])}: the data changed behind "
                    f"the counts; delete {self.order.counts.path(unit)} (or "
                    "training.length_index_dir)"
                )
        kept = [row, [(doc_id, value) for _, _, doc_id, value in docs]]
        self._reads[unit] = kept
        self._reads.move_to_end(unit)
        if len(self._reads) > self.KEEP_READS:
            self._reads.popitem(last=False)
        return kept


class TokenStream:
    """The job's windows: every source's stream, and the mix that interleaves them."""

    def __init__(self, sources: list, counts: list, tokenizer, seq_len: int, *,
                 seed: int = 0, shuffle: bool = True, bad_data: str = "skip",
                 mix_points: list[tuple] = ()):  # fmt: skip
        if not sources:
            raise DataError(
                "no data source configured; set training.dataset or training.dataset_path"
            )
        self.sources = sources
        self.seq_len = seq_len
        self.seed = seed
        self.orders = [
            SourceOrder(src, c, seed, src.spec.identity(), shuffle)
            for src, c in zip(sources, counts)
        ]
        self.names = [src.spec.name for src in sources]
        # The weights by step (``mix_points``: training.mix_schedule), from the sources' own.
        self.mix = MixByStep(self.names, [src.spec.weight for src in sources],
                             list(mix_points), seed)  # fmt: skip
        self.readers = [
            DocumentReader(src, order, tokenizer, bad_data)
            for src, order in zip(sources, self.orders)
        ]
        self._last = None  # the last advance: (its key, its result)
        # Per plan, per source: the units the plan's lanes finished (the last two plans',
        # and those planned ahead of the step read: ``planned_ahead``, the loader's).
        self._finishing: list[list[list]] = []
        self.planned_ahead = 0

    def __getstate__(self):
        return {**self.__dict__, "_last": None, "_finishing": []}

    @property
    def window_size(self) -> int:
        return self.seq_len + 1

    def start(self) -> Position:
        return Position(0, [Cursor() for _ in self.sources])

    def advance(self, position: Position, count: int, step: int = 0) -> tuple[list, Position]:
        """``(source, pieces)`` of the next ``count`` windows from ``position``, taken by
        ``step`` (whose weights choose their sources), grouped by the unit each starts in,
        and the position after them. Cost: O(count) and the counts of the units the lanes
        take; nothing read."""
        key = (position.windows, count, step, self.seq_len,
               tuple(tuple(c.to_list()) for c in position.cursors))  # fmt: skip
        if self._last is not None and self._last[0] == key:
            windows, after = self._last[1]
            return windows, after.copy()
        self._let_go_finished()
        chosen = self.mix.at(step).sources(position.windows, count).tolist()
        after = position.copy()
        after.windows += count
        w = self.window_size
        windows = [(s, self.orders[s].fill(after.cursors[s], w)) for s in chosen]
        # Grouped by the unit each starts in, in reading order: a rank's slice of a step
        # then reads a few units whole, not a window of every lane (each unit decoded, and
        # a document at a window boundary tokenized, by one rank, not by many). The step
        # holds the same windows on any layout; only who reads which follows this.
        windows.sort(key=_unit_first)
        # Every rank's plan walks the whole step: kept, the next rank's (a simulation of
        # many ranks in one process) costs a lookup.
        self._last = (key, (windows, after.copy()))
        self._finishing.append([order.take_finished() for order in self.orders])
        return windows, after

    def _let_go_finished(self):
        """Before planning a step: the units whose lanes the previous plan finished let go
        their measured tokens (that step is read: this process planned the next one), and
        their sidecars go a step later still (every process of the job plans every step;
        a loader worker or a rank a step behind may still read one). Every process does
        it, so one that measured a unit and read none of it lets go as well. A process that
        plans ``planned_ahead`` steps beyond the one it reads (the loader fetching ahead)
        lets go that many plans later: what is let go is what was read. Cost: one unlink a
        unit, a step later."""
        lag = self.planned_ahead
        if len(self._finishing) <= lag:
            return
        newest = self._finishing[-1 - lag]
        oldest = self._finishing.pop(0) if len(self._finishing) == 2 + lag else None
        for s, reader in enumerate(self.readers):
            reader.let_go(newest[s], oldest[s] if oldest is not None else [])

    def position_after(self, windows: int) -> Position:
        """The position ``windows`` windows from the start, at the weights of step 0 (tools
        and tests that need a far-along position). Cost: O(windows) arithmetic over the
        counts, nothing read."""
        position = self.start()
        while position.windows < windows:
            _, position = self.advance(position, min(4096, windows - position.windows))
        return position

    def window(self, source: int, pieces: list) -> tuple[np.ndarray, list[list]]:
        """``seq_len + 1`` tokens of ``source``'s ``pieces`` (int64), and their spans
        ``[source, doc_id, start, end, pass, unit]``. Cost: the documents they lie in,
        read and tokenized unless this process has them."""
        order, reader = self.orders[source], self.readers[source]
        parts, spans = [], []
        for pass_, _, u, lo, hi, unit in pieces:
            counts = order.counts.counts(unit, upto=hi)
            at = lo
            while at < hi:
                row, token = counts.row_at(at)
                doc_id, tokens = reader.document(unit, row, counts)
                take = min(hi - at, len(tokens) - token)
                if take <= 0:  # unreachable while the length check in DocumentReader holds
                    raise DataError(f"dataset {reader.name!r}: no token at {at} of unit {unit}")
                parts.append(tokens[token : token + take])
                spans.append([reader.name, doc_id, token, token + take, pass_, u])
                at += take
        window = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return window.astype(np.int64), spans

    def skipped_before(self, position: Position) -> int:
        """Documents skipped (unusable) before ``position``, over all sources."""
        return sum(o.skipped_before(c) for o, c in zip(self.orders, position.cursors))

    def epoch_starts(self, before: Position, after: Position) -> list[list]:
        """``[source, pass]`` of every pass (after the first) that began between the two."""
        out = []
        for order, a, b in zip(self.orders, before.cursors, after.cursors):
            first = a.pass_ + 1 if a.lanes else max(a.pass_, 1)
            last = b.pass_ if b.lanes else b.pass_ - 1
            out += [[order.name, p] for p in range(max(first, 1), last + 1)]
        return out


def _unit_first(window) -> tuple[int, int, int, int]:
    source, pieces = window
    pass_, k, _, start, _, _ = pieces[0]
    return source, pass_, k, start


def document_positions(spans: list[list], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per input token: its position in its document within this sequence (0 at every
    document start, and at the sequence start for a document continued from the
    previous one), and the index of its document in the sequence. From the spans alone:
    no tokenization. Positions stay below ``length``, whatever the document's size."""
    sizes = [end - start for _, _, start, end, *_ in spans]
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])[:length]
    document_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[:length]
    return positions, document_ids


def collate(samples: list[tuple[np.ndarray, list]], document_layout: bool = False) -> dict:
    """Stack the windows ``(tokens, spans)`` of a micro-batch; keep the ragged provenance
    spans as a list per sequence. ``input`` and ``label`` are views of one tensor over
    the windows (no copy of either).

    With ``document_layout`` (``model.attention_mask = "block_causal"`` or
    ``training.mask_document_boundaries``), also ``positions`` and ``document_ids``
    [B, T] of the inputs and ``label_document_ids`` [B, T] of the labels (views of one
    array over the window, as input and label are), from the spans; without it a batch
    carries no such tensors (no work).

    A loader worker sends windows, not batches: the rank collates them (loader.py).
    """
    windows = torch.from_numpy(np.stack([tokens for tokens, _ in samples]))
    batch = {"input": windows[:, :-1], "label": windows[:, 1:]}
    if document_layout:
        length = windows.shape[1] - 1
        layouts = [document_positions(spans, length + 1) for _, spans in samples]
        batch["positions"] = torch.from_numpy(np.stack([p[:length] for p, _ in layouts]))
        ids = torch.from_numpy(np.stack([d for _, d in layouts]))
        batch["document_ids"], batch["label_document_ids"] = ids[:, :-1], ids[:, 1:]
    batch["spans"] = [spans for _, spans in samples]
    return batch
