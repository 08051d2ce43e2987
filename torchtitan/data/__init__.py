"""The data path: sources -> length index -> global order -> windows -> steps -> batches.

``build_dataloader`` turns the config into a ``ParallelDataLoader`` for one
data-parallel rank; the data plan's fingerprint (``plan.combine``) records what the
data stream depends on. Modules, none importing its caller: sources (files, documents
by index), streaming (units, blocks), index (token counts), order (the global order,
the mix), packing (a document's tokens), windows (the windows a position reads),
schedule (the global batch of a step and its split), loader (steps, ranks, state),
plan (one resolution per job), checks (the config's data rules).
"""

from __future__ import annotations

import os

from torchtitan.data import index as length_index
from torchtitan.data.loader import ParallelDataLoader
from torchtitan.data.packing import document_problem, encode_document
from torchtitan.data.plan import (
    DataPlan,
    Ranks,
    combine,
    inspect_share,
    list_sources,
    local_plan,
    resolve_plan,
)
from torchtitan.data.pretokenized_read import check_tokenizer, stored_lengths
from torchtitan.data.schedule import BatchSchedule
from torchtitan.data.sources import DataError, SourceSpec, open_configured
from torchtitan.data.windows import Position, TokenStream

__all__ = [
    "BatchSchedule",
    "DataError",
    "DataPlan",
    "Position",
    "combine",
    "inspect_share",
    "list_sources",
    "local_plan",
    "ParallelDataLoader",
    "TokenStream",
    "build_dataloader",
    "build_validation_loader",
    "build_stream",
    "document_lengths",
    "source_specs",
]


def source_specs(training) -> list[SourceSpec]:
    """The configured sources, resolved in this process (see ``plan.list_sources``)."""
    return list_sources(training)


def build_stream(training, tokenizer, plan: DataPlan | None = None,
                 scheduled: bool = True) -> TokenStream:  # fmt: skip
    """The job's token stream over the plan's sources (resolved in this process when no
    plan is given), with each source's token counts read from, or measured into,
    ``training.length_index_dir``, mixed by ``training.mix_schedule`` where
    ``scheduled`` (the held-out data is not). Cost: opening the sources (a map-style one is
    memory-mapped by ``datasets``; a streaming one opens no file until a window reads it);
    no token is counted until a window needs it."""
    t = training
    plan = plan or local_plan(t, tokenizer)
    sources = [open_configured(s, t, rows) for s, rows in zip(plan.specs, plan.block_rows)]
    folder = length_index.cache_dir(t.length_index_dir)
    log = int(os.environ.get("RANK", "0")) == 0
    sha = plan.fingerprint["tokenizer_sha256"]
    counts = []
    for source, entry in zip(sources, plan.fingerprint["sources"]):
        keys = source.count_keys(entry, sha, t)
        counts.append(length_index.SourceCounts(
            source, tokenizer, t.bad_data, folder, keys, t.length_index_wait_seconds, log))  # fmt: skip
    points = [(p.step, p.weights, p.ramp) for p in t.mix_schedule] if scheduled else []
    return TokenStream(sources, counts, tokenizer, t.seq_len, seed=t.seed,
                       shuffle=plan.fingerprint["shuffle"], bad_data=t.bad_data,
                       mix_points=points)  # fmt: skip


def build_dataloader(
    cfg, tokenizer, dp_rank: int, dp_world: int, plan: DataPlan | None = None
) -> ParallelDataLoader:
    """The loader of one data-parallel rank, from the job's data ``plan`` (resolved in this
    process when not given: a single process, the validation data)."""
    t = cfg.training
    return ParallelDataLoader(
        build_stream(t, tokenizer, plan),
        BatchSchedule.from_config(t, dp_world, dp_rank),
        dp_rank=dp_rank,
        num_workers=t.num_workers,
        document_layout=_document_layout(cfg),
    )


def build_validation_loader(
    cfg, tokenizer, dp_rank: int, dp_world: int, ranks: Ranks | None = None
) -> ParallelDataLoader:
    """The held-out data's loader of one data-parallel rank: ``validation.*``'s sources,
    resolved once for the job as the training data's are (``resolve_plan`` with
    ``held_out``, through ``ranks``; in this process when None), read in order by this
    process (no workers), one micro-batch of ``training.batch_size`` sequences per rank
    and step: nothing random, nothing that depends on the training stream or its batch
    schedule. Cost: the plan's (O(files / ranks) reads per rank)."""
    t = cfg.training
    plan = resolve_plan(t, tokenizer, ranks, held_out=cfg.validation)
    return ParallelDataLoader(
        build_stream(t, tokenizer, plan, scheduled=False),
        BatchSchedule([(0, t.batch_size * dp_world)], t.batch_size, dp_world, dp_rank),
        dp_rank=dp_rank,
        num_workers=0,
        document_layout=_document_layout(cfg),
    )


def _document_layout(cfg) -> bool:
    """Whether batches carry positions and document ids (the attention mask or the loss
    needs them)."""
    return cfg.model.attention_mask == "block_causal" or cfg.training.mask_document_boundaries


def document_lengths(cfg, tokenizer) -> dict[str, dict[str, int]]:
    """{source name: {document id: tokens with BOS/EOS}} of every usable document, read
    the way the run reads them (map-style or streaming). For checking provenance.

    Cost: reads and tokenizes every document once: O(corpus); a pretokenized source's
    lengths are its stored ones, read without tokenizing.
    """
    t = cfg.training
    out = {}
    for spec in source_specs(t):
        check_tokenizer(spec, tokenizer)
        if spec.tokens_field:
            out[spec.name] = stored_lengths(spec)
            continue
        src = open_configured(spec, t)
        docs = (
            (doc_id, value) for unit in src.units() for doc_id, value in _unit_documents(src, unit)
        )
        out[spec.name] = {
            doc_id: len(encode_document(tokenizer, text))
            for doc_id, text in docs
            if document_problem(text) is None
        }
    return out


def _unit_documents(source, unit):
    at = unit[1]
    while at is not None:
        docs, at, _ = source.read(unit, at)
        yield from ((doc_id, value) for _, _, doc_id, value in docs)
