"""Documents from local files, read through Hugging Face ``datasets``.

Owns: resolving a registry name, file, folder or glob to a list of files; opening
them with ``datasets.load_dataset`` (map-style, or ``streaming=True``); and the
per-epoch document order of one virtual shard (a ``MapCursor`` or a
``StreamCursor``). A cursor's state is a *position* to seek to, never a count of
items to replay.

Never: tokenize, pack or know about ranks and workers (dataset.py does that).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from torchtitan import REPO_ROOT

logger = logging.getLogger(__name__)


# Registry of bundled datasets: name -> folders (relative to the repo root).
DATASET_REGISTRY: dict[str, list[str]] = {
    "bundled": ["data/corpus/shakespeare", "data/corpus/milton", "data/corpus/kjv"],
    "shakespeare": ["data/corpus/shakespeare"],
    "milton": ["data/corpus/milton"],
    "kjv": ["data/corpus/kjv"],
}

_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


class DataError(ValueError):
    """A dataset that cannot be read as configured; the message names it and the fix."""


@dataclass
class BadText:
    """Stands in for a document's text that could not be decoded, so policy can skip it."""

    reason: str


@dataclass
class SourceSpec:
    """One source of documents: a name (provenance, logs), its files and its weight.

    ``root`` is the folder the files are named relative to (the folder given, or the
    fixed part of a glob): ``a/000.parquet`` and ``b/000.parquet`` stay distinct.
    ``location`` is the path as the user wrote it (for messages only). The document
    order depends on ``identity()``, never on where the files are mounted.
    """

    name: str
    files: list[str]
    weight: float = 1.0
    root: str = ""
    location: str = ""
    named: bool = True  # the name was given (registry, or name = ... in a mix)
    fmt: str = field(init=False)

    def __post_init__(self):
        self.fmt = _file_format(self.files, self.where)

    @property
    def where(self) -> str:
        """How messages name the source: the path as given, else the name."""
        return self.location or self.name

    def relative_name(self, path: str) -> str:
        return os.path.relpath(path, self.root) if self.root else os.path.basename(path)

    def identity(self) -> str:
        """What seeds this source's document order: its given name, or else its files'
        paths relative to the root and their sizes. Moving or re-mounting the data, or
        writing ./data for data, keeps it. Cost: one stat per file."""
        if self.named:
            return f"name:{self.name}"
        listing = "\n".join(f"{self.relative_name(f)}\t{os.path.getsize(f)}" for f in self.files)
        return "files:" + hashlib.sha256(listing.encode()).hexdigest()[:16]

    def fingerprint(self) -> list[list]:
        """Per file: its path relative to ``root``, size, and CRC32 of its first and last
        MiB (cheap, and any edit that moves bytes shows). Cost: O(files), 2 MiB read each."""
        return [[self.relative_name(f), *_file_signature(f)] for f in self.files]


def _file_signature(path: str) -> list:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(1 << 20, size - (1 << 20)))
            crc = zlib.crc32(f.read(), crc)
    return [size, crc]


