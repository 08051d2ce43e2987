"""Tokenizers: text <-> token ids, and the fingerprint of the files they are loaded from.

This module owns loading a tokenizer and the id conventions (bos, eos, pad) the rest
of the data pipeline relies on. Two kinds of file load, each through one small
backend behind the same `Tokenizer`: a SentencePiece ``.model`` and a
``tokenizer.json`` of the tokenizers library, as Llama 3-style models ship it (also a
folder holding one, with its ``tokenizer_config.json`` if present). The kind is told
by the file's content, not its name.

It never trains or edits a tokenizer (scripts/train_tokenizer.py does), never lets a
tokenizer add special tokens on its own (the pipeline adds BOS and EOS where it wants
them), and keeps no state beyond the loaded files, so encoding the same text always
gives the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import tokenizers

from torchtitan import REPO_ROOT
from torchtitan.config import resolve_path

DEFAULT_TOKENIZER_PATH = str(REPO_ROOT / "data" / "tokenizer" / "tokenizer.model")

# Data-loader workers are this pipeline's parallelism (as SentencePiece's num_threads=1
# says). A tokenizers thread pool used before a DataLoader forks its workers is turned
# off in each worker, with a warning per worker in many releases of the library; off
# from the start, nothing changes at the fork. Tokens never depend on it: set
# TOKENIZERS_PARALLELISM=true to let one process encode batches on several threads.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_FIX = (
    "set --model.tokenizer_path to a SentencePiece .model file or a tokenizer.json (or a "
    "folder holding one), or rebuild the bundled one with python scripts/train_tokenizer.py"
)
# Names the common model families give their BOS and EOS tokens; a tokenizer.json's
# added special tokens are searched for them when nothing else in its files says.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
# Text that crosses every newline trap: leading and repeated whitespace, tabs, blank
# lines, CRLF, a combining accent, a Unicode line separator.
_NEWLINE_PROBE = "  Leading spaces,\ttabs\n\nand\r\nCRLF;\n x\u0301\n\u2028end.\n \n"


class TokenizerError(ValueError):
    """The tokenizer file is missing or unreadable, or names no BOS/EOS token."""


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} does not exist; {_FIX}") from None
    except OSError as err:
        raise TokenizerError(f"tokenizer file {path} cannot be read: {err}; {_FIX}") from None


def split_lines(text: str) -> list[str]:
    """``text`` as its lines, each keeping its "\\n" (no empty last piece)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _lines_encode_like_the_whole(backend, text: str) -> bool:
    split = [t for ids in backend.encode_batch(split_lines(text)) for t in ids]
    return split == backend.encode_batch([text])[0]


# ---- SentencePiece ---------------------------------------------------------------------


def _load_processor(path: str, model: bytes, num_threads: int) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor(num_threads=num_threads)
    try:
        processor.LoadFromSerializedProto(model)
    except (RuntimeError, OSError) as err:
        raise TokenizerError(
            f"tokenizer file {path} is not a SentencePiece model: {err}; {_FIX}"
        ) from None
    return processor


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


class _SentencePiece:
    """A SentencePiece ``.model``; its BOS, EOS and pad are the model's own ids."""

    def __init__(self, path: str, model: bytes, num_threads: int):
        self._sp = _load_processor(path, model, num_threads)
        self.vocab_size: int = self._sp.vocab_size()
        # SentencePiece says -1 for an id the model does not have.
        self.bos_id, self.eos_id, self.pad_id = (
            i if i >= 0 else None for i in (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id())
        )
        self.splits_at_newlines: bool = _newline_is_a_boundary(model, self._sp)
        self.side_files: dict[str, bytes] = {}

    def token_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into C++ for the whole list: no per-text Python overhead.
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        # Control pieces (bos, eos, pad) decode to nothing.
        return self._sp.decode(ids)


# ---- tokenizer.json (the tokenizers library) -------------------------------------------


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _read_side_files(path: str) -> dict[str, bytes]:
    """The tokenizer_config.json next to a tokenizer.json, if any, by name."""
    side = Path(path).with_name("tokenizer_config.json")
    return {side.name: _read_file(str(side))} if side.is_file() else {}


def _parse_side_config(path: str, side_files: dict[str, bytes]) -> dict:
    if "tokenizer_config.json" not in side_files:
        return {}
    try:
        config = json.loads(side_files["tokenizer_config.json"])
    except ValueError as err:
        side = Path(path).with_name("tokenizer_config.json")
        raise TokenizerError(
            f"tokenizer config {side} is not JSON ({_one_line(err)}); fix or remove it"
        ) from None
    return config if isinstance(config, dict) else {}


