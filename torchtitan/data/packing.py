"""A document's tokens: ``[BOS] + text + [EOS]``, and the bad-document policy.

Owns: tokenizing a document (for a pretokenized source, framing its stored text ids
the same way, so the token stream is the one on-the-fly tokenization gives), the long
document path, and what makes a document unusable. The length index (index.py) and the
window reader (windows.py) both tokenize through ``document_tokens``, so the lengths
the order seeks by are the lengths the windows read.

Never: choose among sources, cut windows, or know about ranks and workers.
"""

from __future__ import annotations

import numpy as np

from torchtitan.data.spec import BadText, DataError
from torchtitan.data.tokenizer import split_lines

BAD_DATA_POLICIES = ("skip", "error")


def document_tokens(tokenizer, doc_id: str, value, source_name: str, bad_data: str):
    """A document's tokens (``[BOS] + text + [EOS]``, int32), or None when the ``skip``
    policy drops it (empty, whitespace-only, non-string or undecodable text). Under
    ``error`` such a document raises DataError naming it."""
    if bad_data not in BAD_DATA_POLICIES:
        raise DataError(f"bad_data policy {bad_data!r}: choose one of {BAD_DATA_POLICIES}")
    if isinstance(value, np.ndarray):  # a pretokenized document's text ids
        return frame_document(tokenizer, value)
    problem = document_problem(value)
    if problem is None:
        try:
            return encode_document(tokenizer, value)
        except (UnicodeError, TypeError, RuntimeError) as e:
            problem = f"cannot be tokenized ({e})"
    if bad_data == "error":
        raise DataError(
            f"document {doc_id!r} of dataset {source_name!r} {problem}; "
            "fix the data or set training.bad_data = 'skip' to skip and count such documents"
        )
    return None


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
