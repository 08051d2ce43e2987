"""torchtitan/data/pretokenize.py and pretokenized.py: a corpus tokenized once, ahead of
training, yields the batches of tokenizing its original on the fly and is never
tokenized again; its output does not depend on the worker count, and a folder made with
another tokenizer or left incomplete is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    CONFIG,
    bundled_documents,
    cfg,
    error_lines,
    global_steps,
    loaders,
    losses,
    train_here,
    write_jsonl,
)

from torchtitan.config import parse_args
from torchtitan.data import document_lengths
from torchtitan.data.pretokenized_write import pretokenize
from torchtitan.data.sources import DataError, resolve_source


@pytest.fixture(scope="session")
def pretokenized_dozen(tmp_path_factory, dozen_corpus, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("pretok_dozen") / "tok"
    pretokenize(resolve_source(path=str(dozen_corpus)), tokenizer, str(out), workers=1)
    return out


def bad_corpus(folder: Path) -> Path:
    docs = bundled_documents("shakespeare", 10, 300)
    docs[2]["text"], docs[5]["text"], docs[7]["text"] = "", "  \n\t ", None
    return write_jsonl(folder, docs)


def test_pretokenized_batches_equal_on_the_fly(tmp_path, tokenizer):
    """Through the loaders of 2 ranks: the same tokens and spans at every step, and the
    same skipped-document counts, as tokenizing the original on the fly, across passes,
    with unusable documents (empty, whitespace, null) stored as null and skipped alike.
    Negative control: one stored token changed in a copy shows up in the batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    original = bad_corpus(tmp_path / "bad")
    manifest = pretokenize(resolve_source(path=str(original)), tokenizer, str(tmp_path / "tok"),
                           workers=1)  # fmt: skip
    assert manifest["unusable_documents"] == {"has no text": 1, "is empty or whitespace-only": 2}

    def steps(path) -> list[tuple]:
        """Per step: its windows, their spans, and each rank's skipped-document count."""
        ranks = loaders(path, tokenizer, 2, global_batch_size=8)
        out = []
        for _ in range(12):
            (step,) = global_steps(ranks, 1)
            skipped = [r.skipped_documents() for r in ranks]
            out.append(([w for w, _ in step], [s for _, s in step], skipped))
        return out

    fly, pre = steps(original), steps(tmp_path / "tok")
    assert pre == fly
    assert pre[-1][2][0] > 0 and len({sp[4] for _, spans, _ in pre for s in spans for sp in s}) > 1
    shutil.copytree(tmp_path / "tok", tmp_path / "tampered")
    path = tmp_path / "tampered" / "tokens-00000.parquet"
    table = pq.read_table(path)
    rows = table.column("tokens").to_pylist()
    rows[0][3] = (rows[0][3] + 1) % tokenizer.vocab_size
    pq.write_table(table.set_column(1, "tokens", pa.array(rows, pa.list_(pa.int32()))), path)
    tampered = steps(tmp_path / "tampered")
    assert [t[0] for t in tampered] != [f[0] for f in fly]  # the tokens differ,
    assert [t[1:] for t in tampered] == [f[1:] for f in fly]  # nothing else does


def test_pretokenize_output_does_not_depend_on_workers(tmp_path, small_corpus, tokenizer):
    """1 and 2 processes write the same bytes: the chunks (and so row groups and file
    boundaries) are fixed by the data alone. Here 3 files of chunks of 5 documents."""
    spec = resolve_source(path=str(small_corpus))
    for workers in (1, 2):
        pretokenize(spec, tokenizer, str(tmp_path / f"w{workers}"), workers=workers,
                    chunk_documents=5, file_tokens=2000)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert len(names) >= 3 and names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    assert all(
        (tmp_path / "w1" / n).read_bytes() == (tmp_path / "w2" / n).read_bytes() for n in names
    )
    manifest = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    assert manifest["documents"] == 24 and manifest["source"]["identity"] == spec.identity()


