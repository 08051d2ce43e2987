"""The data plan: what a job's data is, resolved once per job and moved as a value.

Owns the steps that resolve the configured sources without any rank reading
everyone's bytes, and the value they produce (``DataPlan``):

1. ``list_sources`` (rank 0 only): registry names, paths, globs and Hub ids become
   file lists (a Hub id is resolved here, once, so every rank reads the same revision).
   Cost: O(files) names and sizes, no data read.
2. ``inspect_share`` (every rank): its share of the files, every ``world``-th from
   ``rank``: each one's signature (size, CRC32 of its first and last MiB) and what the
   source kind keeps of it (``inspect``: a streaming source's blocks' row counts from
   the footer, and a check that each source's first file has the text column). Cost:
   O(files / ranks) opens.
3. ``combine`` (rank 0 only): the data fingerprint and the block row counts of the job,
   from every share. Cost: O(files + blocks) small values, once.
4. ``check_shared_folder`` (every rank): whether every rank sees the token-count folder
   rank 0 sees; rank 0 warns, naming the folder and the ranks that do not (their counts
   are then measured again on their node). Cost: a small file written and looked for.

No token is counted here: the counts of a unit are measured when the order first
reaches it (index.py), so the plan costs the same on a corpus of any size, and nothing
of O(documents) moves between ranks.

``resolve_plan`` runs them where each belongs, moving the values between the ranks
through the small ``Ranks`` interface it is given (``parallel.JobRanks`` in a job; in
one process, ``OneProcess``, whose steps all run here): this module never touches
``torch.distributed``.

Never: tokenize (index.py measures), pack, or know about batches and checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from torchtitan.data import index as length_index
from torchtitan.data.pretokenized_read import check_tokenizer
from torchtitan.data.sources import DataError, SourceSpec, resolve_source, source_kind

logger = logging.getLogger(__name__)


@dataclass
class DataPlan:
    """The resolved sources, the fingerprint of what they hold, and what the source kind
    kept of their files (streaming: block row counts, which the sources are opened with):
    O(files + blocks) names and numbers."""

    specs: list[SourceSpec]
    fingerprint: dict
    # Per source, file -> rows of each block (streaming parquet, Arrow, text), so that
    # units are cut without any rank reading another rank's footers; empty where the
    # kind keeps none (map-style, JSON lines).
    block_rows: list[dict[int, list[int]]]


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


def held_out_sources(validation) -> list[SourceSpec]:
    """The held-out data's source (``validation.*``): a local path, or a registry name or
    Hub id, resolved as ``list_sources`` resolves training's."""
    v = validation
    if v.dataset_path:
        return [resolve_source(path=v.dataset_path, config=v.dataset_config, split=v.dataset_split)]
    return [resolve_source(name=v.dataset, config=v.dataset_config, split=v.dataset_split)]


def _files(specs: list[SourceSpec]) -> list[tuple[int, int]]:
    """Every (source, file) of the job, in one order all ranks share."""
    return [(s, f) for s, spec in enumerate(specs) for f in range(len(spec.files))]


def inspect_share(
    specs: list[SourceSpec], training, tokenizer, rank: int, world: int
) -> dict[tuple[int, int], tuple]:
    """This rank's share of the files: ``(source, file) -> (signature, rows)``.

    ``rows``: what the source kind keeps of the file (``inspect``; streaming: its blocks'
    row counts, None for JSON lines; map-style: None). Cost: every ``world``-th file,
    from ``rank``: one signature (2 MiB read; an object: one metadata request), and for a streaming source one footer.
    """
    kind = source_kind(training)
    for spec in specs:
        check_tokenizer(spec, tokenizer)
    share = {}
    for s, f in _files(specs)[rank::world]:
        spec, path = specs[s], specs[s].files[f]
        signature = spec.signature(path)
        share[(s, f)] = (signature, kind.inspect(spec, path, training.text_field, f == 0))
    return share


