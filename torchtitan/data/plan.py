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
4. The length index of every source (index.py): ``cached_indexes`` (rank 0) reads the
   ones a start of this corpus and tokenizer already made; for the others
   ``measure_share`` (every rank) tokenizes every ``world``-th unit, and
   ``complete_indexes`` (rank 0) puts them together and caches them. Cost: O(documents
   / ranks) tokenization per rank on a corpus's first start, O(documents) integers
   moved on every start.

``resolve_plan`` runs the four where each belongs, moving the values between the ranks
through the small ``Ranks`` interface it is given (``parallel.JobRanks`` in a job; in
one process, ``OneProcess``, whose steps all run here): this module never touches
``torch.distributed``. After the plan a rank opens
only the files its own windows lie in (streaming; a map-style source's windows read
documents from every file, which ``datasets`` memory-maps).

Never: tokenize (index.py measures), pack, or know about batches and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torchtitan.data import index as length_index
from torchtitan.data.pretokenized_read import check_tokenizer
from torchtitan.data.sources import DataError, SourceSpec, is_remote, open_source, resolve_source


@dataclass
class DataPlan:
    """The resolved sources, the fingerprint of what they hold, and (streaming) their
    document counts (which the sources are opened with), then their length indexes.
    Small but for the indexes: O(files) names and numbers, O(documents) integers."""

    specs: list[SourceSpec]
    fingerprint: dict
    documents: list[int] | None  # per source; None for map-style (counted when opened)
    # Streaming: per source, file -> rows of each block (parquet, Arrow, text), so that
    # units are cut without any rank reading another rank's footers.
    block_rows: list[dict[int, list[int]]] | None = None
    # Per source, its documents' token counts (index.py); filled by the fourth step.
    indexes: list[length_index.SourceIndex] | None = None


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
        "shuffle": t.shuffle,
        "seed": t.seed,
        "streaming": t.streaming,
        "text_field": t.text_field,
    }
    return DataPlan(specs, fingerprint, documents, block_rows)


def _keys(plan: DataPlan, training) -> list[str]:
    sha = plan.fingerprint["tokenizer_sha256"]
    return [length_index.index_key(src, sha, training) for src in plan.fingerprint["sources"]]


def cached_indexes(plan: DataPlan, training) -> list:
    """Per source, its cached length index, or None where none is cached yet.
    Cost: O(documents) bytes read per cached source."""
    folder = length_index.cache_dir(training.length_index_dir)
    return [length_index.load_cached(folder, key) for key in _keys(plan, training)]


def _open(plan: DataPlan, s: int, training):
    t = training
    documents = plan.documents[s] if plan.documents else None
    rows = plan.block_rows[s] if plan.block_rows else None
    return open_source(plan.specs[s], t.text_field, t.id_field, t.streaming, documents, rows)


def measure_share(plan: DataPlan, found: list, training, tokenizer, rank: int, world: int) -> dict:
    """``(source, unit) -> (lengths, row_at)`` of this rank's share of the units of the
    sources with no index in ``found``: every ``world``-th unit, from ``rank``.
    Cost: those units read and tokenized, O(documents / ranks)."""
    share = {}
    for s, cached in enumerate(found):
        if cached is not None:
            continue
        source = _open(plan, s, training)
        mine = list(range(len(length_index.source_units(source))))[rank::world]
        # Rank 0 says how far it is (every rank measures a share of the same size).
        measured = length_index.measure(source, tokenizer, mine, training.bad_data, rank == 0)
        share.update({(s, u): v for u, v in measured.items()})
    return share


def _unit_count(plan: DataPlan, training, s: int) -> int:
    return len(length_index.source_units(_open(plan, s, training)))


def complete_indexes(plan: DataPlan, found: list, shares: list[dict], training) -> list:
    """Every source's index: the cached ones, and the rest from every rank's share,
    written to the cache for the next start. Raises DataError if a unit is missing."""
    folder = length_index.cache_dir(training.length_index_dir)
    keys = _keys(plan, training)
    measured: dict[int, dict] = {}
    for share in shares:
        for (s, u), value in share.items():
            measured.setdefault(s, {})[u] = value
    out = []
    for s, cached in enumerate(found):
        if cached is None:
            count = _unit_count(plan, training, s)
            cached = length_index.assemble(count, training.streaming, measured.get(s, {}))
            length_index.save_cached(folder, keys[s], cached)
        out.append(cached)
    return out


class Ranks(Protocol):
    """What resolving a plan needs of the job's ranks (``parallel.JobRanks`` over a
    process group; ``OneProcess`` alone): this rank and the world, ``on_main(fn,
    *args)`` (``fn`` run on rank 0, its result, or its error raised, on every rank) and
    ``gather(obj)`` (every rank's ``obj`` on rank 0, in rank order)."""

    rank: int
    world: int

    def on_main(self, fn, *args): ...

    def gather(self, obj) -> list: ...


class OneProcess:
    """The ranks of a job of one process: every step runs here."""

    rank, world = 0, 1

    def on_main(self, fn, *args):
        return fn(*args)

    def gather(self, obj) -> list:
        return [obj]


def resolve_plan(training, tokenizer, ranks: Ranks | None = None) -> DataPlan:
    """The four steps, each where it belongs: rank 0 lists the sources, every rank
    inspects its share of the files, rank 0 combines the shares; then the length index,
    measured in shares where it is not cached yet. A DataError on any rank is raised on
    every rank (rank 0 raises the first share's). Cost: O(files / ranks) file reads per
    rank; O(documents / ranks) tokenized per rank on a corpus's first start (at 1 M
    tokens/s per rank: c4/en's 156 B tokens about 5.4 h at 8 ranks, FineWeb's 15 T about
    4 h at 1,024 ranks); O(documents) integers moved on every start (365 M documents of
    c4: about 1.5 GB per rank)."""
    ranks = ranks or OneProcess()
    specs = ranks.on_main(list_sources, training)
    try:
        share = inspect_share(specs, training, tokenizer, ranks.rank, ranks.world)
    except DataError as e:
        share = e  # rank 0 raises it for every rank
    plan = ranks.on_main(_on_shares(combine, specs, ranks.gather(share)), training, tokenizer)
    found = ranks.on_main(cached_indexes, plan, training)
    if any(index is None for index in found):
        try:
            share = measure_share(plan, found, training, tokenizer, ranks.rank, ranks.world)
        except DataError as e:
            share = e
        complete = _on_shares(complete_indexes, plan, found, ranks.gather(share))
        found = ranks.on_main(complete, training)
    plan.indexes = found
    return plan


def _on_shares(combine_shares, *args):
    """``combine_shares(*args, shares, ...)`` that raises the first rank's DataError a
    share holds instead (so rank 0 raises it for every rank)."""
    *head, shares = args

    def combined(*rest):
        for share in shares:
            if isinstance(share, Exception):
                raise share
        return combine_shares(*head, shares, *rest)

    return combined


def local_plan(training, tokenizer) -> DataPlan:
    """``resolve_plan`` in one process (tests, tools, benchmarks)."""
    return resolve_plan(training, tokenizer, OneProcess())