def test_pretokenized_lengths_are_read_not_tokenized(tmp_path, tiny_corpus, pretokenized,
                                                     tokenizer):  # fmt: skip
    """The provenance check's document lengths come from the stored token lists (a
    tokenizer that cannot encode is never asked) and equal the on-the-fly ones; the
    length index (measured here, in a fresh cache) and the loader's windows neither
    tokenize, and give the original's steps."""

    class NoEncoding:
        path, sha256 = tokenizer.path, tokenizer.sha256
        bos_id, eos_id = tokenizer.bos_id, tokenizer.eos_id

        def encode(self, *a, **k):
            raise AssertionError("a pretokenized source was tokenized")

        encode_batch = encode

    def lengths(path, tok):
        return document_lengths(parse_args([*CONFIG, "--training.dataset_path", str(path)]), tok)

    assert lengths(pretokenized, NoEncoding()) == lengths(tiny_corpus, tokenizer)
    with pytest.raises(AssertionError, match="a pretokenized source was tokenized"):
        lengths(tiny_corpus, NoEncoding())
    pre = loaders(pretokenized, NoEncoding(), 1, length_index_dir=tmp_path / "index")
    assert global_steps(pre, 4) == global_steps(loaders(tiny_corpus, tokenizer, 1), 4)
    assert list((tmp_path / "index").rglob("*.npz")), "the counts were measured here"
    (text,) = loaders(tiny_corpus, NoEncoding(), 1, length_index_dir=tmp_path / "index")
    with pytest.raises(AssertionError, match="a pretokenized source was tokenized"):
        next(text)


def test_pretokenized_trains_like_the_original_and_refuses_another_tokenizer(
    tmp_path, tiny_corpus, pretokenized
):
    """In-process training: the pretokenized corpus gives the original's losses to the
    bit; trained with another tokenizer (here: another EOS, which changes the ids) it
    stops with one line naming both and the fix."""
    args = ["--training.steps", 3, "--training.seq_len", 32]
    train_here(tmp_path / "fly", *args, "--training.dataset_path", tiny_corpus)
    train_here(tmp_path / "pre", *args, "--training.dataset_path", pretokenized)
    assert (
        losses(tmp_path / "pre") == losses(tmp_path / "fly") and len(losses(tmp_path / "pre")) == 3
    )
    status, log = train_here(tmp_path / "other", *args, "--training.dataset_path", pretokenized,
                             "--model.eos_token", "<s>", expect_ok=False)  # fmt: skip
    (line,) = error_lines(log)
    assert status == 1 and "was made with tokenizer" in line and "training uses" in line
    assert "set --model.tokenizer_path to the one it was made with" in line


def test_missing_or_incomplete_folders_are_one_line(tmp_path, pretokenized):
    with pytest.raises(DataError, match="matches no data files"):
        resolve_source(path=str(tmp_path / "nowhere"))
    partial = tmp_path / "partial"
    shutil.copytree(pretokenized, partial)
    (partial / "tokens-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"is missing \['tokens-00000.parquet'\] that its manifest"):
        resolve_source(path=str(partial))
    with pytest.raises(DataError, match="is not empty; choose a new or empty folder"):
        pretokenize(resolve_source(name="kjv"), None, str(pretokenized))


def test_elastic_resume_over_a_pretokenized_source(pretokenized_dozen, tokenizer):
    """2 ranks x micro-batch 4 -> 1 rank x 2 micro-batches of 4 (global batch 8 kept) over
    a pretokenized 12-document corpus, through more than one pass: the provenance checks
    find every token read exactly once and, with the lengths from the stored token counts,
    every document of each finished pass read whole. Negative control: a step read twice
    (a replay at the change of layout) is seen.

    In process: the loaders are what a rank runs (test_train's elastic chain launches
    real jobs); train.py over a pretokenized corpus is tested above."""
    from torchtitan.records.provenance import check_complete, check_exactly_once

    provenance = {0: {}, 1: {}}
    ranks = loaders(pretokenized_dozen, tokenizer, 2, global_batch_size=8)
    for step in range(1, 7):
        for r, loader in enumerate(ranks):
            provenance[r][step] = [s for b in loader.next_step() for s in b["spans"]]
    (one,) = loaders(pretokenized_dozen, tokenizer, 1, global_batch_size=8)
    one.load_state_dict(ranks[1].state_dict())
    for step in range(7, 13):
        batches = one.next_step()
        assert [len(b["spans"]) for b in batches] == [4, 4]
        provenance[0][step] = [s for b in batches for s in b["spans"]]
    reports = check_exactly_once(provenance)
    assert all(r.duplicate_tokens == r.gaps == 0 for r in reports.values()), reports
    lengths = document_lengths(cfg(pretokenized_dozen), tokenizer)
    report = check_complete(provenance, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 1 and (report.missing, report.partial) == (0, 0)
    replayed = {0: {**provenance[0], 13: provenance[0][6]}, 1: provenance[1]}
    assert check_exactly_once(replayed)["shakespeare"].duplicate_tokens > 0
