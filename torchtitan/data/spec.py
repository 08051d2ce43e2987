"""What every kind of source shares: its spec, its errors, its order, its columns.

Owns: ``SourceSpec`` (a source's name, files, weight and identity, and the data's
fingerprint), ``DataError`` and ``BadText``, the seeded per-pass permutation every
order is built from (``epoch_order``), reading Arrow token columns, and the column
check. sources.py resolves and opens sources; streaming.py, hub.py and pretokenized_read.py
each handle a kind; all of them build on this module, which imports none of them (so
the data package has no import circle).

Never: resolve names or paths to files, open a source, or tokenize.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchtitan import REPO_ROOT
from torchtitan.io.storage import is_remote  # the one test of a URL (spec.is_remote for callers)

_FORMATS = {
    ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".arrow": "arrow",
}  # fmt: skip


# Rows per unit at most: the granule the global order shuffles and the token counts are
# measured and stored by. A fraction of a second of tokenizing for web documents, so a
# first start measures only the few units its first steps read (the lanes' first: 32 at
# most); c4's 365 M documents are ~1.4 M units, 10^9 documents ~3.9 M (the order keeps
# a pass's order, 8 bytes a unit, per process; units are computed from their blocks).
UNIT_ROWS = 256
# A file is cut into at least this many units (or one per row, if it has fewer), so a
# small corpus is shuffled too. Both rules look at one file alone: appending a file to a
# corpus changes no other file's units.
MIN_FILE_UNITS = 16


def rows_per_unit(rows: int) -> int:
    """Rows of a unit cut from a file (or a map-style dataset) of ``rows`` rows."""
    return max(1, min(UNIT_ROWS, -(-rows // MIN_FILE_UNITS)))


class Units:
    """A source's units ``(file, lo, hi)``, as blocks each cut into ``parts`` ranges of
    about equal size (``hi = -1``: to the file's end, one part). Unit ``u`` is computed
    when asked (a binary search over the blocks), so a source of 10^9 documents keeps
    O(blocks) integers, not O(units) tuples. Iterates as tuples."""

    def __init__(self, file, lo, hi, parts):
        self.file = np.asarray(file, dtype=np.int32)
        self.lo, self.hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
        self.parts = np.asarray(parts, dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(self.parts)])

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getitem__(self, u):
        if isinstance(u, slice):
            return [self[i] for i in range(*u.indices(len(self)))]
        u = int(u)
        if not 0 <= u < len(self):
            raise IndexError(u)
        b = int(np.searchsorted(self.first, u, side="right")) - 1
        f, lo, hi, parts = int(self.file[b]), int(self.lo[b]), int(self.hi[b]), int(self.parts[b])
        if parts == 1:
            return f, lo, hi
        j = u - int(self.first[b])
        return f, lo + (hi - lo) * j // parts, lo + (hi - lo) * (j + 1) // parts

    def __iter__(self):
        return (self[u] for u in range(len(self)))

    def files(self) -> np.ndarray:
        """The file of every unit (int32). Cost: 4 bytes a unit, made on each call."""
        return np.repeat(self.file, self.parts)

    def tolist(self) -> list[tuple[int, int, int]]:
        return list(self)

    @staticmethod
    def join(parts: list[Units]) -> Units:
        if not parts:
            return Units([], [], [], [])
        return Units(*(np.concatenate([getattr(p, k) for p in parts])
                       for k in ("file", "lo", "hi", "parts")))  # fmt: skip


# Compressed files (x.jsonl.gz, as Hub datasets such as C4 ship) are read by `datasets`.
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


DEFAULT_SPLIT = "train"


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

    ``tokens_field`` non-empty marks a pretokenized source: that column holds each
    document's text token ids (no BOS/EOS), and readers yield them as an int32 array in
    place of the text; ``id_field``, if set, is this source's id column whatever
    ``training.id_field`` says. ``disk_path`` is a ``save_to_disk`` folder, read
    map-style with ``load_from_disk`` (memory-mapped, no copy). ``order_identity``, if
    set, is the identity (a pretokenized corpus keeps its original's, so its order).
    ``tokenizer_sha256`` is the tokenizer a pretokenized corpus was made with.
    ``stamps`` are ``[what, value]`` pairs of the data's own fingerprint (a Hub
    revision, a ``save_to_disk`` fingerprint) that ``fingerprint()`` adds.
    """

    name: str
    files: list[str]
    weight: float = 1.0
    root: str = ""
    location: str = ""
    named: bool = True  # the name was given (registry, or name = ... in a mix)
    tokens_field: str = ""
    id_field: str = ""
    disk_path: str = ""
    order_identity: str = ""
    tokenizer_sha256: str = ""
    stamps: list[list] = field(default_factory=list)
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
        """What seeds this source's document order: its given name, or else its first
        file's path relative to the root and its size. Moving or re-mounting the data,
        writing ./data for data, or appending files keeps it. Cost: one stat."""
        if self.order_identity:
            return self.order_identity
        if self.named:
            return f"name:{self.name}"
        # The first file only: files appended to a corpus (which sort after it) keep the
        # order of its passes.
        first = self.files[0]
        size = remote_signature(first)[0] if is_remote(first) else os.path.getsize(first)
        listing = f"{self.relative_name(first)}\t{size}"
        return "files:" + hashlib.sha256(listing.encode()).hexdigest()[:16]

    def fingerprint(self, signatures: list[list] | None = None) -> list[list]:
        """Per file: its path relative to ``root``, size, and CRC32 of its first and last
        MiB (cheap, and any edit that moves bytes shows); then the ``stamps``. A file on
        the Hub (``hf://``) is named only: the revision stamp pins its bytes; another URL
        (``s3://``, ``gs://``, ...) is signed by its store (``signature``). ``signatures``
        (one per file, as ``signature`` gives them) are used as given: the ranks of a job
        sign a share each (see plan.py). Cost without them: O(files), 2 MiB read each."""
        if signatures is None:
            signatures = [self.signature(f) for f in self.files]
        return [[self.relative_name(f), *sig] for f, sig in zip(self.files, signatures)] + [
            list(s) for s in self.stamps
        ]

    @staticmethod
    def signature(path: str) -> list:
        """What shows a file's bytes changed: a local file's [size, CRC32 of the first and
        the last MiB] (2 MiB read); an object's [size, its store's tag] (one metadata
        request; ``remote_signature``); [] for a Hub file, whose revision stamp pins it."""
        if is_hub(path):
            return []
        return remote_signature(path) if is_remote(path) else _file_signature(path)


def is_hub(path: str) -> bool:
    return path.startswith("hf://")


def remote_signature(path: str) -> list:
    """[size, tag] of an object in a store, as its store describes it: the ETag (S3, R2,
    MinIO, GCS's S3 API), else a content checksum the file system reports (GCS's crc32c or
    md5, Azure's content MD5), else the CRC32 of its first and last MiB read by range. An
    object rewritten in place gets a new ETag even at the same size, so a changed object
    is refused by the data-change check, naming it (state.py).

    Cost: one HEAD request per file (the fallback: two ranged GETs, 2 MiB); each rank
    signs only its share of the files (plan.py), so a c4 of 1,024 objects on 64 ranks is
    16 requests a rank, FineWeb's ~25,000 parquet objects ~400. Credentials and the
    endpoint come from the store's standard variables (``AWS_*``, ``AWS_ENDPOINT_URL``)."""
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    try:
        info = fs.info(inner)
    except FileNotFoundError:
        raise DataError(
            f"dataset file {path} does not exist in its store; check the path"
        ) from None
    size = int(info.get("size") or 0)
    for key in ("ETag", "etag", "crc32c", "md5Hash", "content_md5", "checksum"):
        tag = info.get(key)
        if tag:
            return [size, key + ":" + str(tag).strip('"')]
    return [size, ends_crc(fs, inner, size)]


def ends_crc(fs, path: str, size: int) -> int:
    """CRC32 of the first and the last MiB of ``path`` in file system ``fs``, read by range
    (an object store's file without a tag). Cost: two ranged reads, 2 MiB."""
    crc = zlib.crc32(fs.cat_file(path, start=0, end=min(size, 1 << 20)))
    if size > 1 << 20:
        crc = zlib.crc32(fs.cat_file(path, start=max(1 << 20, size - (1 << 20)), end=size), crc)
    return crc


def _file_signature(path: str) -> list:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(1 << 20, size - (1 << 20)))
            crc = zlib.crc32(f.read(), crc)
    return [size, crc]


