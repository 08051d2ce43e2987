"""Documents from local files, read through Hugging Face ``datasets``.

Owns: resolving a registry name, file, folder or glob to a list of files (a Hub
dataset id, a Hub-style or ``save_to_disk`` folder through hub.py, a pretokenized
folder through pretokenized.py); opening them with ``datasets.load_dataset`` or
``load_from_disk`` (map-style); and the per-epoch document order of one virtual
shard of a map-style source (a ``MapCursor``). Streaming sources and their cursors are
streaming.py's; ``open_source`` and ``make_cursor`` choose between the two. A cursor's
state is a *position* to seek to, never a count of items to replay.

A folder's kind is told by its signature, not by a file name another tool may also
write: a pretokenized manifest names its format, a ``save_to_disk`` folder has what
``load_from_disk`` requires, a Hub-style folder's README lists ``configs:``. Any other
folder is plain files, searched for data; there a ``.json`` file is data only as JSON
lines (this project reads ``.json`` as JSON lines, map-style and streaming) and only in
a folder with no data of another format: beside jsonl, parquet, text or Arrow files it
is a tool's metadata (stats.json, a stray manifest.json), and one whose first line is
not a JSON object (pretty-printed, or an array) is not JSON lines. Such files are
skipped, logged, and no part of the fingerprint. A file or a glob names its files as
given.

Never: tokenize, pack or know about ranks and workers (dataset.py does that).
"""

from __future__ import annotations

import glob
import hashlib
import json
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

_FORMATS = {
    ".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".arrow": "arrow",
}  # fmt: skip
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
        """What seeds this source's document order: its given name, or else its files'
        paths relative to the root and their sizes. Moving or re-mounting the data, or
        writing ./data for data, keeps it. Cost: one stat per file."""
        if self.order_identity:
            return self.order_identity
        if self.named:
            return f"name:{self.name}"
        listing = "\n".join(f"{self.relative_name(f)}\t{os.path.getsize(f)}" for f in self.files)
        return "files:" + hashlib.sha256(listing.encode()).hexdigest()[:16]

    def fingerprint(self, signatures: list[list] | None = None) -> list[list]:
        """Per file: its path relative to ``root``, size, and CRC32 of its first and last
        MiB (cheap, and any edit that moves bytes shows); then the ``stamps``. A remote
        file (a Hub URL) is named only: the revision stamp pins its bytes. ``signatures``
        (one per file, as ``signature`` gives them) are used as given: the ranks of a job
        sign a share each (see plan.py). Cost without them: O(files), 2 MiB read each."""
        if signatures is None:
            signatures = [[] if is_remote(f) else self.signature(f) for f in self.files]
        return [[self.relative_name(f), *sig] for f, sig in zip(self.files, signatures)] + [
            list(s) for s in self.stamps
        ]

    @staticmethod
    def signature(path: str) -> list:
        """[size, CRC32 of the first and the last MiB] of a local file. Cost: 2 MiB read."""
        return _file_signature(path)


def is_remote(path: str) -> bool:
    return "://" in path


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
    p = local_path(path)
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


