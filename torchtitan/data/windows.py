"""The token stream: windows of ``seq_len + 1`` tokens read at positions of the global order.

Owns: reading a window (``TokenStream.window``): from the source and token offset the
order gives it, the documents that hold those tokens, tokenized, and the provenance
span of every piece; the read-ahead and the few tokenized documents a process keeps;
where a given number of windows leaves the stream (``TokenStream.advance``); and the
check that a document still has the token count the length index holds (a stale index
would shift every later window, so it stops the run).

Window ``g`` of the job reads ``seq_len + 1`` tokens of source ``mix(g)``, at the
offset where that source's previous window ended. Which rank reads window ``g`` is the
loader's concern: any process can read any window, knowing only the position.

Never: touch torch.distributed, the DataLoader or checkpoint files; decide which rank
reads which window.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan.data.index import SourceIndex, source_units
from torchtitan.data.order import MixSchedule, SourceOrder
from torchtitan.data.packing import document_tokens
from torchtitan.data.spec import DataError

logger = logging.getLogger(__name__)


@dataclass
class Position:
    """Where the job's stream stands: windows taken, and each source's token offset
    (tokens read from its stream since the data started). The whole loader state."""

    windows: int = 0
    offsets: list[int] = field(default_factory=list)

    def copy(self) -> Position:
        return Position(self.windows, list(self.offsets))


READ_AHEAD = 16  # map-style documents read per call (a row at a time costs ~0.3 ms)


class DocumentReader:
    """One source's documents by position, read ahead in order, a few kept tokenized."""

    KEEP_RAW = 256  # map-style documents kept untokenized
    KEEP_TOKENS = 8

    def __init__(self, source, order: SourceOrder, tokenizer, bad_data: str):
        self.source, self.order = source, order
        self.tokenizer, self.bad_data = tokenizer, bad_data
        self.name = source.spec.name
        self._raw: OrderedDict[tuple[int, int], tuple] = OrderedDict()  # (epoch, row) -> doc
        self._tokens: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._units = None  # a streaming source's unit list (derived)
        self._held = None  # the streaming block last read

    def __getstate__(self):
        # A worker starts with no documents of its own process's reads.
        return {**self.__dict__, "_raw": OrderedDict(), "_tokens": OrderedDict(), "_held": None}

    def document(self, epoch: int, k: int, unit: int, row: int) -> tuple[str, np.ndarray]:
        """(doc_id, tokens) of ``row``, the ``k``-th unit of ``epoch``'s order."""
        key = (epoch, row)
        hit = self._tokens.get(key)
        if hit is not None:
            return hit
        if key not in self._raw:
            self._read(epoch, k, unit, row)
        doc_id, value = self._raw[key]
        tokens = document_tokens(self.tokenizer, doc_id, value, self.name, self.bad_data)
        expected = int(self.order.index.lengths[row])
        if (0 if tokens is None else len(tokens)) != expected:
            raise DataError(
                f"document {doc_id!r} of dataset {self.name!r} has "
                f"{0 if tokens is None else len(tokens)} tokens, the length index {expected}: "
                "the data or the tokenizer changed since the index was made; delete the "
                "cached index (training.length_index_dir) or resume with the original data"
            )
        self._tokens[key] = (doc_id, tokens)
        if len(self._tokens) > self.KEEP_TOKENS:
            self._tokens.popitem(last=False)
        return doc_id, tokens

    def _read(self, epoch: int, k: int, unit: int, row: int):
        if self.source.streaming:
            self._read_block(epoch, unit, row)
            return
        order = self.order.units_of(epoch)  # cached by the order, not the process-wide lru
        rows = [int(u) for u in order[k : k + READ_AHEAD]]
        for r, doc in zip(rows, self.source.documents(rows)):
            self._raw[(epoch, r)] = doc
            self._raw.move_to_end((epoch, r))
            if len(self._raw) > self.KEEP_RAW:
                self._raw.popitem(last=False)

    def _read_block(self, epoch: int, unit: int, row: int):
        """The rows of one streaming read from ``row`` on (to the end of its block, or of
        ``READ_BYTES`` of JSON lines), all kept, in place of the last read's: a reader
        holds one block, and reads on where the last read ended (a compressed file's
        stream stays open for it)."""
        if self._units is None:
            self._units = source_units(self.source)
        index = self.order.index
        lo, hi = index.rows(unit)
        # The decoded block stays held while its rows are read: a neighbouring row range
        # of the same row group decodes nothing.
        docs, _, self._held = self.source.read(self._units[unit], int(index.row_at[row]))
        self._raw = OrderedDict()
        if not docs:
            raise DataError(
                f"dataset {self.name!r}: unit {unit} has no document at row {row - lo}, which "
                "the length index holds: the data changed since the index was made; delete "
                "the cached index (training.length_index_dir)"
            )
        for i, (at, _, doc_id, value) in enumerate(docs[: hi - row]):
            if at != int(index.row_at[row + i]):
                raise DataError(
                    f"dataset {self.name!r}: a document of unit {unit} starts at {at}, the "
                    f"length index says {int(index.row_at[row + i])}: the data changed since "
                    "the index was made; delete the cached index (training.length_index_dir)"
                )
            self._raw[(epoch, row + i)] = (doc_id, value)