def local_path(path: str) -> Path:
    """``path`` as given, or under the repo root if only there."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    return p


def _data_suffix(path: str) -> str:
    """The suffix naming a file's format: ``.jsonl`` for ``x.jsonl.gz`` too."""
    p = Path(path)
    if p.suffix.lower() in _COMPRESSIONS:
        p = p.with_suffix("")
    return p.suffix.lower()


def _file_format(files: list[str], name: str) -> str:
    fmts = {_FORMATS.get(_data_suffix(f)) for f in files}
    if None in fmts or len(fmts) != 1:
        exts = sorted({Path(f).suffix for f in files})
        raise DataError(
            f"dataset {name!r}: files must all be one of {sorted(_FORMATS)}, got {exts}; "
            "point training.dataset_path at files of one supported format"
        )
    return fmts.pop()


def text_doc_id(text) -> str:
    """Stable id for a document without an id column: a hash of its text."""
    return hashlib.sha1(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def token_arrays(column) -> list[np.ndarray | None]:
    """Each row of an Arrow list<int> column as an int32 array (a view of one buffer),
    or None for a null row."""
    if hasattr(column, "combine_chunks"):  # a gather gives one chunk per row: join them once
        column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    nulls = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else None
    return [
        None if nulls is not None and nulls[i] else values[offsets[i] : offsets[i + 1]]
        for i in range(len(column))
    ]


def check_column(spec: SourceSpec, text_field: str, columns: list[str]):
    if spec.tokens_field and text_field not in columns:
        raise DataError(
            f"pretokenized dataset {spec.where!r} has no column {text_field!r} (columns: "
            f"{columns}); write it again with scripts/pretokenize.py"
        )
    if text_field not in columns:
        raise DataError(
            f"dataset {spec.where!r} has no column {text_field!r} (columns: {columns}); "
            "set training.text_field to the column that holds the text"
        )