def resolve_files(path: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob -> sorted list of data files."""
    p = local_path(path)
    if p.is_file():
        files = [str(p)]
    elif p.is_dir():
        files = _folder_data_files(p, path)
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


def _folder_data_files(folder: Path, path: str) -> list[str]:
    """The data files under a folder, searched recursively, without the ``.json`` files
    that are not data (see the module docstring). Cost: one small read per ``.json``
    file, where no other format is present."""
    found = [f for f in sorted(folder.rglob("*")) if _data_suffix(f) in _FORMATS and f.is_file()]
    plain_json = [f for f in found if f.suffix.lower() == ".json"]
    if len(plain_json) < len(found):
        skipped, why = plain_json, "beside other data files they are taken for metadata"
    else:
        skipped = [f for f in plain_json if not _starts_as_json_lines(f)]
        why = "their first line is not a JSON object, so they are not JSON lines"
    if skipped:
        names = [os.path.relpath(f, folder) for f in skipped]
        logger.info("dataset path %r: not reading %s as data (%s)", path, names[:5], why)
    skip = set(skipped)
    return [str(f) for f in found if f not in skip]


JSON_LINES_SNIFF = 1 << 16  # bytes read to see whether a .json file's first line is an object


def _starts_as_json_lines(path: Path) -> bool:
    """Whether a .json file's first line is a JSON object. An empty file counts (the
    empty-file check reports it), and so does a first line that starts an object but
    runs past the bytes read (a long document)."""
    with open(path, "rb") as f:
        head = f.read(JSON_LINES_SNIFF)
    text = head.lstrip()
    if not head:
        return True
    if not text.startswith(b"{"):
        return False
    line, newline, _ = text.partition(b"\n")
    if not newline and len(head) == JSON_LINES_SNIFF:
        return True
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def resolve_source(
    name: str = "", path: str = "", weight: float = 1.0, config: str = "",
    split: str = DEFAULT_SPLIT,
) -> SourceSpec:  # fmt: skip
    """A registry name, a Hub dataset id (``owner/name``), or a local path (optionally
    with a name of the user's) -> SourceSpec.

    A local folder may be a pretokenized corpus (a manifest.json of that format), a
    ``save_to_disk`` folder, laid out like a Hub dataset repository (README.md with
    ``configs:``), or plain files (see the module docstring);
    ``config`` and ``split`` choose part of the kinds that have them and must keep their
    defaults for the others. An unnamed path source is named after its root folder for
    provenance. Cost: a Hub id or Hub-style folder runs ``datasets``' resolution (for a
    Hub id, a few Hub requests).
    """
    from torchtitan.data import hub, pretokenized  # both build on this module

    if path:
        folder = local_path(path)
        if pretokenized.is_pretokenized(folder):
            _check_no_parts(path, config, split)
            return pretokenized.pretokenized_source(folder, name, weight, location=path)
        if hub.is_saved(folder):
            return hub.saved_source(folder, config, split, weight, location=path)
        if hub.is_hub_folder(folder):
            return hub.folder_source(folder, config, split, weight, location=path)
        _check_no_parts(path, config, split)
        root = source_root(path)
        return SourceSpec(
            name=name or Path(root).resolve().name or "data", files=resolve_files(path),
            weight=weight, root=root, location=path, named=bool(name),
        )  # fmt: skip
    if "/" in name:
        return hub.hub_source(name, config, split, weight)
    _check_no_parts(name, config, split)
    if name not in DATASET_REGISTRY:
        raise DataError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASET_REGISTRY)} "
            "or set training.dataset_path"
        )
    files = [f for folder in DATASET_REGISTRY[name] for f in resolve_files(str(REPO_ROOT / folder))]
    return SourceSpec(
        name=name, files=files, weight=weight, root=str(REPO_ROOT / "data" / "corpus")
    )


def _check_no_parts(where: str, config: str, split: str):
    if config:
        raise DataError(
            f"dataset {where!r} has no configs (it is not a Hub dataset or a folder whose "
            f"README.md lists configs), but config {config!r} is set; unset training.dataset_config"
        )
    if split != DEFAULT_SPLIT:
        raise DataError(
            f"dataset {where!r} has no splits (it is not a Hub dataset, a Hub-style folder or a "
            f"DatasetDict save_to_disk folder), but split {split!r} is set; unset "
            "training.dataset_split"
        )


def _load_kwargs(spec: SourceSpec) -> dict:
    # A plain-text file is one document, not one document per line.
    return {"sample_by": "document"} if spec.fmt == "text" else {}


def text_doc_id(text) -> str:
    """Stable id for a document without an id column: a hash of its text."""
    return hashlib.sha1(str(text).encode("utf-8", "surrogatepass")).hexdigest()[:16]


class MapSource:
    """A map-style source: documents by index, in a seeded order per epoch.

    A document is ``(doc_id, text)``, or ``(doc_id, int32 array)`` for a pretokenized
    source (``spec.tokens_field``; None where the text was unusable), read as Arrow,
    never as Python lists.
    """

    streaming = False

    def __init__(self, spec: SourceSpec, text_field: str, id_field: str, seed: int, shuffle: bool):
        import datasets

        self.spec = spec
        self.text_field = text_field
        self.seed = seed
        self.shuffle = shuffle
        self._identity = spec.identity()
        try:
            if spec.disk_path:  # memory-mapped where it lies; load_dataset would copy it
                self.ds = datasets.load_from_disk(spec.disk_path).with_format(None)
            else:
                self.ds = datasets.load_dataset(
                    spec.fmt, data_files=spec.files, split="train", **_load_kwargs(spec)
                )
        except Exception as e:  # noqa: BLE001 - re-raised with the dataset named
            raise DataError(f"dataset {spec.where!r} could not be read: {e!r}") from e
        if len(self.ds) == 0:
            raise DataError(f"dataset {spec.where!r} has no documents; point it at data")
        self._field = spec.tokens_field or text_field
        _check_column(spec, self._field, self.ds.column_names)
        id_field = spec.id_field or id_field
        self.id_field = id_field if id_field in self.ds.column_names else None
        self._view = self.ds.select_columns(
            [self._field] + ([self.id_field] if self.id_field else [])
        )
        if spec.tokens_field:
            self._view = self._view.with_format("arrow")

    def __len__(self) -> int:
        return len(self.ds)

    def document_count(self) -> int:
        return len(self.ds)

    def order(self, epoch: int) -> np.ndarray:
        return _epoch_order(len(self.ds), self.seed, self._identity, epoch, self.shuffle)

    def documents(self, indices: list[int]) -> list[tuple[str, object]]:
        """(doc_id, text) of several rows, read in one call (a row at a time costs ~0.3 ms)."""
        if self.spec.tokens_field:
            rows = self._view[[int(i) for i in indices]]
            ids = (rows.column(self.id_field).to_pylist() if self.id_field
                   else [f"row{i}" for i in indices])  # fmt: skip
            return list(zip(map(str, ids), token_arrays(rows.column(self._field))))
        try:
            rows = self._view[[int(i) for i in indices]]
        except UnicodeDecodeError:
            return [self.document(i) for i in indices]  # find the undecodable one
        ids = rows[self.id_field] if self.id_field else [f"row{i}" for i in indices]
        return [(str(d), t) for d, t in zip(ids, rows[self.text_field])]

    def document(self, index: int) -> tuple[str, object]:
        if self.spec.tokens_field:
            return self.documents([index])[0]
        try:
            row = self.ds[int(index)]
        except UnicodeDecodeError as e:
            return f"row{index}", BadText(f"is not valid UTF-8 ({e})")
        doc_id = str(row[self.id_field]) if self.id_field else f"row{index}"
        return doc_id, row[self.text_field]


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


@lru_cache(maxsize=8)
def _epoch_order(n: int, seed: int, identity: str, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    # zlib.crc32 rather than hash(): str hashes are salted per process.
    rng = np.random.default_rng([seed, zlib.crc32(identity.encode()), epoch])
    return rng.permutation(n)


def _check_column(spec: SourceSpec, text_field: str, columns: list[str]):
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


def open_source(
    spec: SourceSpec, text_field: str, id_field: str, seed: int, shuffle: bool, streaming: bool,
    documents: int | None = None, block_rows: dict[int, list[int]] | None = None,
):  # fmt: skip
    """A source ready to read. ``documents`` and ``block_rows``: a streaming source's
    document count and per-file block rows from the data plan (then no file is opened
    here, and its units are cut without reading any footer)."""
    if streaming:
        from torchtitan.data.streaming import StreamSource  # it builds on this module

        return StreamSource(spec, text_field, id_field, seed, shuffle, documents, block_rows)
    return MapSource(spec, text_field, id_field, seed, shuffle)


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


def make_cursor(source, shard: int, num_shards: int):
    if source.streaming:
        from torchtitan.data.streaming import StreamCursor

        return StreamCursor(source, shard, num_shards)
    return MapCursor(source, shard, num_shards)