def combine(specs: list[SourceSpec], shares: list[dict], training, tokenizer,
            shuffle: bool | None = None) -> DataPlan:  # fmt: skip
    """The job's plan from every rank's share; its order is shuffled as ``shuffle`` says
    (``training.shuffle`` when None; the held-out data is read in order). Raises
    DataError if a file is missing from every share (a share lost on the way would
    otherwise go unnoticed)."""
    facts = {key: value for share in shares for key, value in share.items()}
    missing = [specs[s].files[f] for s, f in _files(specs) if (s, f) not in facts]
    if missing:
        raise DataError(f"no rank inspected {missing[:3]}: the data plan is incomplete")
    sources = []
    for s, spec in enumerate(specs):
        signatures = [facts[(s, f)][0] for f in range(len(spec.files))]
        sources.append({"name": spec.name, "identity": spec.identity(), "weight": spec.weight,
                        "files": spec.fingerprint(signatures)})  # fmt: skip
    block_rows = [
        {f: facts[(s, f)][1] for f in range(len(spec.files)) if facts[(s, f)][1] is not None}
        for s, spec in enumerate(specs)
    ]
    t = training
    fingerprint = {
        "sources": sources,
        "tokenizer_sha256": tokenizer.sha256(),
        "shuffle": t.shuffle if shuffle is None else shuffle,
        "seed": t.seed,
        **source_kind(t).fingerprint_fields(),
        "text_field": t.text_field,
    }
    return DataPlan(specs, fingerprint, block_rows)


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


def check_shared_folder(training, ranks: Ranks):
    """Rank 0 warns, naming the folder and the ranks, when some rank does not see the
    token-count folder rank 0 writes to (a node-local folder in a multi-node job: each
    node then measures the counts its ranks need itself; a bucket some node cannot
    reach). Cost: one small file (in a store: one PUT, a HEAD a rank, one DELETE)."""
    import uuid

    from torchtitan.io import storage

    if ranks.world == 1:
        return
    folder = length_index.cache_dir(training.length_index_dir)

    def mark() -> str:
        name = storage.join(folder, f".job-{uuid.uuid4().hex}")
        try:
            storage.makedirs(folder)
            storage.publish(name, lambda f: f.write(b"visible\n"))
        except OSError:
            return ""
        return name

    marker = ranks.on_main(mark)
    if not marker:
        return
    try:
        visible = storage.exists(marker)
    except OSError:  # a store this rank cannot reach (credentials, endpoint)
        visible = False
    seen = ranks.gather(visible)
    if ranks.rank == 0:
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            logger.warning(
                "token-count folder %s is not shared: ranks %s do not see what rank 0 writes "
                "there, so their nodes measure the counts again; set training.length_index_dir "
                "to a folder every node shares", folder, blind[:16],
            )  # fmt: skip
        storage.remove(marker)


def resolve_plan(training, tokenizer, ranks: Ranks | None = None, held_out=None) -> DataPlan:
    """The steps, each where it belongs: rank 0 lists the sources, every rank inspects
    its share of the files, rank 0 combines the shares; every rank checks that it sees
    the token-count folder. A DataError on any rank is raised on every rank (rank 0
    raises the first share's). Cost: O(files / ranks) file reads per rank, O(files +
    blocks) values moved; nothing of O(documents), and no token counted.

    ``held_out`` (the ``validation`` section): the plan of the held-out data instead,
    resolved the same way, read with training's settings and in order (unshuffled)."""
    ranks = ranks or OneProcess()
    if held_out is None:
        specs = ranks.on_main(list_sources, training)
    else:
        specs = ranks.on_main(held_out_sources, held_out)
    try:
        share = inspect_share(specs, training, tokenizer, ranks.rank, ranks.world)
    except DataError as e:
        share = e  # rank 0 raises it for every rank
    shuffle = None if held_out is None else False
    combined = _on_shares(combine, specs, ranks.gather(share))
    plan = ranks.on_main(combined, training, tokenizer, shuffle)
    if held_out is None:  # the held-out counts go to the same folder: checked once
        check_shared_folder(training, ranks)
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
