"""The token buffer: documents of one cursor -> fixed-length windows of tokens.

Owns: tokenizing each document as ``[BOS] + text + [EOS]`` (for a pretokenized
source, framing its stored text ids the same way, so the token stream is the one
on-the-fly tokenization gives), cutting that token stream into windows, the
provenance span of every window, and the bad-document policy. Its state is the
position of the first token not yet emitted, ``(cursor, offset)``; the buffered tokens
are *derived* from it by re-tokenizing (or re-reading) one document on resume, so the
state stays a few bytes however long a document is.

Never: choose among sources or shards, or know about ranks and workers.
"""

from __future__ import annotations

import numpy as np

from torchtitan.data.sources import BadText, DataError
from torchtitan.data.tokenizer import split_lines

BAD_DATA_POLICIES = ("skip", "error")


# Consecutive passes without a usable document after which a shard counts as empty.
EMPTY_PASSES = 8


class EmptyShard(DataError):
    """A virtual shard whose documents are all unusable (a whole pass found none)."""


class DocumentPacker:
    """Cuts the documents of one cursor, in order, into windows of tokens.

    Every token of every document is emitted exactly once, in order; a window
    may span several documents. ``skipped`` counts documents dropped by the
    ``skip`` policy (empty, whitespace-only or non-string text).
    """

    def __init__(self, cursor, tokenizer, source_name: str, bad_data: str = "skip"):
        if bad_data not in BAD_DATA_POLICIES:
            raise DataError(f"bad_data policy {bad_data!r}: choose one of {BAD_DATA_POLICIES}")
        self.cursor = cursor
        self.tokenizer = tokenizer
        self.source_name = source_name
        self.bad_data = bad_data
        self.offset = 0  # tokens of the current document already emitted
        self.skipped = 0
        self.started_epoch: int | None = None
        self._tokens: np.ndarray | None = None
        self._doc_id: str | None = None

    def take(self, n: int) -> tuple[np.ndarray, list[list]]:
        """The next ``n`` tokens and their spans ``[source, doc_id, start, end, epoch, shard]``.

        ``started_epoch`` is then the epoch these tokens began, if they began one.
        """
        epoch = self.cursor.epoch
        parts, spans = [], []
        while n > 0:
            tokens = self._current_tokens()
            k = min(n, len(tokens) - self.offset)
            parts.append(tokens[self.offset : self.offset + k])
            spans.append([self.source_name, self._doc_id, self.offset, self.offset + k,
                          self.cursor.epoch, self.cursor.shard])  # fmt: skip
            self.offset += k
            n -= k
            if self.offset == len(tokens):
                self.cursor.advance()
                self.offset, self._tokens = 0, None
        self.started_epoch = self.cursor.epoch if self.cursor.epoch != epoch else None
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), spans

    def _current_tokens(self) -> np.ndarray:
        if self._tokens is not None:
            return self._tokens
        epoch_ends = 0
        while True:
            doc = self.cursor.current()
            if doc is None:
                # A shard's documents change with each epoch's order (a permutation of
                # documents, or of streaming units), so one pass without a usable document
                # does not make it empty: EMPTY_PASSES in a row do. A shard holding nothing
                # at all passes them without reading anything.
                epoch_ends += 1
                if epoch_ends > EMPTY_PASSES:
                    raise EmptyShard(
                        f"dataset {self.source_name!r} has no usable document in virtual shard "
                        f"{self.cursor.shard} of {self.cursor.num_shards}; lower "
                        "training.data_shards or add documents"
                    )
                self.cursor.next_epoch()
                continue
            doc_id, text = doc
            tokens = self._tokenize(doc_id, text)
            if tokens is not None:
                if self.offset >= len(tokens):
                    raise DataError(
                        f"restored position (token {self.offset}) lies past the end of document "
                        f"{doc_id!r} of dataset {self.source_name!r} ({len(tokens)} tokens): the "
                        "data changed since the checkpoint; resume with the original data"
                    )
                self._tokens, self._doc_id = tokens, doc_id
                return tokens
            self.skipped += 1
            self.cursor.advance()

    def _tokenize(self, doc_id: str, text) -> np.ndarray | None:
        if isinstance(text, np.ndarray):  # a pretokenized document's text ids
            return frame_document(self.tokenizer, text)
        problem = document_problem(text)
        if problem is None:
            try:
                return encode_document(self.tokenizer, text)
            except (UnicodeError, TypeError, RuntimeError) as e:
                problem = f"cannot be tokenized ({e})"
        if self.bad_data == "error":
            raise DataError(
                f"document {doc_id!r} of dataset {self.source_name!r} {problem}; "
                "fix the data or set training.bad_data = 'skip' to skip and count such documents"
            )
        return None

    def state_dict(self) -> dict:
        return {"cursor": self.cursor.state_dict(), "offset": self.offset, "skipped": self.skipped}

    def load_state_dict(self, state: dict):
        self.cursor.load_state_dict(state["cursor"])
        self.offset, self.skipped = int(state["offset"]), int(state["skipped"])
        self._tokens = self._doc_id = None


# Above this size a document is encoded line by line where the tokenizer proves that
# gives the same tokens (``Tokenizer.splits_at_newlines``): SentencePiece is ~5x slower
# on one huge string than on its lines. Tokens never depend on a document's length.
LONG_DOCUMENT_CHARS = 1 << 17


def encode_document(tokenizer, text: str) -> np.ndarray:
    """``[BOS] + encode(text) + [EOS]`` as int32."""
    if len(text) <= LONG_DOCUMENT_CHARS or not getattr(tokenizer, "splits_at_newlines", False):
        return np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype=np.int32)
    ids = [[tokenizer.bos_id], *tokenizer.encode_batch(split_lines(text)), [tokenizer.eos_id]]
    return np.concatenate([np.asarray(x, dtype=np.int32) for x in ids])


def frame_document(tokenizer, ids: np.ndarray) -> np.ndarray:
    """``[BOS] + ids + [EOS]`` as int32: what ``encode_document`` gives for the text whose
    ids these are."""
    out = np.empty(len(ids) + 2, dtype=np.int32)
    out[0], out[1:-1], out[-1] = tokenizer.bos_id, ids, tokenizer.eos_id
    return out


def document_problem(text) -> str | None:
    if isinstance(text, BadText):
        return text.reason
    if text is None:
        return "has no text (null)"
    if not isinstance(text, str):
        return f"has non-string text of type {type(text).__name__}"
    if not text.strip():
        return "is empty or whitespace-only"
    return None
