"""Documents from local files, read through Hugging Face ``datasets``.

Owns: resolving a registry name, file, folder or glob to a list of files (a Hub
dataset id, a Hub-style or ``save_to_disk`` folder through hub.py, a pretokenized
folder through pretokenized_read.py); opening them with ``datasets.load_dataset`` or
``load_from_disk`` (map-style) and reading documents by index. Streaming sources are
streaming.py's; ``open_source`` chooses between the two. The types every kind shares
are spec.py's (re-exported here: callers outside the package import them from here).

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

Never: tokenize, pack or know about ranks and workers.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path

from torchtitan import REPO_ROOT
from torchtitan.data import hub, pretokenized_read
from torchtitan.data.index import counts_key
from torchtitan.data.spec import (
    _FORMATS,
    DEFAULT_SPLIT,
    BadText,
    DataError,
    SourceSpec,
    Units,
    _data_suffix,
    check_column,
    is_remote,
    local_path,
    rows_per_unit,
    text_doc_id,
    token_arrays,
)
from torchtitan.data.streaming import StreamSource

__all__ = ["BadText", "DataError", "SourceSpec", "is_remote", "local_path",
           "text_doc_id", "token_arrays", "open_configured", "open_source", "resolve_source",
           "resolve_any", "source_kind"]  # fmt: skip

logger = logging.getLogger(__name__)


# Registry of bundled datasets: name -> folders (relative to the repo root).
DATASET_REGISTRY: dict[str, list[str]] = {
    "bundled": ["data/corpus/shakespeare", "data/corpus/milton", "data/corpus/kjv"],
    "shakespeare": ["data/corpus/shakespeare"],
    "milton": ["data/corpus/milton"],
    "kjv": ["data/corpus/kjv"],
}


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


def remote_root(url: str) -> str:
    """The folder a URL's files are named relative to (``source_root`` for a store): the
    URL itself where it is a folder, a file's folder, or the part before a wildcard."""
    if glob.has_magic(url):
        fixed = url[: min(url.find(c) for c in "*?[" if c in url)]
        return fixed.rsplit("/", 1)[0]
    fs, inner = _url_fs(url)
    return url.rstrip("/") if fs.isdir(inner) else url.rsplit("/", 1)[0]


def resolve_remote_files(url: str) -> list[str]:
    """A URL to an object, a prefix (searched recursively) or a glob -> sorted list of data
    files as URLs, as ``resolve_files`` does for a local path (the same formats, empty
    files and stray ``.json`` files skipped). Credentials and the endpoint come from the
    store's standard variables (``AWS_*``, ``AWS_ENDPOINT_URL``).

    Cost: one listing of the prefix (a request per 1,000 names: ~25 for FineWeb's ~25,000
    parquet objects), once per job on the rank that plans (plan.py)."""
    fs, inner = _url_fs(url)
    protocol = url.split("://", 1)[0]
    try:
        if glob.has_magic(inner):
            found = fs.glob(inner, detail=True)
        elif fs.isfile(inner):
            found = {inner: fs.info(inner)}
        else:
            found = fs.find(inner, detail=True)
    except (OSError, ValueError) as e:
        raise DataError(
            f"dataset path {url!r} cannot be listed ({type(e).__name__}: {e}); check the URL "
            "and the store's AWS_* variables"
        ) from None
    entries = {f"{protocol}://{k}": v for k, v in found.items() if v.get("type") != "directory"}
    data = {k: v for k, v in sorted(entries.items()) if _data_suffix(k) in _FORMATS}
    plain_json = [k for k in data if k.lower().endswith(".json")]
    if plain_json and len(plain_json) < len(data):  # beside other data: a tool's metadata
        logger.info("dataset path %r: not reading %s as data (beside other data files they "
                    "are taken for metadata)", url, plain_json[:5])  # fmt: skip
        data = {k: v for k, v in data.items() if k not in plain_json}
    if not data:
        raise DataError(
            f"dataset path {url!r} matches no data files ({', '.join(sorted(_FORMATS))}); "
            "set training.dataset_path to an existing object, prefix or glob"
        )
    nonempty = [k for k, v in data.items() if int(v.get("size") or 0) > 0]
    if not nonempty:
        raise DataError(f"dataset path {url!r} has only empty files; point it at data")
    if len(nonempty) < len(data):
        logger.warning("dataset path %r: skipping %d empty file(s)", url, len(data) - len(nonempty))
    return nonempty


def _url_fs(url: str):
    import fsspec

    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()  # a listing cached earlier in this process may be stale
    return fs, inner


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
    if path and is_remote(path):
        _check_no_parts(path, config, split)
        root = remote_root(path)
        return SourceSpec(
            name=name or root.rstrip("/").rsplit("/", 1)[-1] or "data",
            files=resolve_remote_files(path), weight=weight, root=root, location=path,
            named=bool(name),
        )  # fmt: skip
    if path:
        folder = local_path(path)
        if pretokenized_read.is_pretokenized(folder):
            _check_no_parts(path, config, split)
            return pretokenized_read.pretokenized_source(folder, name, weight, location=path)
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