def _config_token(config: dict, key: str) -> str | None:
    """``bos_token`` etc. of a tokenizer_config.json: a string or an AddedToken dict."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template_specials(processor: dict | None) -> tuple[str | None, str | None]:
    """The special tokens a TemplateProcessing puts before and after a single text."""
    if not processor:
        return None, None
    if processor.get("type") == "Sequence":
        found = [_template_specials(p) for p in processor.get("processors", [])]
        return (
            next((b for b, _ in found if b), None),
            next((e for _, e in found if e), None),
        )
    if processor.get("type") != "TemplateProcessing":
        return None, None
    single = processor.get("single", [])
    at = [i for i, piece in enumerate(single) if "Sequence" in piece]
    if not at:
        return None, None
    before = [p["SpecialToken"]["id"] for p in single[: at[0]] if "SpecialToken" in p]
    after = [p["SpecialToken"]["id"] for p in single[at[0] + 1 :] if "SpecialToken" in p]
    return (before[-1] if before else None), (after[0] if after else None)


def _isolates_newlines(step: dict) -> bool:
    return (
        step.get("type") == "Split"
        and step.get("pattern") in ({"String": "\n"}, {"Regex": "\n"}, {"Regex": "\\n"})
        and step.get("behavior") == "Isolated"
        and not step.get("invert")
    )


def _acts_on_each_piece(step: dict) -> bool:
    """A pre-tokenizer step whose output for a piece does not depend on what precedes it."""
    kind = step.get("type")
    if kind == "ByteLevel":
        return not step.get("add_prefix_space")
    return kind in ("Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit")


def _json_newline_is_a_boundary(spec: dict) -> bool:
    """Whether the tokenizer.json provably never lets a token or a pre-token span a "\\n".

    It does when there is no normalizer, the first pre-tokenizer step isolates every
    "\\n" as its own piece and the later steps act on each piece alone, and no added
    token spans a newline or strips whitespace around itself. Anything else is
    unproven, so False.
    """
    if spec.get("normalizer") is not None:
        return False
    for token in spec.get("added_tokens", []):
        content = token.get("content", "")
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
        if "\n" in content and content != "\n":
            return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or not _isolates_newlines(steps[0]):
        return False
    return all(_acts_on_each_piece(step) for step in steps[1:])


class _TokenizersJson:
    """A ``tokenizer.json`` of the tokenizers library, with its tokenizer_config.json.

    BOS and EOS come from tokenizer_config.json (``bos_token``, ``eos_token``), else
    from the post-processor's template around a single text, else from added special
    tokens with a common BOS/EOS name. Pad is tokenizer_config.json's ``pad_token`` or
    the padding the file sets up, if any. Special tokens written in a document are
    encoded as plain text, so no text can inject a BOS or EOS.
    """

    def __init__(self, path: str, data: bytes, side_files: dict[str, bytes]):
        self._path, self._data, self.side_files = path, data, side_files
        config = _parse_side_config(path, side_files)
        try:
            spec = json.loads(data)
            self._tk = tokenizers.Tokenizer.from_str(data.decode())
        except Exception as err:  # json's ValueError, or the library's plain Exception
            raise TokenizerError(
                f"tokenizer file {path} is not a tokenizer.json: {_one_line(err)}; {_FIX}"
            ) from None
        if (spec.get("model") or {}).get("dropout"):
            raise TokenizerError(
                f"tokenizer file {path} sets BPE dropout, so its tokens are random; "
                'set "dropout": null in its "model" section'
            )
        self._tk.encode_special_tokens = True
        vocab = self._tk.get_vocab(with_added_tokens=True)
        # One more than the largest id, so that every id has an embedding row.
        self.vocab_size: int = max(vocab.values()) + 1
        added_specials = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
        bos, eos = _template_specials(spec.get("post_processor"))
        bos = _config_token(config, "bos_token") or bos
        eos = _config_token(config, "eos_token") or eos
        bos = bos or next((n for n in _BOS_NAMES if n in added_specials), None)
        eos = eos or next((n for n in _EOS_NAMES if n in added_specials), None)
        pad = _config_token(config, "pad_token") or (self._tk.padding or {}).get("pad_token")
        self.bos_id, self.eos_id, self.pad_id = (
            self.token_id(t) if t else None for t in (bos, eos, pad)
        )
        self.splits_at_newlines: bool = _json_newline_is_a_boundary(
            spec
        ) and _lines_encode_like_the_whole(self, _NEWLINE_PROBE)

    def __reduce__(self):
        # The library's own pickling forgets encode_special_tokens: reload from the same
        # bytes, never from the files, which may have changed since.
        return _TokenizersJson, (self._path, self._data, self.side_files)

    def token_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into Rust for the whole list; each text is encoded on its own, so the
        # ids do not depend on the batch or on TOKENIZERS_PARALLELISM.
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=True)


# ---- the tokenizer the pipeline uses ---------------------------------------------------


def _tokenizer_file(path: str) -> str:
    """``path``, or the tokenizer.json inside it when it is a folder."""
    if not Path(path).is_dir():
        return path
    inside = Path(path) / "tokenizer.json"
    if not inside.is_file():
        raise TokenizerError(f"tokenizer folder {path} holds no tokenizer.json; {_FIX}")
    return str(inside)


def _is_json(data: bytes) -> bool:
    # A SentencePiece model is a binary protobuf; it never starts with "{".
    return data.lstrip()[:1] == b"{"


def _special_id(backend, path: str, role: str, token: str) -> int:
    """The id of the ``role`` ("bos" or "eos") token: ``token`` if given, else the file's."""
    key = f"model.{role}_token"
    if token:
        i = backend.token_id(token)
        if i is None:
            raise TokenizerError(
                f"{key} {token!r} is not a token of {path}; set it to one of its special "
                "tokens, or to '' to take it from the file"
            )
        return i
    i = getattr(backend, f"{role}_id")
    if i is None:
        raise TokenizerError(
            f"tokenizer file {path} names no {role.upper()} token; set --{key} to the "
            "token that marks a document's " + ("start" if role == "bos" else "end")
        )
    return i


