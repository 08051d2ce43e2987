"""Streaming sources read by units: no shard decodes another's rows, a resume decodes one
block wherever it lands, and every layout of units restores at every step.

Layouts: whole files (at least as many files as shards), parquet row groups and JSON
lines byte ranges (fewer files), row ranges of row groups (fewer row groups), and
Arrow record batches of a ``save_to_disk`` folder. Counts of decoded rows come from
the cursors' and sources' own tallies (``rows_decoded``).
"""

from __future__ import annotations

import copy
import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import bundled_documents, write_jsonl
from test_data import assert_exactly_once, epoch_coverage, take

from torchtitan.data import ParallelDataLoader, TokenDataset
from torchtitan.data import streaming as streaming_module
from torchtitan.data.sources import DataError, SourceSpec, open_source, resolve_source
from torchtitan.data.streaming import StreamCursor, StreamSource

SEQ = 31
DOCS = bundled_documents("shakespeare", 48, 300)


def write_parquet(folder: Path, docs: list[dict], files: int, row_group: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(docs) // files)
    for f in range(files):
        part = docs[f * per_file : (f + 1) * per_file]
        table = pa.table({"id": [d["id"] for d in part], "text": [d["text"] for d in part]})
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=row_group)
    return folder


def write_saved(folder: Path, docs: list[dict], batch: int) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict(
        {"id": [d["id"] for d in docs], "text": [d["text"] for d in docs]}
    )
    ds.save_to_disk(str(folder), max_shard_size="100MB")
    # save_to_disk writes record batches of 1,000 rows; rewrite them smaller, as the
    # writer would for a larger corpus.
    for path in folder.glob("*.arrow"):
        table = pa.ipc.open_stream(path.read_bytes()).read_all()  # not mapped: rewritten
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for b in table.to_batches(max_chunksize=batch):
                w.write_batch(b)
    return folder


