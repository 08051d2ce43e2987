"""The data path: sources -> tokens -> token buffer -> sequences -> batches.

``build_dataloader`` turns the config into a ``ParallelDataLoader`` for one
data-parallel rank; ``data_fingerprint`` records what the data stream depends on.
"""

from __future__ import annotations

from torchtitan.data.dataset import TokenDataset
from torchtitan.data.loader import ParallelDataLoader
from torchtitan.data.packing import document_problem, encode_document
from torchtitan.data.plan import DataPlan, combine, inspect_share, list_sources, local_plan
from torchtitan.data.pretokenized import check_tokenizer, stored_lengths
from torchtitan.data.sources import DataError, SourceSpec, open_source

__all__ = [
    "DataError",
    "DataPlan",
    "combine",
    "inspect_share",
    "list_sources",
    "local_plan",
    "ParallelDataLoader",
    "TokenDataset",
    "build_dataloader",
    "data_fingerprint",
    "document_lengths",
    "source_specs",
]


def source_specs(training) -> list[SourceSpec]:
    """The configured sources, resolved in this process (see ``plan.list_sources``)."""
    return list_sources(training)


# The automatic shard count: a multiple of the consumer count with as many divisors as
# possible (so that many layouts can resume it), up to this many shards per consumer
# or SHARDS_CAP in all, whichever is larger, and never more than the documents.
SHARDS_PER_CONSUMER = 8
SHARDS_CAP = 512


def auto_data_shards(consumers: int, documents: int) -> int:
    """The virtual shard count for ``consumers`` (ranks x workers) over a corpus whose
    smallest source has ``documents`` documents. Raises DataError if it cannot be done."""
    if documents < consumers:
        raise DataError(
            f"the smallest source has {documents} documents, fewer than the {consumers} data "
            "consumers (ranks x max(1, workers)); use fewer ranks or workers, or more documents "
            "(streaming, a compressed JSON-lines file counts as one: it is read whole)"
        )
    limit = min(documents, max(consumers * SHARDS_PER_CONSUMER, SHARDS_CAP))
    multiples = range(consumers, limit + 1, consumers)
    return max(multiples, key=lambda v: (_divisor_count(v), v))


def _divisor_count(n: int) -> int:
    count, d = 0, 1
    while d * d <= n:
        if n % d == 0:
            count += 1 if d * d == n else 2
        d += 1
    return count


def build_dataloader(
    cfg, tokenizer, dp_rank: int, dp_world: int, accumulation: int = 1, plan: DataPlan | None = None
) -> ParallelDataLoader:
    """The loader of one data-parallel rank, from the job's data ``plan`` (resolved in this
    process when not given: a single process, the validation data). With
    ``training.data_shards = 0`` the shard count is chosen here from the corpus and the
    layout; a resume takes the checkpoint's (see ``ParallelDataLoader.load_state_dict``).
    Cost with a plan: opening the sources (a map-style one is memory-mapped by
    ``datasets``; a streaming one opens no file until its shards read)."""
    t = cfg.training
    plan = plan or local_plan(t, tokenizer)
    documents = plan.documents or [None] * len(plan.specs)
    block_rows = plan.block_rows or [None] * len(plan.specs)
    sources = [
        open_source(s, t.text_field, t.id_field, t.seed, t.shuffle, t.streaming, n, rows)
        for s, n, rows in zip(plan.specs, documents, block_rows)
    ]
    consumers = dp_world * max(1, t.num_workers)
    shards = t.data_shards or auto_data_shards(
        consumers, min(src.document_count() for src in sources)
    )
    dataset = TokenDataset(
        sources,
        tokenizer,
        t.seq_len,
        dp_rank=dp_rank,
        dp_world=dp_world,
        data_shards=shards,
        seed=t.seed,
        shuffle=t.shuffle,
        streaming=t.streaming,
        text_field=t.text_field,
        id_field=t.id_field,
        bad_data=t.bad_data,
    )
    return ParallelDataLoader(
        dataset,
        t.batch_size,
        num_workers=t.num_workers,
        auto_shards=t.data_shards == 0,
        document_layout=cfg.model.attention_mask == "block_causal" or t.mask_document_boundaries,
        accumulation=accumulation,
    )


def data_fingerprint(cfg, tokenizer, plan: DataPlan | None = None) -> dict:
    """Everything the order and content of the data stream depends on, but the shard count
    (the data plan's fingerprint; see ``plan.combine``).

    The shard count is the loader's: its state records the count the run resolved (given,
    or chosen at the start), and a resume compares that with the config's, or adopts it
    under ``training.data_shards = 0`` (see ``ParallelDataLoader.load_state_dict``). The
    raw setting here would refuse the equal count given explicitly.
    """
    return (plan or local_plan(cfg.training, tokenizer)).fingerprint


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
        src = open_source(spec, t.text_field, t.id_field, t.seed, t.shuffle, t.streaming)
        if src.streaming:
            docs = src.all_documents()
        else:
            docs = (d for i in range(0, len(src), 256)
                    for d in src.documents(range(i, min(i + 256, len(src)))))  # fmt: skip
        out[spec.name] = {
            doc_id: len(encode_document(tokenizer, text))
            for doc_id, text in docs
            if document_problem(text) is None
        }
    return out