class Tokenizer:
    """A SentencePiece ``.model`` or a ``tokenizer.json`` loaded from `path`.

    `path` may also be a folder holding a tokenizer.json. `bos_token` and `eos_token`
    (``model.bos_token``/``model.eos_token``) choose those tokens by their text; empty,
    they come from the file, and a file that names none is an error. `pad_id` is the
    file's pad token, or `eos_id` when it has none (the packer never pads, so it only
    matters to callers that do).

    Everything is loaded from the same bytes that `sha256()` hashes, so the fingerprint
    always describes the tokenizer in use even if the files change later.
    `num_threads` is how many threads one SentencePiece `encode_batch` call may use; the
    default of 1 suits data-loader workers, which already run in parallel. A
    tokenizer.json follows TOKENIZERS_PARALLELISM instead (false unless set, see above).
    """

    def __init__(
        self, path: str | Path, num_threads: int = 1, bos_token: str = "", eos_token: str = ""
    ):
        self.path = _tokenizer_file(str(path))
        data = _read_file(self.path)
        if _is_json(data):
            self._backend = _TokenizersJson(self.path, data, _read_side_files(self.path))
        else:
            self._backend = _SentencePiece(self.path, data, num_threads)
        self.vocab_size: int = self._backend.vocab_size
        self.bos_id: int = _special_id(self._backend, self.path, "bos", bos_token)
        self.eos_id: int = _special_id(self._backend, self.path, "eos", eos_token)
        pad_id = self._backend.pad_id
        self.pad_id: int = self.eos_id if pad_id is None else pad_id
        self.splits_at_newlines: bool = self._backend.splits_at_newlines
        self._sha256 = _fingerprint(data, self._backend.side_files, bos_token, eos_token)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(
        self, texts: list[str], bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        head, tail = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        return [[*head, *ids, *tail] for ids in self._backend.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; bos, eos, pad and the file's other special tokens decode to nothing."""
        if hasattr(ids, "tolist"):  # a torch tensor or numpy array
            ids = ids.tolist()
        special = {self.bos_id, self.eos_id, self.pad_id}
        return self._backend.decode([i for i in ids if i not in special])

    def sha256(self) -> str:
        """Hex digest of the tokenizer file's bytes, for checkpoint fingerprints.

        A tokenizer_config.json read beside it and a ``model.bos_token`` or
        ``model.eos_token`` that is set are folded in, since they change the ids too.
        """
        return self._sha256

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def _fingerprint(data: bytes, side_files: dict[str, bytes], bos_token: str, eos_token: str):
    digest = hashlib.sha256(data)
    # Each extra part is framed by its name and length, so no two different sets hash
    # alike; with none, the digest is the plain hash of the file.
    extras = sorted(side_files.items()) + [
        (key, token.encode())
        for key, token in (("model.bos_token", bos_token), ("model.eos_token", eos_token))
        if token
    ]
    for name, extra in extras:
        digest.update(f"\0{name}\0{len(extra)}\0".encode() + extra)
    return digest.hexdigest()


def build_tokenizer(model_cfg) -> Tokenizer:
    """The tokenizer the ``[model]`` config section names (``JobConfig.model``)."""
    return Tokenizer(
        resolve_path(model_cfg.tokenizer_path),
        bos_token=model_cfg.bos_token,
        eos_token=model_cfg.eos_token,
    )
