"""Pretokenized corpora: a source tokenized once into parquet shards of token ids, with a
manifest tying them to the tokenizer and to the source they came from.

A folder holds ``manifest.json`` and ``tokens-00000.parquet``, ... with the columns
``id`` (string) and ``tokens`` (list<int32>: the text's token ids, without BOS/EOS;
null where the text was unusable). The rows keep the original's map-style order and
document ids, and the source keeps the original's identity, so training on it reads
the same documents in the same order as tokenizing the original on the
fly, and yields the same batches and provenance: BOS/EOS are added to stored ids
exactly as to encoded text (packing.py), and a null row is skipped as unusable text is.

Owns: recognizing such a folder (``pretokenized_source``), refusing another tokenizer
(``check_tokenizer``), and the stored document lengths (``stored_lengths``, for the
provenance check). Writing one is pretokenized_write.py's.

Never: add BOS/EOS to what it stores, or drop a document (a dropped row would shift
every index, and with them the order).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torchtitan.data.spec import DataError, SourceSpec

logger = logging.getLogger(__name__)

FORMAT = "torchtitan-pretokenized/v1"
FORMAT_KIND = FORMAT.rsplit("/", 1)[0] + "/"  # any version of the format
MANIFEST = "manifest.json"
ID_COLUMN, TOKENS_COLUMN = "id", "tokens"
CHUNK_DOCUMENTS = 1024  # documents per task and per parquet row group
FILE_TOKENS = 1 << 26  # a file is closed after the chunk that brings it past this many


def is_pretokenized(folder: Path) -> bool:
    """A folder whose manifest.json names this kind's format, in any version (an older
    one is refused by ``read_manifest``); a manifest.json of another tool's is not one."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    return isinstance(fmt, str) and fmt.startswith(FORMAT_KIND)


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"pretokenized dataset {str(folder)!r}: {MANIFEST} cannot be read ({e}); write it "
            "again with scripts/pretokenize.py"
        ) from None
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"pretokenized dataset {str(folder)!r} has format {manifest.get('format')!r}, this "
            f"version reads {FORMAT!r}; write it again with scripts/pretokenize.py"
        )
    return manifest


def pretokenized_source(
    folder: Path, name: str = "", weight: float = 1.0, location: str = ""
) -> SourceSpec:
    """A pretokenized folder -> a source that reads its token ids, with the original's
    name (unless one is given) and order identity. Cost: reading the manifest."""
    manifest = read_manifest(folder)
    files = [str(folder / f["path"]) for f in manifest["files"]]
    missing = [f["path"] for f in manifest["files"] if not (folder / f["path"]).is_file()]
    if missing:
        raise DataError(
            f"pretokenized dataset {location or str(folder)!r} is missing {missing[:3]} that "
            f"its {MANIFEST} lists; copy the whole folder, or write it again"
        )
    origin = manifest["source"]
    return SourceSpec(
        name=name or origin["name"], files=files, weight=weight, root=str(folder),
        location=location or str(folder), tokens_field=TOKENS_COLUMN, id_field=ID_COLUMN,
        order_identity=origin["identity"], tokenizer_sha256=manifest["tokenizer"]["sha256"],
    )  # fmt: skip


def check_tokenizer(spec: SourceSpec, tokenizer):
    """Refuse a pretokenized source made with another tokenizer than ``tokenizer``."""
    if not spec.tokenizer_sha256 or spec.tokenizer_sha256 == tokenizer.sha256():
        return
    made_with = read_manifest(Path(spec.root))["tokenizer"]["path"]
    raise DataError(
        f"pretokenized dataset {spec.where!r} was made with tokenizer {made_with} (sha256 "
        f"{spec.tokenizer_sha256[:12]}), training uses {tokenizer.path} (sha256 "
        f"{tokenizer.sha256()[:12]}); set --model.tokenizer_path to the one it was made with, "
        f"or pretokenize again with --tokenizer {tokenizer.path}"
    )


def stored_lengths(spec: SourceSpec) -> dict[str, int]:
    """{document id: tokens with BOS/EOS} of every usable document, from the stored
    token lists: no tokenizing. Cost: O(corpus) read, one file at a time."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = {}
    for f in spec.files:
        table = pq.read_table(f, columns=[spec.id_field, spec.tokens_field])
        lengths = pc.list_value_length(table[spec.tokens_field]).to_pylist()
        out.update(
            (str(d), n + 2)
            for d, n in zip(table[spec.id_field].to_pylist(), lengths)
            if n is not None
        )
    return out