# name -> (writer, data_shards): each gives the layout its name says (checked below).
LAYOUTS = {
    "whole_files": (lambda d: write_jsonl(d, DOCS, files=8), 4),
    "jsonl_byte_ranges": (lambda d: write_jsonl(d, DOCS, files=2), 6),
    "parquet_row_groups": (lambda d: write_parquet(d, DOCS, files=2, row_group=4), 6),
    "parquet_row_ranges": (lambda d: write_parquet(d, DOCS, files=2, row_group=16), 8),
    "arrow_record_batches": (lambda d: write_saved(d, DOCS, batch=4), 6),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    """(name, corpus folder, data_shards)."""
    write, shards = LAYOUTS[request.param]
    folder = write(tmp_path_factory.mktemp(request.param) / "shakespeare")
    return request.param, folder, shards


def source_of(where, seed: int = 7, shuffle: bool = True) -> StreamSource:
    """A streaming source over a folder (or a SourceSpec), opened afresh."""
    spec = where if isinstance(where, SourceSpec) else resolve_source(path=str(where))
    return open_source(spec, "text", "id", seed, shuffle, streaming=True)


def read_epoch(cursor: StreamCursor) -> list[str]:
    """The ids a cursor reads until its epoch ends."""
    ids = []
    while (doc := cursor.current()) is not None:
        ids.append(doc[0])
        cursor.advance()
    return ids


def test_each_layout_is_what_its_name_says(layout):
    name, folder, shards = layout
    src = source_of(folder)
    units = src.units(shards)
    files = len(src.spec.files)
    if name == "whole_files":
        assert files >= shards and all(hi == -1 for _, _, hi in units)
    elif name == "jsonl_byte_ranges":
        assert files < shards and len(units) == shards and src.spec.fmt == "json"
    elif name == "parquet_row_groups":
        assert files < shards <= len(units) == 12 and all(hi - lo == 4 for _, lo, hi in units)
    elif name == "parquet_row_ranges":
        assert len(units) >= shards > 3 and all(hi - lo < 16 for _, lo, hi in units)
    else:
        assert src.spec.fmt == "arrow" and len(units) == 12


def test_every_document_once_per_epoch_in_every_layout(layout):
    """All shards' cursors together read each document exactly once per epoch, in epochs
    0 and 1 (each reshuffled). Negative control: one shard's cursor alone does not."""
    _, folder, shards = layout
    src = source_of(folder)
    for epoch in (0, 1):
        ids = []
        for v in range(shards):
            cursor = StreamCursor(src, v, shards)
            for _ in range(epoch):
                cursor.next_epoch()
            ids += read_epoch(cursor)
        assert sorted(ids) == sorted(d["id"] for d in DOCS), epoch
    assert len(read_epoch(StreamCursor(src, 0, shards))) < len(DOCS)


def test_json_lines_ranges_are_cut_at_line_starts(tmp_path):
    """Documents of very unequal length (one is a fifth of the corpus) over 8 shards:
    every range starts at a line start and holds a line, so no shard's epoch is empty by
    chance, and every document is read once per epoch."""
    docs = [dict(d) for d in DOCS[:24]]
    docs[5]["text"] = docs[5]["text"] * 40
    folder = write_jsonl(tmp_path / "d", docs, files=2)
    src = source_of(folder)
    units = src.units(8)
    assert len(units) >= 8
    for f, lo, hi in units:
        data = Path(src.spec.files[f]).read_bytes()
        assert lo == 0 or data[lo - 1 : lo] == b"\n"
        assert data[lo:hi].strip(), (lo, hi)
    for epoch in (0, 1, 2):
        ids = []
        for v in range(8):
            cursor = StreamCursor(src, v, 8)
            for _ in range(epoch):
                cursor.next_epoch()
            ids += read_epoch(cursor)
        assert sorted(ids) == sorted(d["id"] for d in docs)


def test_fewer_files_than_shards_each_shard_decodes_only_its_own_rows(tmp_path):
    """2 parquet files of 6 row groups, 6 shards: each shard decodes exactly the rows of
    its own row groups, and the source decodes each row once per epoch. Negative
    control: with 24 shards (row ranges, 2 per row group) a shard alone decodes its whole
    row group, twice what it reads: the tally sees discarded rows. Read together, as one
    consumer reads its shards, the shards of a row group share one decode."""
    folder = write_parquet(tmp_path / "c", DOCS, files=2, row_group=4)
    src = source_of(folder)
    units = src.units(6)
    for v in range(6):
        cursor = StreamCursor(src, v, 6)
        ids = read_epoch(cursor)
        own = sum(units[u][2] - units[u][1] for u in src.shard_units(0, v, 6))
        assert cursor.rows_decoded == len(ids) == own == 8
    assert src.rows_decoded == len(DOCS)

    alone = [StreamCursor(source_of(folder), v, 24) for v in range(24)]
    for cursor in alone:
        assert cursor.rows_decoded == 0
        assert len(read_epoch(cursor)) == 2 and cursor.rows_decoded == 4

    shared = source_of(folder)
    cursors = [StreamCursor(shared, v, 24) for v in range(24)]
    docs = [c.current() for c in cursors]  # every shard holds its row group, as in training
    assert all(docs) and shared.rows_decoded == len(DOCS)


def test_a_late_resume_decodes_one_block_wherever_it_lands(tmp_path, monkeypatch):
    """One parquet file of 50 row groups and one JSON lines file of 400 lines, read whole
    by one shard: a cursor loaded at 1% and at 99% of the file decodes one row group (or
    one read window of lines) before its first document, which is the right one.
    Negative control: reaching 99% by reading decodes ~99% of the rows."""
    docs = [
        {"id": f"d{i}", "text": f"Document number {i:04d} of the corpus.\n"} for i in range(400)
    ]
    pq.write_table(
        pa.table({"id": [d["id"] for d in docs[:200]], "text": [d["text"] for d in docs[:200]]}),
        tmp_path / "a.parquet",
        row_group_size=4,
    )
    write_jsonl(tmp_path / "j", docs, files=1)
    monkeypatch.setattr(streaming_module, "READ_BYTES", 1024)
    lines = (tmp_path / "j" / "part-000.jsonl").read_bytes().split(b"\n")
    starts = np.cumsum([0] + [len(x) + 1 for x in lines])
    line = max(map(len, lines)) + 1

    for path, rows, position in [
        (tmp_path / "a.parquet", 200, lambda r: r),
        (tmp_path / "j", 400, lambda r: int(starts[r])),
    ]:
        decoded = {}
        for r in (rows // 100, rows - rows // 100):
            cursor = StreamCursor(source_of(path), 0, 1)
            cursor.load_state_dict({"epoch": 0, "unit": 0, "at": position(r)})
            assert cursor.current()[0] == f"d{r}"
            decoded[r] = cursor.rows_decoded
        early, late = decoded.values()
        assert late <= early, decoded  # no more at 99% than at 1%
        assert 0 < max(decoded.values()) <= max(4, 1024 // line + 2), decoded

        replay = StreamCursor(source_of(path), 0, 1)
        for _ in range(rows - rows // 100):
            replay.current()
            replay.advance()
        assert replay.rows_decoded >= rows * 0.98


@pytest.mark.parametrize("rank", [0, 1])
def test_restore_at_every_step_in_every_layout(layout, tokenizer, rank):
    """State after k sequences, loaded into a fresh dataset on the same source, yields
    exactly the rest, for k over several epochs of each shard. Negative control: the
    next shard's position one row (or byte) on does not reproduce the reference."""
    _, folder, shards = layout
    src = source_of(folder)

    def fresh():
        return TokenDataset([src], tokenizer, SEQ, dp_rank=rank, dp_world=2,
                            data_shards=shards, seed=7, streaming=True)  # fmt: skip

    ds = fresh()
    it = iter(ds)
    reference, states = [], []
    for _ in range(150):
        states.append(ds.state_dict())
        reference.append(next(it))
    epochs = {p.cursor.epoch for shard in ds._shards.values() for p in shard.packers}
    assert min(epochs) >= 1, "the test must cross epoch boundaries"

    def same(state, k) -> bool:
        ds = fresh()
        ds.load_state_dict(state)
        return all(torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]
                   for a, b in zip(take(ds, 3), reference[k : k + 3]))  # fmt: skip

    for k in range(0, 147, 3):
        assert same(states[k], k), k
    k = 40
    moved = copy.deepcopy(states[k])
    v = sorted(moved["shards"])[moved["next"]]
    moved["shards"][v]["sources"][0]["cursor"]["at"] += 1
    moved["shards"][v]["sources"][0]["offset"] = 0
    assert not same(moved, k)


@pytest.mark.parametrize("name", ["jsonl_byte_ranges", "parquet_row_ranges"])
@pytest.mark.parametrize("before,after", [(2, 1), (3, 2)])
def test_reshard_reads_every_token_exactly_once(tmp_path, tokenizer, name, before, after):
    """Consumers 2->1 and 3->2 (not dividing the shards) over byte ranges and row ranges:
    epochs 0 and 1 are each read completely, every token once."""
    write, _ = LAYOUTS[name]
    src = source_of(write(tmp_path / "shakespeare"))
    lengths = {d["id"]: len(tokenizer.encode(d["text"], bos=True, eos=True)) for d in DOCS}
    samples, shard_states = [], {}
    for c in range(before):
        ds = TokenDataset([src], tokenizer, SEQ, dp_rank=c, dp_world=before, data_shards=6,
                          seed=7, streaming=True)  # fmt: skip
        samples += take(ds, 7 + 5 * c)
        shard_states.update(ds.state_dict()["shards"])
    for c in range(after):
        ds = TokenDataset([src], tokenizer, SEQ, dp_rank=c, dp_world=after, data_shards=6,
                          seed=7, streaming=True)  # fmt: skip
        ds.load_shard_states(shard_states)
        samples += take(ds, 900 // after)
    for epoch in (0, 1):
        assert_exactly_once(epoch_coverage(samples, epoch), lengths)


def test_invalid_utf8_and_json_lines_are_skipped_and_counted(tmp_path, tokenizer):
    """Each line is decoded alone: a bad line is one bad document (skipped and counted, or
    named by the error policy), and the lines after it are read."""
    good = [json.dumps(d).encode() + b"\n" for d in DOCS[:4]]
    data = good[0] + b'{"id": "bad", "text": "caf\xe9 \xff"}\n' + good[1] + b"{not json\n"
    data += b"\n\r\n" + good[2] + b"[1, 2]\n" + good[3]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_bytes(data)
    spec = resolve_source(path=str(tmp_path / "d"))

    def dataset(**kw):
        return TokenDataset([spec], tokenizer, SEQ, data_shards=1, shuffle=False,
                            streaming=True, **kw)  # fmt: skip

    samples = take(dataset(), 30)
    assert {sp[1] for s in samples for sp in s["spans"]} == {d["id"] for d in DOCS[:4]}
    epochs = max(sp[4] for s in samples for sp in s["spans"])
    assert samples[-1]["skipped"] in (3 * epochs, 3 * epochs + 3)  # 3 bad lines per pass
    with pytest.raises(DataError, match=r"a.jsonl@\d+.*not valid UTF-8.*bad_data = 'skip'"):
        take(dataset(bad_data="error"), 30)


def test_pretokenized_rows_are_token_arrays(tmp_path, tokenizer):
    """A source with ``tokens_field`` yields int32 token arrays from parquet and JSON
    lines, and packs to the same windows as the text it was made from."""
    ids = [tokenizer.encode(d["text"]) for d in DOCS]
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"id": [d["id"] for d in DOCS],
                             "tokens": pa.array(ids, pa.list_(pa.int32()))}),
                   tmp_path / "p" / "a.parquet", row_group_size=8)  # fmt: skip
    write_jsonl(tmp_path / "j", [{"id": d["id"], "tokens": t} for d, t in zip(DOCS, ids)])
    text = resolve_source(path=str(write_parquet(tmp_path / "t", DOCS, 1, 8)))
    reference = take(TokenDataset([text], tokenizer, SEQ, data_shards=2, shuffle=False,
                                  streaming=True), 40)  # fmt: skip
    for folder in ("p", "j"):
        spec = resolve_source(path=str(tmp_path / folder))
        spec.tokens_field = "tokens"
        doc = StreamCursor(source_of(spec), 0, 1).current()
        assert doc[1].dtype == np.int32 and doc[1].tolist() in ids
        if folder == "p":  # same files layout as the text: same order, same windows
            got = take(TokenDataset([spec], tokenizer, SEQ, data_shards=2, shuffle=False,
                                    streaming=True), 40)  # fmt: skip
            assert all(torch.equal(a["input"], b["input"]) for a, b in zip(got, reference))


def test_compressed_json_lines_are_read_whole_and_restore(tmp_path, tokenizer):
    (tmp_path / "d").mkdir()
    for f in range(2):
        with gzip.open(tmp_path / "d" / f"part-{f}.jsonl.gz", "wt") as out:
            out.writelines(json.dumps(d) + "\n" for d in DOCS[f * 24 : (f + 1) * 24])
    src = source_of(tmp_path / "d")
    assert src.units(4) == [(0, 0, -1), (1, 0, -1)]
    # Read whole, a compressed file feeds one shard: the automatic shard count sees 2.
    assert src.document_count() == 2

    def dataset():
        return TokenDataset([src], tokenizer, SEQ, data_shards=2, seed=7, streaming=True)

    ds = dataset()
    it = iter(ds)
    take(ds, 50, it)
    state = ds.state_dict()
    reference = take(ds, 10, it)
    resumed = dataset()
    resumed.load_state_dict(state)
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(take(resumed, 10), reference))


