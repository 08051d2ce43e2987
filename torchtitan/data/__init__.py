"""The data path: sources -> tokens -> token buffer -> sequences -> batches.

``build_dataloader`` turns the config into a ``ParallelDataLoader`` for one
data-parallel rank; ``data_fingerprint`` records what the data stream depends on.
"""

from __future__ import annotations

from torchtitan.data.dataset import TokenDataset
from torchtitan.data.loader import ParallelDataLoader
from torchtitan.data.sources import DataError, SourceSpec, resolve_source

__all__ = [
    "DataError",
    "ParallelDataLoader",
    "TokenDataset",
    "build_dataloader",
    "data_fingerprint",
    "source_specs",
]


def source_specs(training) -> list[SourceSpec]:
    """The configured sources: a weighted mix, a local path, or a registry name."""
    if training.datasets:
        return [resolve_source(d.name, d.path, d.weight) for d in training.datasets]
    if training.dataset_path:
        return [resolve_source(path=training.dataset_path)]
    return [resolve_source(name=training.dataset)]


def build_dataloader(cfg, tokenizer, dp_rank: int, dp_world: int) -> ParallelDataLoader:
    t = cfg.training
    dataset = TokenDataset(
        source_specs(t),
        tokenizer,
        t.seq_len,
        dp_rank=dp_rank,
        dp_world=dp_world,
        data_shards=t.data_shards,
        seed=t.seed,
        shuffle=t.shuffle,
        streaming=t.streaming,
        text_field=t.text_field,
        id_field=t.id_field,
        bad_data=t.bad_data,
    )
    return ParallelDataLoader(dataset, t.batch_size, num_workers=t.num_workers)


def data_fingerprint(cfg, tokenizer) -> dict:
    """Everything the order and content of the data stream depends on."""
    t = cfg.training
    return {
        "sources": [
            {"name": s.name, "weight": s.weight, "files": s.fingerprint()} for s in source_specs(t)
        ],
        "tokenizer_sha256": tokenizer.sha256(),
        "seq_len": t.seq_len,
        "shuffle": t.shuffle,
        "seed": t.seed,
        "data_shards": t.data_shards,
        "streaming": t.streaming,
        "text_field": t.text_field,
    }