def source_root(path: str) -> str:
    """The folder a path's files are named relative to: the folder itself, a file's
    folder, or the part of a glob before its first wildcard."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if p.is_dir():
        return str(p)
    if p.is_file():
        return str(p.parent)
    fixed = []
    for part in Path(path).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."


def _file_format(files: list[str], name: str) -> str:
    fmts = {_FORMATS.get(Path(f).suffix.lower()) for f in files}
    if None in fmts or len(fmts) != 1:
        exts = sorted({Path(f).suffix for f in files})
        raise DataError(
            f"dataset {name!r}: files must all be one of {sorted(_FORMATS)}, got {exts}; "
            "point training.dataset_path at files of one supported format"
        )
    return fmts.pop()


def resolve_files(path: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob -> sorted list of data files."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if p.is_file():
        files = [str(p)]
    elif p.is_dir():
        files = [str(f) for f in sorted(p.rglob("*")) if f.suffix.lower() in _FORMATS]
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(
            f"dataset path {path!r} matches no data files ({', '.join(sorted(_FORMATS))}); "
            "set training.dataset_path to an existing file, folder or glob"
        )
    nonempty = [f for f in files if os.path.getsize(f) > 0]
    if not nonempty:
        raise DataError(f"dataset path {path!r} has only empty files; point it at data")
    if len(nonempty) < len(files):
        logger.warning(
            "dataset path %r: skipping %d empty file(s)", path, len(files) - len(nonempty)
        )
    return nonempty


def resolve_source(name: str = "", path: str = "", weight: float = 1.0) -> SourceSpec:
    """A registry name, or a local path (optionally with a name of the user's) -> SourceSpec.

    An unnamed path source is named after its root folder for provenance.
    """
    if path:
        root = source_root(path)
        return SourceSpec(
            name=name or Path(root).resolve().name or "data", files=resolve_files(path),
            weight=weight, root=root, location=path, named=bool(name),
        )  # fmt: skip
    if name not in DATASET_REGISTRY:
        raise DataError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASET_REGISTRY)} "
            "or set training.dataset_path"
        )
    files = [f for folder in DATASET_REGISTRY[name] for f in resolve_files(str(REPO_ROOT / folder))]
    return SourceSpec(
        name=name, files=files, weight=weight, root=str(REPO_ROOT / "data" / "corpus")
    )


def _load_kwargs(spec: SourceSpec) -> dict:
    # A plain-text file is one document, not one document per line.
    return {"sample_by": "document"} if spec.fmt == "text" else {}


def text_doc_id(text) -> str:
    """Stable id for a document without an id column: a hash of its text."""
    return hashlib.sha1(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:16]


class MapSource:
    """A map-style source: documents by index, in a seeded order per epoch."""

    streaming = False

    def __init__(self, spec: SourceSpec, text_field: str, id_field: str, seed: int, shuffle: bool):
        import datasets

        self.spec = spec
        self.text_field = text_field
        self.seed = seed
        self.shuffle = shuffle
        self._identity = spec.identity()
        try:
            self.ds = datasets.load_dataset(
                spec.fmt, data_files=spec.files, split="train", **_load_kwargs(spec)
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the dataset named
            raise DataError(f"dataset {spec.where!r} could not be read: {e!r}") from e
        if len(self.ds) == 0:
            raise DataError(f"dataset {spec.where!r} has no documents; point it at data")
        _check_column(spec, text_field, self.ds.column_names)
        self.id_field = id_field if id_field in self.ds.column_names else None
        self._view = self.ds.select_columns(
            [text_field] + ([self.id_field] if self.id_field else [])
        )

    def __len__(self) -> int:
        return len(self.ds)

    def document_count(self) -> int:
        return len(self.ds)

    def order(self, epoch: int) -> np.ndarray:
        return _epoch_order(len(self.ds), self.seed, self._identity, epoch, self.shuffle)

    def documents(self, indices: list[int]) -> list[tuple[str, object]]:
        """(doc_id, text) of several rows, read in one call (a row at a time costs ~0.3 ms)."""
        try:
            rows = self._view[[int(i) for i in indices]]
        except UnicodeDecodeError:
            return [self.document(i) for i in indices]  # find the undecodable one
        ids = rows[self.id_field] if self.id_field else [f"row{i}" for i in indices]
        return [(str(d), t) for d, t in zip(ids, rows[self.text_field])]

    def document(self, index: int) -> tuple[str, object]:
        try:
            row = self.ds[int(index)]
        except UnicodeDecodeError as e:
            return f"row{index}", BadText(f"is not valid UTF-8 ({e})")
        doc_id = str(row[self.id_field]) if self.id_field else f"row{index}"
        return doc_id, row[self.text_field]


@lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, identity: str, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    # zlib.crc32 rather than hash(): str hashes are salted per process.
    rng = np.random.default_rng([seed, zlib.crc32(identity.encode()), epoch])
    return rng.permutation(n)


def _check_column(spec: SourceSpec, text_field: str, columns: list[str]):
    if text_field not in columns:
        raise DataError(
            f"dataset {spec.where!r} has no column {text_field!r} (columns: {columns}); "
            "set training.text_field to the column that holds the text"
        )


class StreamSource:
    """A streaming source: files read in a seeded order per epoch, never fully loaded."""

    streaming = True

    def __init__(self, spec: SourceSpec, text_field: str, id_field: str, seed: int, shuffle: bool):
        self.spec = spec
        self.text_field = text_field
        self.id_field = id_field
        self.seed = seed
        self.shuffle = shuffle
        self._identity = spec.identity()
        self._opened: dict[int, object] = {}
        first = self.open(0)
        _check_column(spec, text_field, list(first.column_names or [text_field]))

    def open(self, epoch: int):
        """The HF IterableDataset of one epoch: the file order is the shuffled part.

        Opened once per epoch and shared by every shard's cursor (each splits it), so a
        start or a resume costs one ``load_dataset`` per source, not one per shard.
        """
        if epoch not in self._opened:
            self._opened = {e: d for e, d in self._opened.items() if e == epoch - 1}
            self._opened[epoch] = self._load(epoch)
        return self._opened[epoch]

    def _load(self, epoch: int):
        import datasets

        order = _epoch_order(len(self.spec.files), self.seed, self._identity, epoch, self.shuffle)
        files = [self.spec.files[i] for i in order]
        try:
            return datasets.load_dataset(
                self.spec.fmt,
                data_files=files,
                split="train",
                streaming=True,
                **_load_kwargs(self.spec),
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the dataset named
            raise DataError(f"dataset {self.spec.where!r} could not be read: {e!r}") from e

    def __getstate__(self):
        # Loader workers open their own: an opened stream is not worth pickling.
        return {**self.__dict__, "_opened": {}}

    def document_count(self) -> int:
        """Documents in the source without reading it: parquet footers' row counts; for
        text files one per file; for JSON lines a lower bound of one per file."""
        if self.spec.fmt == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.spec.files)
        return len(self.spec.files)

    def document_of(self, row: dict) -> tuple[str, object]:
        text = row.get(self.text_field)
        doc_id = row.get(self.id_field)
        return (str(doc_id) if doc_id is not None else text_doc_id(text)), text


def open_source(
    spec: SourceSpec, text_field: str, id_field: str, seed: int, shuffle: bool, streaming: bool
):
    cls = StreamSource if streaming else MapSource
    return cls(spec, text_field, id_field, seed, shuffle)


READ_AHEAD = 8  # documents a map-style cursor reads per call


class MapCursor:
    """Position of one virtual shard in a map-style source: (epoch, index into the shard).

    Shard ``v`` of ``V`` reads documents ``order(epoch)[v::V]``; a position is a seek.
    """

    def __init__(self, source: MapSource, shard: int, num_shards: int):
        self.source = source
        self.shard = shard
        self.num_shards = num_shards
        self.epoch = 0
        self.pos = 0
        self._ahead: dict[tuple[int, int], tuple[str, object]] = {}

    def shard_size(self) -> int:
        n = len(self.source)
        return max(0, (n - self.shard + self.num_shards - 1) // self.num_shards)

    def current(self) -> tuple[str, object] | None:
        """The document at the cursor, or None at the end of the epoch."""
        if self.pos >= self.shard_size():
            return None
        key = (self.epoch, self.pos)
        if key not in self._ahead:
            # Read the next few documents of this shard together; they are derived
            # from the position, so they are never part of the state.
            stop = min(self.pos + READ_AHEAD, self.shard_size())
            order = self.source.order(self.epoch)
            indices = [order[self.shard + p * self.num_shards] for p in range(self.pos, stop)]
            docs = self.source.documents(indices)
            self._ahead = {(self.epoch, p): d for p, d in zip(range(self.pos, stop), docs)}
        return self._ahead[key]

    def advance(self):
        self.pos += 1

    def next_epoch(self):
        self.epoch += 1
        self.pos = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict):
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class StreamCursor:
    """Position of one virtual shard in a streaming source.

    The position is the HF ``IterableDataset.state_dict()`` *before* the current
    document, so a resume re-reads that one document and nothing earlier. The state
    is read only after a ``next()`` has run: right after ``load_state_dict`` HF still
    reports the initial state until the first example is read, and saving that would
    silently restart the data from zero on the second resume.
    """

    def __init__(self, source: StreamSource, shard: int, num_shards: int):
        self.source = source
        self.shard = shard
        self.num_shards = num_shards
        self.epoch = 0
        self.pos = None  # HF state before the current document; None = start of epoch
        self._ds = None
        self._it = None
        self._current = None
        self._exhausted = False

    def _open(self):
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(
            self.source.open(self.epoch), rank=self.shard, world_size=self.num_shards
        )
        if self.pos is not None:
            ds.load_state_dict(self.pos)
        self._ds, self._it = ds, iter(ds)
        self._current, self._exhausted = None, False

    def current(self) -> tuple[str, object] | None:
        if self._exhausted:
            return None
        if self._current is None:
            if self._it is None:
                self._open()
            try:
                row = next(self._it)
            except StopIteration:
                self._exhausted = True
                return None
            except UnicodeDecodeError as e:
                # The reader cannot continue past it, so this one cannot be skipped.
                raise DataError(
                    f"dataset {self.source.spec.where!r} has invalid UTF-8 ({e}); fix the file "
                    "(e.g. iconv -c -f utf-8 -t utf-8), or read it map-style (training.streaming "
                    "false), which skips and counts such documents"
                ) from e
            self._current = self.source.document_of(row)
        return self._current

    def advance(self):
        # The state after the current document is the position of the next one.
        self.pos = self._ds.state_dict()
        self._current = None

    def next_epoch(self):
        self.epoch += 1
        self.pos = None
        self._ds = self._it = None
        self._current, self._exhausted = None, False

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict):
        self.epoch, self.pos = int(state["epoch"]), state["pos"]
        self._ds = self._it = None
        self._current, self._exhausted = None, False


def make_cursor(source, shard: int, num_shards: int):
    cls = StreamCursor if source.streaming else MapCursor
    return cls(source, shard, num_shards)