def test_a_compressed_file_is_decompressed_once_per_pass(tmp_path, monkeypatch):
    """A compressed file cannot seek without decompressing what comes before: the reader
    keeps its stream open between reads (3 reads of 1 MiB here), so a pass opens it once.
    Reopening per read (the negative control, READ_BYTES reads from a fresh stream)
    would open it once per read and decompress O(position) each time."""
    (tmp_path / "d").mkdir()
    with gzip.open(tmp_path / "d" / "big.jsonl.gz", "wt") as out:
        out.writelines(json.dumps({"id": str(i), "text": "verse " * 100}) + "\n"
                       for i in range(5000))  # fmt: skip
    src = source_of(tmp_path / "d")
    opens = []
    real_open = streaming_module._open_binary
    monkeypatch.setattr(streaming_module, "_open_binary",
                        lambda path: opens.append(path) or real_open(path))  # fmt: skip
    cursor = StreamCursor(src, 0, 1)
    count = 0
    while cursor.current() is not None:
        cursor.advance()
        count += 1
    assert count == 5000 and len(opens) == 1
    src._reader._streams.clear()  # negative control: every read reopens
    monkeypatch.setattr(src._reader, "_streams", _Forgetful())
    opens.clear()
    cursor = StreamCursor(src, 0, 1)
    while cursor.current() is not None:
        cursor.advance()
    assert len(opens) >= 3