READ_ROWS = 64  # map-style documents read per call (a row at a time costs ~0.3 ms)


def _load_kwargs(spec: SourceSpec) -> dict:
    # A plain-text file is one document, not one document per line.
    return {"sample_by": "document"} if spec.fmt == "text" else {}


class MapSource:
    """A map-style source: documents by index, through ``datasets`` (converted to Arrow,
    or a ``save_to_disk`` folder memory-mapped), read by units of rows as a streaming
    source is (the same protocol: ``extent``, ``units``, ``read``).

    A document is ``(doc_id, text)``, or ``(doc_id, int32 array)`` for a pretokenized
    source (``spec.tokens_field``; None where the text was unusable), read as Arrow,
    never as Python lists.
    """

    def __init__(self, spec: SourceSpec, text_field: str, id_field: str):
        datasets = hub.import_datasets()
        self.spec = spec
        self.text_field = text_field
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
        check_column(spec, self._field, self.ds.column_names)
        id_field = spec.id_field or id_field
        self.id_field = id_field if id_field in self.ds.column_names else None
        self._view = self.ds.select_columns(
            [self._field] + ([self.id_field] if self.id_field else [])
        )
        if spec.tokens_field:
            self._view = self._view.with_format("arrow")

    def __len__(self) -> int:
        return len(self.ds)

    # ---- what the plan and the token counts ask of the source kind -------------------
    @staticmethod
    def fingerprint_fields() -> dict:
        """What the data fingerprint records of how this kind reads its sources."""
        return {"streaming": False}

    @staticmethod
    def inspect(spec: SourceSpec, path: str, text_field: str, first: bool) -> None:
        """What the data plan keeps of one file: nothing (its rows are counted when the
        source is opened, and its column checked then). Cost: none."""
        return None

    def count_keys(self, source_fingerprint: dict, tokenizer_sha256: str, training) -> list[str]:
        """The one key of the source's token counts: its units are rows of all its files
        together, so its counts depend on every file (index.counts_key)."""
        files = len(self.spec.files)
        return [counts_key(source_fingerprint, files, list(range(files)), tokenizer_sha256,
                           training, self._field, "map")]  # fmt: skip

    # ---- the Source protocol (the same as a streaming source's) ----------------------
    def extent(self) -> int:
        """What the source holds now, in the measure a pass is cut by: its rows."""
        return len(self.ds)

    def units(self, extent: int | None = None) -> Units:
        """Row ranges ``(0, lo, hi)`` over the first ``extent`` rows (all by default), of
        ``spec.rows_per_unit`` rows (``spec.Units``). Cost: O(1)."""
        rows = len(self.ds) if extent is None else extent
        return Units([0], [0], [rows], [-(-rows // rows_per_unit(rows))] if rows else [0])

    def read(self, unit: tuple[int, int, int], at: int):
        """``(docs, next_at, None)``: up to ``READ_ROWS`` documents of ``unit`` from row
        ``at``, as ``(at, next_at, doc_id, value)``, and the row reading goes on at (None:
        the unit is done). Cost: one ``datasets`` read of those rows."""
        _, _, hi = unit
        stop = min(hi, at + READ_ROWS)
        if at >= stop:
            return [], None, None
        rows = range(at, stop)
        docs = [(r, r + 1, *doc) for r, doc in zip(rows, self.documents(rows))]
        return docs, (stop if stop < hi else None), None

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


def source_kind(training) -> type[MapSource] | type[StreamSource]:
    """The class that reads the configured sources (``training.streaming``): it answers
    for its kind to the data plan (``inspect``, ``fingerprint_fields``) and, opened, to
    the token counts (``count_keys``). This and the streaming module are the only readers
    of the flag: the rest of the data path asks the source."""
    return StreamSource if training.streaming else MapSource


def open_source(
    spec: SourceSpec, text_field: str, id_field: str, streaming: bool,
    block_rows: dict[int, list[int]] | None = None,
):  # fmt: skip
    """A source ready to read. ``block_rows``: a streaming source's per-file block rows
    from the data plan (then no file is opened here, and its units are cut without
    reading any footer); a map-style source has none."""
    if streaming:
        return StreamSource(spec, text_field, id_field, block_rows)
    return MapSource(spec, text_field, id_field)


def open_configured(spec: SourceSpec, training, block_rows: dict[int, list[int]] | None = None):
    """``open_source`` with the configured kind and fields."""
    return open_source(spec, training.text_field, training.id_field, training.streaming,
                       block_rows)  # fmt: skip


def resolve_any(source: str, config: str = "", split: str = DEFAULT_SPLIT) -> SourceSpec:
    """A registry name, a Hub dataset id or a local path, told apart as training does:
    an existing path is a path, a registry name or ``owner/name`` is a name."""
    if local_path(source).exists() or ("/" not in source and source not in DATASET_REGISTRY):
        return resolve_source(path=source, config=config, split=split)
    return resolve_source(name=source, config=config, split=split)
