"""Writing a pretokenized corpus (see pretokenized_read.py for the format and reading it).

Owns: ``pretokenize``: a map-style source tokenized in parallel over fixed chunks of
rows, so the bytes written do not depend on the number of workers, with the manifest
tying the files to the tokenizer and to the source's identity (so training on it reads
the same order as on the original).

Never: add BOS/EOS to what it stores, or drop a document (a dropped row would shift
every index, and with them the order).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections import Counter
from pathlib import Path

import numpy as np

from torchtitan.data.packing import LONG_DOCUMENT_CHARS, document_problem, encode_document
from torchtitan.data.pretokenized_read import (
    CHUNK_DOCUMENTS,
    FILE_TOKENS,
    FORMAT,
    ID_COLUMN,
    MANIFEST,
    TOKENS_COLUMN,
)
from torchtitan.data.sources import MapSource
from torchtitan.data.spec import DataError, SourceSpec

logger = logging.getLogger(__name__)


# ---- writing ---------------------------------------------------------------------------

# A pool worker's source and tokenizer, set once by its initializer: the pool runs
# functions, and these are too heavy to send with every chunk.
_worker: dict = {}


def _init_worker(source: MapSource, tokenizer):
    _worker.update(source=source, tokenizer=tokenizer)


def _tokenize_chunk(bounds: tuple[int, int]) -> tuple:
    """Rows ``[a, b)`` -> (ids, offsets, token ids, null mask, unusable documents by reason)."""
    source, tokenizer = _worker["source"], _worker["tokenizer"]
    docs = source.documents(range(*bounds))
    problems: Counter = Counter()
    encoded: list[np.ndarray | None] = [None] * len(docs)
    short = []
    for i, (_, text) in enumerate(docs):
        problem = document_problem(text)
        if problem is not None:
            problems[problem.split(" (")[0]] += 1
        elif len(text) <= LONG_DOCUMENT_CHARS:
            short.append(i)
        else:
            encoded[i] = _encode_one(tokenizer, text, problems)
    try:
        for i, ids in zip(short, tokenizer.encode_batch([docs[i][1] for i in short])):
            encoded[i] = np.asarray(ids, dtype=np.int32)
    except (UnicodeError, TypeError, RuntimeError):  # find the one that fails
        for i in short:
            encoded[i] = _encode_one(tokenizer, docs[i][1], problems)
    lengths = [0 if t is None else len(t) for t in encoded]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([t for t in encoded if t is not None] or [np.zeros(0, np.int32)])
    nulls = np.array([t is None for t in encoded])
    return [d for d, _ in docs], offsets, values, nulls, problems


def _encode_one(tokenizer, text: str, problems: Counter) -> np.ndarray | None:
    """The text's ids as the packer would encode them (without its BOS/EOS), or None."""
    try:
        return encode_document(tokenizer, text)[1:-1]
    except (UnicodeError, TypeError, RuntimeError):
        problems["cannot be tokenized"] += 1
        return None


def pretokenize(
    spec: SourceSpec, tokenizer, output: str, *, text_field: str = "text",
    id_field: str = "id", workers: int = 0, chunk_documents: int = CHUNK_DOCUMENTS,
    file_tokens: int = FILE_TOKENS,
) -> dict:  # fmt: skip
    """Tokenize every document of ``spec`` into ``output``; returns the manifest.

    The source is read map-style, as training reads it (same rows, same ids). Chunks of
    ``chunk_documents`` rows are tokenized by ``workers`` processes (0: every core) and
    written in order, one parquet row group each; a file ends after the chunk that
    takes it past ``file_tokens`` tokens. Neither depends on ``workers``, so neither does
    a byte of the output. The manifest is written last: a folder without one is not a
    corpus. Cost: one pass over the corpus; memory O(chunk x workers).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if spec.tokens_field:
        raise DataError(f"dataset {spec.where!r} is pretokenized already; train on it directly")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise DataError(f"output folder {output!r} is not empty; choose a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    source = MapSource(spec, text_field, id_field)
    n = len(source)
    chunks = [(a, min(a + chunk_documents, n)) for a in range(0, n, chunk_documents)]
    workers = min(workers or available_cores(), len(chunks))
    schema = pa.schema([(ID_COLUMN, pa.string()), (TOKENS_COLUMN, pa.list_(pa.int32()))])
    files, problems, writer = [], Counter(), None
    with _chunk_results(source, tokenizer, chunks, workers) as results:
        for ids, offsets, values, nulls, chunk_problems in results:
            if writer is None:
                files.append({"path": f"tokens-{len(files):05d}.parquet", "documents": 0,
                              "tokens": 0})  # fmt: skip
                writer = pq.ParquetWriter(out / files[-1]["path"], schema, compression="zstd")
            tokens = pa.ListArray.from_arrays(
                pa.array(offsets.astype(np.int32)), pa.array(values), mask=pa.array(nulls)
            )
            writer.write_table(pa.table([pa.array(ids, pa.string()), tokens], schema=schema))
            files[-1]["documents"] += len(ids)
            files[-1]["tokens"] += int(offsets[-1])
            problems.update(chunk_problems)
            if files[-1]["tokens"] >= file_tokens:
                writer.close()
                writer = None
    if writer is not None:
        writer.close()
    manifest = {
        "format": FORMAT,
        "tokenizer": {
            "path": str(tokenizer.path),
            "sha256": tokenizer.sha256(),
            "vocab_size": tokenizer.vocab_size,
        },
        "source": {
            "name": spec.name,
            "identity": spec.identity(),
            "where": spec.where,
            "fingerprint": spec.fingerprint(),
            "text_field": text_field,
            "id_field": id_field,
        },
        "columns": {
            "id": ID_COLUMN,
            "tokens": TOKENS_COLUMN,
            "dtype": "int32",
            "bos_eos": "not stored; the packer adds them",
        },
        "documents": n,
        "tokens": sum(f["tokens"] for f in files),
        "unusable_documents": dict(sorted(problems.items())),
        "files": files,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def available_cores() -> int:
    """Cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _chunk_results:
    """The chunks' results in order: from a pool of ``workers`` processes, or in this
    process for one worker."""

    def __init__(self, source, tokenizer, chunks, workers):
        self.args, self.pool = (source, tokenizer, chunks, workers), None

    def __enter__(self):
        source, tokenizer, chunks, workers = self.args
        if workers <= 1:
            _init_worker(source, tokenizer)
            return map(_tokenize_chunk, chunks)
        # fork: the workers inherit the opened source instead of reopening it.
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else None)
        self.pool = context.Pool(workers, _init_worker, (source, tokenizer))
        return self.pool.imap(_tokenize_chunk, chunks)

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()
        _worker.clear()
