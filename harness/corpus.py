"""Corpora written for a test or a measurement: documents (``{"id", "text"}`` dicts) as
parquet or JSON lines files, the bundled text repeated to a size, and a folder built once.

Owns the one writer of each format that the tests and the benchmarks use. Never: the
bundled corpus itself (``scripts/build_corpus.py`` writes it, byte for byte), or a
reader (the product's sources read).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path


def chunks(docs: list, files: int) -> list[list]:
    """``docs`` cut into ``files`` runs in order, all but the last of equal length."""
    per_file = -(-len(docs) // files)
    return [docs[f * per_file : (f + 1) * per_file] for f in range(files)]


def write_jsonl(folder: Path, docs: list[dict], files: int = 2) -> Path:
    """``docs`` as JSON lines in ``files`` files ``part-NNN.jsonl`` of ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(chunks(docs, files)):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            out.writelines(json.dumps(doc) + "\n" for doc in part)
    return folder


def write_parquet(path: Path, docs: list[dict], row_group: int | None = None,
                  compression: str = "snappy") -> Path:  # fmt: skip
    """``docs`` as one parquet file at ``path``, in row groups of ``row_group`` rows
    (pyarrow's default where None)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(docs), path, row_group_size=row_group,
                   compression=compression)  # fmt: skip
    return path


def write_parquet_files(folder: Path, docs: list[dict], files: int, **kw) -> Path:
    """``docs`` as parquet in ``files`` files ``part-NNNNN.parquet`` of ``folder``
    (``write_parquet``'s keywords)."""
    for f, part in enumerate(chunks(docs, files)):
        write_parquet(folder / f"part-{f:05d}.parquet", part, **kw)
    return folder


def bundled_documents(name: str = "bundled", columns=("id", "text")) -> list[dict]:
    """The documents of a bundled source (``data/corpus``), in its files' order."""
    import pyarrow.parquet as pq

    from torchtitan.data.sources import resolve_source

    return pq.read_table(resolve_source(name=name).files, columns=list(columns)).to_pylist()


def repeated(docs: list[dict], size_mb: float) -> list[dict]:
    """``docs`` over and over, the copy ``c`` of a document with the id ``copy<c>/<id>``,
    until the text reaches ``size_mb`` MB (2^20 bytes of UTF-8)."""
    per_copy = sum(len(d["text"].encode()) for d in docs)
    copies = -(-int(size_mb * 2**20) // per_copy)
    return [{"id": f"copy{c}/{d['id']}", "text": d["text"]} for c in range(copies) for d in docs]


def built_once(folder: Path, key: str, build: Callable[[Path], dict]) -> dict:
    """``build(folder)``'s record of what it wrote, run once per ``key``: the record is
    kept in ``folder/DONE-<key>`` (JSON; no data file's suffix, so no source lists it);
    a folder without it (another key, or a build cut
    short) is emptied first, so ``folder`` must hold nothing else."""
    done = folder / f"DONE-{key}"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    record = build(folder)
    done.write_text(json.dumps(record))
    return record
