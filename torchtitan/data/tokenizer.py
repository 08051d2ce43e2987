"""SentencePiece tokenizer: text <-> token ids, and the fingerprint of the model file.

This module owns loading the tokenizer model and the id conventions (bos,
eos, pad) the rest of the data pipeline relies on. It never trains or edits a
model (scripts/train_tokenizer.py does) and keeps no state beyond the loaded
model, so encoding the same text always gives the same ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from torchtitan import REPO_ROOT

DEFAULT_TOKENIZER_PATH = str(REPO_ROOT / "data" / "tokenizer" / "tokenizer.model")

_FIX = (
    "set --model.tokenizer_path to a SentencePiece .model file, "
    "or rebuild it with python scripts/train_tokenizer.py"
)


class TokenizerError(ValueError):
    """The tokenizer model file is missing or unreadable."""


def _read_model(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} does not exist; {_FIX}") from None
    except OSError as err:
        raise TokenizerError(f"tokenizer file {path} cannot be read: {err}; {_FIX}") from None


def _load_processor(path: str, model: bytes, num_threads: int) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor(num_threads=num_threads)
    try:
        processor.LoadFromSerializedProto(model)
    except (RuntimeError, OSError) as err:
        raise TokenizerError(
            f"tokenizer file {path} is not a SentencePiece model: {err}; {_FIX}"
        ) from None
    return processor


def split_lines(text: str) -> list[str]:
    """``text`` as its lines, each keeping its "\\n" (no empty last piece)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _newline_is_a_boundary(model: bytes, processor: spm.SentencePieceProcessor) -> bool:
    """Whether encoding a text line by line gives exactly the tokens of the whole text.

    True when the model proves it: "\\n" is a user-defined piece (always one token, so
    no piece spans a newline), no dummy prefix is added at the start of each input,
    whitespace is not collapsed and normalization is the identity. A probe text is
    also encoded both ways as a check of that reasoning.
    """
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    norm = proto.normalizer_spec
    user_newline = any(
        p.piece == "\n" and p.type == sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
        for p in proto.pieces
    )
    if not user_newline or norm.add_dummy_prefix or norm.remove_extra_whitespaces:
        return False
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        return False
    probe = "  Leading spaces,\ttabs\n\nand\r\nCRLF;\n x\u0301\n\u2028end"
    split = [t for ids in processor.encode(split_lines(probe)) for t in ids]
    return split == processor.encode(probe)


class Tokenizer:
    """A SentencePiece model loaded from `path`.

    The model is loaded from the same bytes that `sha256()` hashes, so the
    fingerprint always describes the model in use even if the file changes
    later. `num_threads` is how many threads one `encode_batch` call may use;
    the default of 1 suits data-loader workers, which already run in parallel.
    """

    def __init__(self, path: str | Path, num_threads: int = 1):
        self.path = str(path)
        model = _read_model(self.path)
        self._sha256 = hashlib.sha256(model).hexdigest()
        self._sp = _load_processor(self.path, model, num_threads)
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.pad_id: int = self._sp.pad_id()
        self.splits_at_newlines: bool = _newline_is_a_boundary(model, self._sp)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return self._sp.encode(text, add_bos=bos, add_eos=eos)

    def encode_batch(
        self, texts: list[str], bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        # One call into C++ for the whole list: no per-text Python overhead.
        return self._sp.encode(list(texts), add_bos=bos, add_eos=eos)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; bos, eos and pad decode to nothing."""
        if hasattr(ids, "tolist"):  # a torch tensor or numpy array
            ids = ids.tolist()
        return self._sp.decode(list(ids))

    def sha256(self) -> str:
        """Hex digest of the model file's bytes, for checkpoint fingerprints."""
        return self._sha256

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"