class _Forgetful(dict):
    """A stream cache that keeps nothing."""

    def __setitem__(self, key, value):
        pass


def test_a_shard_that_draws_only_bad_documents_in_one_epoch_is_not_dropped(tmp_path, tokenizer):
    """4 files as 4 units over 4 shards, one file all empty texts: each epoch some shard
    draws it and has nothing usable in that pass. It reads on in the next epoch instead of
    being dropped for good (which, epoch by epoch, used to drop every shard)."""
    (tmp_path / "d").mkdir()
    for f in range(4):
        rows = [{"id": f"{f}-{i}", "text": "" if f == 3 else DOCS[i]["text"]} for i in range(6)]
        (tmp_path / "d" / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = source_of(tmp_path / "d")
    ds = TokenDataset([src], tokenizer, 16, data_shards=4, seed=7, streaming=True)
    samples = take(ds, 400)
    shards = {sp[5] for s in samples for sp in s["spans"]}
    assert shards == {0, 1, 2, 3}
    assert max(sp[4] for s in samples for sp in s["spans"]) >= 4  # several epochs passed
    late = {sp[5] for s in samples[-40:] for sp in s["spans"]}
    assert late == {0, 1, 2, 3}, "every shard still reads after several epochs"


def test_document_count_is_exact_for_parquet_and_small_json_lines(tmp_path):
    assert source_of(write_parquet(tmp_path / "p", DOCS, 2, 4)).document_count() == len(DOCS)
    assert source_of(write_jsonl(tmp_path / "j", DOCS, 2)).document_count() == len(DOCS)
    assert source_of(write_saved(tmp_path / "a", DOCS, 4)).document_count() == len(DOCS)


def test_an_old_streaming_position_is_refused_in_one_line(tmp_path, tokenizer):
    """A version-2 loader entry (the `datasets` iterator state) is refused by the loader;
    a bare old cursor state by the cursor."""
    src = source_of(write_jsonl(tmp_path / "j", DOCS, 2))
    with pytest.raises(DataError, match="older format.*exclude_from_loading dataloader"):
        StreamCursor(src, 0, 2).load_state_dict({"epoch": 0, "pos": {"shard_idx": 0}})
    ds = TokenDataset([src], tokenizer, SEQ, data_shards=2, seed=7, streaming=True)
    loader = ParallelDataLoader(ds, 2)
    entry = pickle.loads(loader.state_dict()["dp_rank_0"])
    entry["version"] = 2
    with pytest.raises(DataError, match=r"format \['2'\], this version reads 3"):
        loader.load_state_dict({"dp_rank_0": pickle.dumps(entry)})
