"""The data plan: what a job's data is, resolved once per job and moved as a value.

Owns the three steps that resolve the configured sources without any rank reading
everyone's bytes, and the value they produce (``DataPlan``):

1. ``list_sources`` (rank 0 only): registry names, paths, globs and Hub ids become
   file lists (a Hub id is resolved here, once, so every rank reads the same revision).
   Cost: O(files) names and sizes, no data read.
2. ``inspect_share`` (every rank): its share of the files, every ``world``-th from
   ``rank``: each one's signature (size, CRC32 of its first and last MiB) and, for a
   streaming source, its document count from the footer. Cost: O(files / ranks) opens.
   Rank 0 also checks that the first file has the text column.
3. ``combine`` (rank 0 only): the data fingerprint and the document counts of the job,
   from every share. Cost: O(files) small values, once.

``train.py`` moves the values between the ranks (a broadcast, a gather, a broadcast);
this module never touches ``torch.distributed``. A single process (tests, tools,
benchmarks) runs the three in a row with ``local_plan``. After the plan a rank opens
only the files its own shards read (streaming; a map-style source's shards read
documents from every file, which ``datasets`` memory-maps).

Never: tokenize, pack, or know about batches and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.data.pretokenized import check_tokenizer
from torchtitan.data.sources import DataError, SourceSpec, is_remote, resolve_source


@dataclass
class DataPlan:
    """The resolved sources, the fingerprint of what they hold, and (streaming) their
    document counts, for the automatic shard count. Small: O(files) names and numbers."""

    specs: list[SourceSpec]
    fingerprint: dict
    documents: list[int] | None  # per source; None for map-style (counted when opened)
    # Streaming: per source, file -> rows of each block (parquet, Arrow, text), so that
    # units are cut without any rank reading another rank's footers.
    block_rows: list[dict[int, list[int]]] | None = None


def list_sources(training) -> list[SourceSpec]:
    """The configured sources: a weighted mix, a local path, or a registry name or Hub id.

    Names label provenance, so two sources of a mix never share one.
    """
    t = training
    if t.datasets:
        specs = [resolve_source(d.name, d.path, d.weight, d.config, d.split) for d in t.datasets]
    elif t.dataset_path:
        specs = [
            resolve_source(path=t.dataset_path, config=t.dataset_config, split=t.dataset_split)
        ]
    else:
        specs = [resolve_source(name=t.dataset, config=t.dataset_config, split=t.dataset_split)]
    names = [s.name for s in specs]
    for i, spec in enumerate(specs):
        if names.count(spec.name) > 1:
            spec.name = f"{spec.name}#{i}"
    return specs


def _files(specs: list[SourceSpec]) -> list[tuple[int, int]]:
    """Every (source, file) of the job, in one order all ranks share."""
    return [(s, f) for s, spec in enumerate(specs) for f in range(len(spec.files))]


def inspect_share(
    specs: list[SourceSpec], training, tokenizer, rank: int, world: int
) -> dict[tuple[int, int], tuple]:
    """This rank's share of the files: ``(source, file) -> (signature, documents, rows)``.

    Streaming only: ``documents`` is the file's count (parquet and Arrow footers, an
    estimate for JSON lines) and ``rows`` its blocks' row counts (None for JSON lines).
    Cost: every ``world``-th file, from ``rank``: one signature read (2 MiB), and for a
    streaming source one footer.
    """
    from torchtitan.data.streaming import check_columns, inspect_file

    for spec in specs:
        check_tokenizer(spec, tokenizer)
    share = {}
    for s, f in _files(specs)[rank::world]:
        spec, path = specs[s], specs[s].files[f]
        signature = [] if is_remote(path) else spec.signature(path)
        documents, rows = inspect_file(spec, path) if training.streaming else (None, None)
        if training.streaming and f == 0:
            check_columns(spec, training.text_field)
        share[(s, f)] = (signature, documents, rows)
    return share


def combine(specs: list[SourceSpec], shares: list[dict], training, tokenizer) -> DataPlan:
    """The job's plan from every rank's share. Raises DataError if a file is missing
    from every share (a share lost on the way would otherwise go unnoticed)."""
    facts = {key: value for share in shares for key, value in share.items()}
    missing = [specs[s].files[f] for s, f in _files(specs) if (s, f) not in facts]
    if missing:
        raise DataError(f"no rank inspected {missing[:3]}: the data plan is incomplete")
    sources = []
    for s, spec in enumerate(specs):
        signatures = [facts[(s, f)][0] for f in range(len(spec.files))]
        sources.append({"name": spec.name, "identity": spec.identity(), "weight": spec.weight,
                        "files": spec.fingerprint(signatures)})  # fmt: skip
    documents = block_rows = None
    if training.streaming:
        documents = [
            sum(facts[(s, f)][1] for f in range(len(spec.files))) for s, spec in enumerate(specs)
        ]
        block_rows = [
            {f: facts[(s, f)][2] for f in range(len(spec.files)) if facts[(s, f)][2] is not None}
            for s, spec in enumerate(specs)
        ]
    t = training
    fingerprint = {
        "sources": sources,
        "tokenizer_sha256": tokenizer.sha256(),
        "seq_len": t.seq_len,
        "shuffle": t.shuffle,
        "seed": t.seed,
        "streaming": t.streaming,
        "text_field": t.text_field,
    }
    return DataPlan(specs, fingerprint, documents, block_rows)


def local_plan(training, tokenizer) -> DataPlan:
    """The three steps in one process (rank 0 of 1). Cost: O(files) opens."""
    specs = list_sources(training)
    return combine(specs, [inspect_share(specs, training, tokenizer, 0, 1)], training, tokenizer)