class TokenStream:
    """The job's windows: every source's stream, and the mix that interleaves them."""

    def __init__(self, sources: list, indexes: list[SourceIndex], tokenizer, seq_len: int, *,
                 seed: int = 0, shuffle: bool = True, bad_data: str = "skip"):  # fmt: skip
        if not sources:
            raise DataError(
                "no data source configured; set training.dataset or training.dataset_path"
            )
        for src, index in zip(sources, indexes):
            units = len(source_units(src))
            if index.units != units:
                raise DataError(
                    f"the length index of dataset {src.spec.where!r} holds {index.units} units, "
                    f"the data {units}: the data changed behind the cache; delete the cached "
                    "index (training.length_index_dir) to measure it again"
                )
        self.sources = sources
        self.seq_len = seq_len
        self.seed = seed
        self.orders = [
            SourceOrder(index, src.spec.name, seed, src._identity, shuffle)
            for src, index in zip(sources, indexes)
        ]
        self.names = [src.spec.name for src in sources]
        self.mix = MixSchedule([src.spec.weight for src in sources], seed)
        self.readers = [
            DocumentReader(src, order, tokenizer, bad_data)
            for src, order in zip(sources, self.orders)
        ]

    @property
    def window_size(self) -> int:
        return self.seq_len + 1

    def start(self) -> Position:
        return Position(0, [0] * len(self.sources))

    def advance(self, position: Position, count: int) -> tuple[np.ndarray, np.ndarray, Position]:
        """(source, offset) of the next ``count`` windows from ``position``, and the
        position after them. Cost: O(count), nothing read."""
        chosen = self.mix.sources(position.windows, count)
        offsets = np.zeros(count, dtype=np.int64)
        after = position.copy()
        after.windows += count
        w = self.window_size
        for s in range(len(self.sources)):
            mine = np.flatnonzero(chosen == s)
            offsets[mine] = position.offsets[s] + w * np.arange(len(mine), dtype=np.int64)
            after.offsets[s] += w * len(mine)
        return chosen, offsets, after

    def window(self, source: int, offset: int) -> tuple[np.ndarray, list[list]]:
        """``seq_len + 1`` tokens of ``source`` from ``offset`` (int64), and their spans
        ``[source, doc_id, start, end, epoch, unit]``. Cost: the documents they lie in,
        read and tokenized unless this process has them."""
        order, reader = self.orders[source], self.readers[source]
        need, parts, spans = self.window_size, [], []
        while need:
            epoch, k, unit, row, token = order.locate(offset)
            doc_id, tokens = reader.document(epoch, k, unit, row)
            take = min(need, len(tokens) - token)
            if take <= 0:  # unreachable while the length check in DocumentReader holds
                raise DataError(f"dataset {reader.name!r}: no token at offset {offset}")
            parts.append(tokens[token : token + take])
            spans.append([reader.name, doc_id, token, token + take, epoch, unit])
            offset += take
            need -= take
        window = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return window.astype(np.int64), spans

    def skipped_before(self, position: Position) -> int:
        """Documents skipped (unusable) before ``position``, over all sources."""
        return sum(o.skipped_before(off) for o, off in zip(self.orders, position.offsets))

    def epoch_starts(self, before: Position, after: Position) -> list[list]:
        """``[source, epoch]`` of every pass (after the first) that began between the two."""
        out = []
        for order, a, b in zip(self.orders, before.offsets, after.offsets):
            t = order.epoch_tokens
            first, last = max(1, -(-a // t)), -(-b // t) - 1
            out += [[order.name, e] for e in range(first, last + 1)]
        return out


def document_positions(spans: list[list], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per input token: its position in its document within this sequence (0 at every
    document start, and at the sequence start for a document continued from the
    previous one), and the index of its document in the sequence. From the spans alone:
    no tokenization. Positions stay below ``length``, whatever the document's size."""
    sizes = [end - start for _, _, start, end, *_ in spans]
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])[:length]
    document_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[:length]
    return positions, document_ids


def collate(samples: list[tuple[np.ndarray, list]], document_layout: bool = False,
            transfer: bool = False) -> dict:  # fmt: skip
    """Stack the windows ``(tokens, spans)`` of a micro-batch; keep the ragged provenance
    spans as a list per sequence.

    With ``document_layout`` (``model.attention_mask = "block_causal"`` or
    ``training.mask_document_boundaries``), also ``positions`` and ``document_ids``
    [B, T] of the inputs and ``label_document_ids`` [B, T] of the labels (views of one
    array over the window, as input and label are), from the spans; without it a batch
    carries no such tensors (no work, and nothing more for a worker to send).

    With ``transfer`` (in a loader worker) the arrays stay numpy arrays, under
    ``windows`` (inputs and labels in one), for ``as_tensors`` to turn into tensors in
    the main process without a copy. They then cross in the batch's one pickled message;
    a tensor would cross through shared memory, a file descriptor per tensor, which
    costs more than the tokens themselves for short sequences.
    """
    windows = np.stack([tokens for tokens, _ in samples])
    batch = {"windows": windows}  # input and label are views of it: one transfer
    if document_layout:
        length = windows.shape[1] - 1
        layouts = [document_positions(spans, length + 1) for _, spans in samples]
        batch["positions"] = np.stack([p[:length] for p, _ in layouts])
        batch["window_document_ids"] = np.stack([d for _, d in layouts])
    if not transfer:
        batch = as_tensors(batch)
    batch["spans"] = [spans for _, spans in samples]
    return batch


def as_tensors(batch: dict) -> dict:
    """A collated batch's arrays as tensors (no copy): ``windows`` becomes ``input`` and
    ``label``, and ``window_document_ids`` ``document_ids`` and ``label_document_ids``,
    each pair views of one tensor."""
    if "windows" in batch:
        windows = torch.from_numpy(batch.pop("windows"))
        batch["input"], batch["label"] = windows[:, :-1], windows[:, 1:]
    if "window_document_ids" in batch:
        ids = torch.from_numpy(batch.pop("window_document_ids"))
        batch["document_ids"], batch["label_document_ids"] = ids[:, :-1], ids[:, 1:]
    if "positions" in batch:
        batch["positions"] = torch.from_numpy(batch["positions"])
    return batch
