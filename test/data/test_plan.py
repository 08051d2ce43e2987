"""torchtitan/data/plan.py: the data plan. Start-up at scale: one resolution of the data per
job, the ranks' shares of the files (each file inspected by one rank, signed by its
bytes), and a rank that opens only its share of the files and the files its own windows
lie in."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import CONFIG

from harness.io_count import counting
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader, combine, inspect_share, list_sources, local_plan
from torchtitan.data.sources import DataError
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

FILES = 200


def tiny_parquet_corpus(folder: Path, files: int = FILES, rows: int = 4) -> Path:
    folder.mkdir(parents=True)
    for f in range(files):
        texts = [f"Document {f}-{r}: " + "words of a small file " * (5 + (f * 7 + r) % 11)
                 for r in range(rows)]  # fmt: skip
        ids = [f"d{f}-{r}" for r in range(rows)]
        pq.write_table(pa.table({"id": ids, "text": texts}), folder / f"part-{f:05d}.parquet")
    return folder


def test_a_rank_opens_its_share_and_the_files_its_windows_lie_in(tmp_path):
    """Rank 5 of 64 over 200 streaming parquet files: it inspects its 200/64 files, and,
    once the step's units are measured (by rank 0 here, as the ranks share the work), its
    first micro-batch opens only the files its windows lie in: the counts come from the
    shared folder. Negative control: resolving the data in one process, as every rank did
    before the plan, opens all 200."""
    corpus = tiny_parquet_corpus(tmp_path / "corpus")
    cfg = parse_args(["--training.dataset_path", str(corpus), "--training.streaming",
                      "--training.seq_len", "64", "--training.batch_size", "2",
                      "--training.length_index_dir", str(tmp_path / "index")])  # fmt: skip
    t, tokenizer = cfg.training, Tokenizer(DEFAULT_TOKENIZER_PATH)
    specs = list_sources(t)  # rank 0's, once per job
    shares = [inspect_share(specs, t, tokenizer, r, 64) for r in range(64) if r != 5]
    plan = combine(specs, [*shares, inspect_share(specs, t, tokenizer, 5, 64)], t, tokenizer)
    next(build_dataloader(cfg, tokenizer, 0, 64, plan=plan))  # rank 0 measures the step
    with counting() as access:
        inspect_share(specs, t, tokenizer, 5, 64)
        loader = build_dataloader(cfg, tokenizer, 5, 64, plan=plan)
        batch = next(loader)
    assert loader.stream.orders[0].counts.measured == 0
    opened = {p for p in access.files_under(str(corpus)) if p.endswith(".parquet")}
    share = {os.path.abspath(specs[0].files[f]) for f in range(5, FILES, 64)}
    own = {os.path.abspath(specs[0].files[unit[0]]) for s in batch["spans"] for unit in
           [loader.stream.sources[0].units()[span[5]] for span in s]}  # fmt: skip
    assert len(share) == 4 and 1 <= len(own) <= 4
    assert share <= opened and opened <= share | own, (sorted(opened), sorted(share | own))

    with counting() as access:
        local_plan(t, tokenizer)
    parquet = {p for p in access.files_under(str(corpus)) if p.endswith(".parquet")}
    assert len(parquet) == FILES, "the check can fail"


def test_the_shares_of_the_ranks_cover_every_file_once(tmp_path, tokenizer):
    """inspect_share gives rank r every world-th file from r: over 3 ranks the shares
    are disjoint and hold all 10 files, each with its signature (and, streaming, its
    blocks' row counts); combine puts them into the fingerprint of one process's plan.
    Negative control: a lost share is refused, naming a file no rank inspected."""
    corpus = tiny_parquet_corpus(tmp_path / "corpus", files=10, rows=3)
    t = parse_args([*CONFIG, "--training.dataset_path", str(corpus), "--training.streaming",
                    "--training.length_index_dir", str(tmp_path / "index")]).training  # fmt: skip
    specs = list_sources(t)
    shares = [inspect_share(specs, t, tokenizer, r, 3) for r in range(3)]
    assert [sorted(f for _, f in s) for s in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert all(sum(rows) == 3 and signature for s in shares for signature, rows in s.values())
    plan = combine(specs, shares, t, tokenizer)
    assert plan.fingerprint == local_plan(t, tokenizer).fingerprint
    assert sum(sum(rows) for rows in plan.block_rows[0].values()) == 30
    assert sorted(plan.block_rows[0]) == list(range(10))
    with pytest.raises(DataError, match=r"no rank inspected \[.*part-00001.parquet.*incomplete"):
        combine(specs, [shares[0], shares[2]], t, tokenizer)


def test_a_share_signs_the_bytes_of_its_files(tmp_path, tokenizer):
    """A file's signature follows its bytes, not its name or time: an edit that keeps the
    size changes it (and so the fingerprint); rewriting the same bytes does not."""
    corpus = tiny_parquet_corpus(tmp_path / "corpus", files=2, rows=3)
    t = parse_args([*CONFIG, "--training.dataset_path", str(corpus)]).training
    specs = list_sources(t)

    def signatures():
        return [sig for sig, _ in inspect_share(specs, t, tokenizer, 0, 1).values()]

    before = signatures()
    path = Path(specs[0].files[1])
    data = path.read_bytes()
    path.write_bytes(data)
    assert signatures() == before
    i = data.index(b"words")
    path.write_bytes(data[:i] + b"Words" + data[i + 5 :])
    after = signatures()
    assert after[0] == before[0] and after[1] != before[1]


# ---- the held-out data -----------------------------------------------------------------


def held_out_config(tmp_path, corpus, *training):
    return parse_args([*CONFIG, "--training.seq_len", "32", "--training.batch_size", "2",
                       "--training.length_index_dir", str(tmp_path / "index"),
                       "--validation.enable", "--validation.dataset_path", str(corpus),
                       *training])  # fmt: skip


def test_the_held_out_data_is_listed_once_for_the_job(tmp_path, tokenizer, monkeypatch):
    """The validation loader resolves its sources through the job's ranks, as the training
    data's plan does: rank 0 lists them (``on_main``), so a Hub id is resolved once per
    job. Negative control: a loader built from a config alone (how the validator built
    its own before) lists them in its own process, outside the job's ``on_main``."""
    import torchtitan.data.plan as plan_module
    from torchtitan.data import build_validation_loader
    from torchtitan.data.plan import OneProcess

    corpus = tiny_parquet_corpus(tmp_path / "held", files=3)
    cfg = held_out_config(tmp_path, corpus)
    inside, listed = [], []
    resolve = plan_module.resolve_source

    def recorded(*args, **kwargs):
        listed.append(bool(inside))
        return resolve(*args, **kwargs)

    class JobOfOne(OneProcess):
        def on_main(self, fn, *args):
            inside.append(fn)
            try:
                return fn(*args)
            finally:
                inside.pop()

    monkeypatch.setattr(plan_module, "resolve_source", recorded)
    loader = build_validation_loader(cfg, tokenizer, 0, 1, JobOfOne())
    assert listed == [True]
    assert loader.stream.sources[0].spec.root == str(corpus)
    listed.clear()
    held_out = parse_args([*CONFIG, "--training.dataset_path", str(corpus)])
    build_dataloader(held_out, tokenizer, 0, 1)
    assert listed == [False]


def test_the_held_out_loader_ignores_the_training_batch_and_order_settings(tmp_path, tokenizer):
    """Shuffling, workers, a global batch and a batch-size schedule of the training data
    leave the held-out batches as they are: the first ones read in order, one
    micro-batch of training.batch_size per rank and step, the same bit for bit as under
    the defaults. Negative control: the training loader over the same data, shuffled."""
    from torchtitan.data import build_validation_loader

    corpus = tiny_parquet_corpus(tmp_path / "held", files=3)
    plain = held_out_config(tmp_path, corpus, "--training.shuffle", "false")
    busy = held_out_config(tmp_path, corpus, "--training.shuffle", "true",
                           "--training.num_workers", "2", "--training.global_batch_size", "6",
                           "--training.batch_size_schedule", "0:4,2:8")  # fmt: skip

    def first(loader, n=3):
        return [next(loader)["input"] for _ in range(n)]

    expected = first(build_validation_loader(plain, tokenizer, 0, 1))
    held_out = build_validation_loader(busy, tokenizer, 0, 1)
    assert held_out.num_workers == 0
    got = first(held_out)
    assert all(torch.equal(a, b) and a.shape == (2, 32) for a, b in zip(got, expected))
    held_out.seek()
    assert [next(held_out)["loss_weight"] for _ in range(3)] == [1.0] * 3  # a step's one batch
    held_out.seek()
    assert all(torch.equal(a, b) for a, b in zip(first(held_out), expected))
    shuffled = held_out_config(tmp_path, corpus, "--training.dataset_path", str(corpus))
    trained = first(build_dataloader(shuffled, tokenizer, 0, 1))
    assert not all(torch.equal(a, b) for a, b in zip(trained, expected))
