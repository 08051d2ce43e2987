"""Streaming sources read by units: a rank decodes only the blocks its windows lie in, a
resume decodes one block wherever it lands, and every layout of units restores at every
step and reads each document once per pass.

Layouts (a file is cut into at least ``spec.MIN_FILE_UNITS`` = 16 units, of at most
``UNIT_ROWS`` rows): 64 small JSON lines files, parquet row groups and Arrow record
batches of a ``save_to_disk`` folder (blocks of 2 rows: a unit each), JSON lines byte
ranges (2 files), and row ranges of row groups (row groups of 32 rows, cut in 8). Counts
of decoded rows come from the sources' own tally (``StreamSource.rows_decoded``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    SEQ,
    assert_restores_at_every_step,
    assert_spans_tile_every_document,
    bundled_documents,
    cfg,
    global_steps,
    loaders,
    read_unit,
    write_jsonl,
    write_parquet,
)

from torchtitan.data import streaming as streaming_module
from torchtitan.data.index import SourceCounts
from torchtitan.data.order import Cursor
from torchtitan.data.prepare import prepare
from torchtitan.data.sources import DataError, SourceSpec, open_source, resolve_source
from torchtitan.data.spec import MIN_FILE_UNITS
from torchtitan.data.state import from_tensor, to_tensor
from torchtitan.data.streaming import StreamSource
from torchtitan.data.windows import Position, TokenStream

DOCS = bundled_documents("shakespeare", 128, 300)


def write_parquet_files(folder: Path, docs: list[dict], files: int, row_group: int) -> Path:
    """``docs`` as ``files`` parquet files ``part-NNN.parquet`` of ``folder``, in row groups
    of ``row_group`` rows."""
    per_file = -(-len(docs) // files)
    for f in range(files):
        part = [{"id": d["id"], "text": d["text"]} for d in docs[f * per_file : (f + 1) * per_file]]
        write_parquet(folder / f"part-{f:03d}.parquet", part, row_group)
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


# name -> writer: each gives the layout its name says (checked below). 128 documents.
LAYOUTS = {
    "small_files": lambda d: write_jsonl(d, DOCS, files=64),
    "jsonl_byte_ranges": lambda d: write_jsonl(d, DOCS, files=2),
    "parquet_row_groups": lambda d: write_parquet_files(d, DOCS, files=2, row_group=2),
    "parquet_row_ranges": lambda d: write_parquet_files(d, DOCS, files=2, row_group=32),
    "arrow_record_batches": lambda d: write_saved(d, DOCS, batch=2),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Every layout's corpus folder, written once."""
    return {
        name: write(tmp_path_factory.mktemp(name) / "shakespeare")
        for name, write in LAYOUTS.items()
    }


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request, folders) -> tuple[str, Path]:
    return request.param, folders[request.param]


def source_of(where) -> StreamSource:
    """A streaming source over a folder (or a SourceSpec), opened afresh."""
    spec = where if isinstance(where, SourceSpec) else resolve_source(path=str(where))
    return open_source(spec, "text", "id", streaming=True)


def streaming(corpus, tokenizer, world=1, **kw) -> list:
    """``world`` ranks' loaders over a streaming source (helpers' ``loaders``)."""
    return loaders(corpus, tokenizer, world, streaming="true", **kw)


def spans_of(steps) -> list[list]:
    return [spans for step in steps for _, spans in step]


def lengths_of(docs: list[dict], tokenizer) -> dict[str, int]:
    return {d["id"]: len(tokenizer.encode(d["text"], bos=True, eos=True)) for d in docs}


def test_each_layout_is_what_its_name_says(layout):
    """Each file's units tile it, at least MIN_FILE_UNITS (or one per row) a file, within
    its blocks; a file's units are the same whatever other files the source holds."""
    name, folder = layout
    src = source_of(folder)
    units = src.units()
    files = len(src.spec.files)
    per_file = [[(lo, hi) for g, lo, hi in units if g == f] for f in range(files)]
    for ranges in per_file:
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if name in ("small_files", "jsonl_byte_ranges"):
        assert src.spec.fmt == "json" and files == (64 if name == "small_files" else 2)
        sizes = [Path(p).stat().st_size for p in src.spec.files]
        assert [(r[0][0], r[-1][1]) for r in per_file] == [(0, n) for n in sizes]
        assert [len(r) for r in per_file] == [
            min(MIN_FILE_UNITS, -(-n // streaming_module.MIN_UNIT_BYTES)) for n in sizes
        ]
    elif name in ("parquet_row_groups", "arrow_record_batches"):
        assert len(units) == 64 and all(hi - lo == 2 for _, lo, hi in units)
    else:
        blocks = sum(len(src.block_starts(f)) - 1 for f in range(files))
        assert blocks == 4 and len(units) == 32 and all(hi - lo == 4 for _, lo, hi in units)
    # Appending a file changes no other file's units.
    grown = SourceSpec(src.spec.name, src.spec.files + src.spec.files[:1], root=src.spec.root)
    assert source_of(grown).units()[: len(units)] == list(units)


def test_every_document_once_per_pass_in_every_layout(layout, tokenizer):
    """The units hold every document once; through the loader (2 ranks, shuffled units)
    passes 0 and 1 each read every token of every document once. Negative control: the
    check sees one unit left out of pass 0."""
    _, folder = layout
    src = source_of(folder)
    ids = [r[1] for u in src.units() for r in read_unit(src, u)]
    assert sorted(ids) == sorted(d["id"] for d in DOCS)
    lengths = lengths_of(DOCS, tokenizer)
    per_pass = sum(lengths.values()) // (32 * (SEQ + 1)) + 1
    sequences = spans_of(global_steps(streaming(folder, tokenizer, 2, global_batch_size=32),
                                      2 * per_pass + 1))  # fmt: skip
    assert_spans_tile_every_document(sequences, lengths, epochs=(0, 1))
    unit = sequences[0][0][5]
    left_out = [[sp for sp in seq if (sp[4], sp[5]) != (0, unit)] for seq in sequences]
    with pytest.raises(AssertionError, match="pass 0 incomplete"):
        assert_spans_tile_every_document(left_out, lengths, epochs=(0, 1))


def test_json_lines_ranges_hold_the_lines_that_start_in_them(tmp_path, tokenizer):
    """Documents of very unequal length (one 40 times the others) in 2 files: the byte
    ranges tile each file, each holds the lines that start in it (a range inside the long
    line holds none), every line is in one range, and every document is read once in
    each of passes 0, 1 and 2."""
    docs = [dict(d) for d in DOCS[:24]]
    docs[5]["text"] = docs[5]["text"] * 40
    folder = write_jsonl(tmp_path / "d", docs, files=2)
    src = source_of(folder)
    units = src.units()
    for f, path in enumerate(src.spec.files):
        data = Path(path).read_bytes()
        ranges = [(lo, hi) for g, lo, hi in units if g == f]
        assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
        starts = [0] + [i + 1 for i, b in enumerate(data[:-1]) if b == ord("\n")]
        for unit in [u for u in units if u[0] == f]:
            assert [at for at, _, _ in read_unit(src, unit)] == [
                a for a in starts if unit[1] <= a < unit[2]
            ]
    assert sorted(r[1] for u in units for r in read_unit(src, u)) == sorted(d["id"] for d in docs)
    assert any(not read_unit(src, u) for u in units)  # inside the long line
    lengths = lengths_of(docs, tokenizer)
    steps = 3 * sum(lengths.values()) // (64 * (SEQ + 1)) + 1
    sequences = spans_of(global_steps(streaming(folder, tokenizer, global_batch_size=64), steps))
    assert_spans_tile_every_document(sequences, lengths, epochs=(0, 1, 2))


def units_touched(sequences: list[list]) -> set[tuple[int, int]]:
    """(pass, unit) of every span."""
    return {(sp[4], sp[5]) for seq in sequences for sp in seq}


def rows_of(src: StreamSource, touched: set[tuple[int, int]]) -> int:
    """Rows of the units touched (each once per pass)."""
    units = src.units()
    return sum(units[u][2] - units[u][1] for _, u in touched)


def step_spans(loader) -> list[list]:
    return [spans for batch in loader.next_step() for spans in batch["spans"]]


def prepared(folder, tokenizer, counts, world, **kw) -> list:
    """``world`` ranks' loaders over ``folder`` whose token counts were measured ahead
    (scripts/prepare_data.py's way) into a folder of the test's own: what a rank then
    decodes is what its windows read, never what measuring read. (Counts measured by the
    simulated ranks themselves would be decoded by whichever loader of this one process
    planned first, and counts another test left in a shared folder made that depend on
    the order the tests ran in: the test failed alone and passed in the whole tier.)"""
    kw = dict(length_index_dir=str(counts), streaming="true", **kw)
    prepare(cfg(folder, **kw).training, tokenizer, num_proc=1)
    return loaders(folder, tokenizer, world, **kw)


@pytest.mark.parametrize("name", ["parquet_row_groups", "arrow_record_batches"])
def test_a_rank_decodes_only_the_blocks_its_windows_lie_in(folders, tokenizer, name,
                                                           tmp_path):  # fmt: skip
    """4 ranks, 16 windows each a step, blocks of 2 rows as units, counts prepared ahead:
    each rank decodes the rows of the blocks its windows lie in and no others, each once;
    two ranks share at most the one block at the boundary of their slices, and ranks
    that are not neighbours none. Negative control: where units are row ranges of 32-row
    groups, a rank decodes whole row groups, more than its units hold: the tally sees
    them."""
    ranks = prepared(folders[name], tokenizer, tmp_path / "counts", 4, global_batch_size=64)
    touched = [set() for _ in ranks]
    for _ in range(3):
        step = [units_touched(step_spans(r)) for r in ranks]
        for r in range(4):
            touched[r] |= step[r]
            assert len(step[r] & step[(r + 1) % 4]) <= (1 if r < 3 else 0), (r, step)
            assert not step[r] & step[(r + 2) % 4]
    for r, loader in enumerate(ranks):
        src = loader.stream.sources[0]
        assert 0 < src.rows_decoded == rows_of(src, touched[r]) < len(DOCS) / 2

    (loader,) = prepared(folders["parquet_row_ranges"], tokenizer, tmp_path / "ranges", 1,
                         global_batch_size=16)  # fmt: skip
    touched = units_touched(step_spans(loader))
    src = loader.stream.sources[0]
    assert src.rows_decoded > rows_of(src, touched)


def test_a_late_resume_decodes_one_block_wherever_it_lands(tmp_path, tokenizer, monkeypatch):
    """One parquet file of 65 row groups and one JSON lines file of 400 lines, unshuffled
    (one lane): a loader resumed at 1% and at 99% of the stream decodes one row group (or
    one read of lines) before its first window, which starts at the right document.
    Negative control: reaching 99% by reading decodes ~99% of the rows."""
    docs = [{"id": f"d{i}", "text": f"Document number {i:04d} of the corpus.\n"}
            for i in range(400)]  # fmt: skip
    write_parquet_files(tmp_path / "p", docs[:260], files=1, row_group=4)
    write_jsonl(tmp_path / "j", docs, files=1)
    monkeypatch.setattr(streaming_module, "READ_BYTES", 1024)
    line = max(len(json.dumps(d)) for d in docs) + 1
    tokens = [len(tokenizer.encode(d["text"], bos=True, eos=True)) for d in docs]

    for folder, rows, block in [(tmp_path / "p", 260, 4), (tmp_path / "j", 400, 1024 // line + 2)]:
        decoded = {}
        (walker,) = streaming(folder, tokenizer, shuffle="false", seq=7, batch=1)
        for r in (rows // 100, rows - rows // 100):
            # d{r}'s first token, as a checkpoint holds it: the lane in d{r}'s unit at it.
            cursor = Cursor(extent=1, taken=0, lanes=[[0, 0, 0]])
            order = walker.stream.orders[0]
            while True:
                _, unit = order.unit(cursor, cursor.lanes[0][1])
                counts = order.counts.counts(unit)
                if f"d{r}" in {d for _, d, _ in read_unit(order.source, unit)}:
                    break
                cursor.lanes[0][1] += 1
            ids = [d for _, d, _ in read_unit(order.source, unit)]
            cursor.lanes[0][2] = (
                int(counts.cum[ids.index(f"d{r}") - 1]) if ids.index(f"d{r}") else 0
            )
            cursor.taken = cursor.lanes[0][1] + 1
            cursor.tokens = sum(tokens[:r])
            (loader,) = streaming(folder, tokenizer, shuffle="false", seq=7, batch=1)
            loader.seek(Position(0, [cursor]))
            loader.stream.readers[0].share_measured = False  # the text is read, as warm
            src = loader.stream.sources[0]
            assert src.rows_decoded == 0
            assert next(loader)["spans"][0][0][1:3] == [f"d{r}", 0]
            decoded[r] = src.rows_decoded
        assert all(0 < n <= block for n in decoded.values()), decoded  # 99% costs what 1% does

        (replay,) = streaming(folder, tokenizer, shuffle="false", seq=7, batch=32)
        replay.stream.readers[0].share_measured = False
        while replay.position.tokens()[0] < sum(tokens[: rows - rows // 100]):
            next(replay)
        assert replay.stream.sources[0].rows_decoded >= rows * 0.98


def test_restore_at_every_step_in_every_layout(layout, tokenizer):
    """The state after k steps, loaded into fresh loaders (2 ranks), gives exactly the
    rest, for k over more than two passes of shuffled units. Negative control: a
    position one token on does not reproduce the reference."""
    _, folder = layout
    assert_restores_at_every_step(
        lambda: streaming(folder, tokenizer, 2, global_batch_size=96),
        steps=12,
        ahead=2,
        ks=range(11),
        control=5,
    )


@pytest.mark.parametrize("name", ["jsonl_byte_ranges", "parquet_row_ranges"])
@pytest.mark.parametrize("before,after", [(2, 1), (3, 2)])
def test_resume_on_another_rank_count_reads_every_token_once(folders, tokenizer, name, before,
                                                             after):  # fmt: skip
    """Ranks 2 -> 1 and 3 -> 2 over byte ranges and row ranges: the steps are those of an
    uninterrupted 1-rank run, and passes 0 and 1 are each read whole, every token once."""
    folder = folders[name]
    lengths = lengths_of(DOCS, tokenizer)
    steps = 2 * sum(lengths.values()) // (48 * (SEQ + 1)) + 2
    reference = global_steps(streaming(folder, tokenizer, 1, global_batch_size=48), steps)
    first = streaming(folder, tokenizer, before, global_batch_size=48)
    got = global_steps(first, 5)
    second = streaming(folder, tokenizer, after, global_batch_size=48)
    for loader in second:
        loader.load_state_dict(first[0].state_dict())
    got += global_steps(second, steps - 5)
    assert got == reference
    assert_spans_tile_every_document(spans_of(got), lengths, epochs=(0, 1))


def test_invalid_utf8_and_json_lines_are_skipped_and_counted(tmp_path, tokenizer):
    """Each line is decoded alone: a bad line is one bad document (skipped and counted, or
    named by the error policy), and the lines after it are read."""
    good = [json.dumps(d).encode() + b"\n" for d in DOCS[:4]]
    data = good[0] + b'{"id": "bad", "text": "caf\xe9 \xff"}\n' + good[1] + b"{not json\n"
    data += b"\n\r\n" + good[2] + b"[1, 2]\n" + good[3]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_bytes(data)
    (loader,) = streaming(tmp_path / "d", tokenizer, shuffle="false", batch=1)
    spans = [sp for _ in range(30) for seq in next(loader)["spans"] for sp in seq]
    assert {sp[1] for sp in spans} == {d["id"] for d in DOCS[:4]}
    passes = max(sp[4] for sp in spans)
    assert passes >= 1
    assert 3 * passes <= loader.skipped_documents() <= 3 * passes + 3  # 3 bad lines per pass
    (strict,) = streaming(tmp_path / "d", tokenizer, shuffle="false", bad_data="error")
    with pytest.raises(DataError, match=r"a.jsonl@\d+.*not valid UTF-8.*bad_data = 'skip'"):
        next(strict)


def stream_over(spec: SourceSpec, tokenizer, folder: Path) -> TokenStream:
    """The unshuffled token stream of one streaming source, its counts measured here by
    the real code (a ``tokens_field`` set by hand has no config key)."""
    source = source_of(spec)
    keys = [f"file{f}" for f in range(len(spec.files))]
    counts = SourceCounts(source, tokenizer, "skip", str(folder), keys)
    return TokenStream([source], [counts], tokenizer, SEQ, seed=7, shuffle=False)


def windows_of(stream: TokenStream, count: int) -> list:
    got, position = [], stream.start()
    for _ in range(count):
        (window,), position = stream.advance(position, 1)
        got.append(stream.window(*window))
    return got


def test_pretokenized_rows_are_token_arrays(tmp_path, tokenizer):
    """A source with ``tokens_field`` yields int32 token arrays from parquet and JSON
    lines, and its windows are those of the text it was made from (unshuffled: in file
    order, whatever the units)."""
    ids = [tokenizer.encode(d["text"]) for d in DOCS]
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"id": [d["id"] for d in DOCS],
                             "tokens": pa.array(ids, pa.list_(pa.int32()))}),
                   tmp_path / "p" / "a.parquet", row_group_size=8)  # fmt: skip
    write_jsonl(tmp_path / "j", [{"id": d["id"], "tokens": t} for d, t in zip(DOCS, ids)])
    text = stream_over(resolve_source(path=str(write_parquet_files(tmp_path / "t", DOCS, 1, 8))),
                       tokenizer, tmp_path / "counts-t")  # fmt: skip
    reference = windows_of(text, 60)
    for folder in ("p", "j"):
        spec = resolve_source(path=str(tmp_path / folder))
        spec.tokens_field = "tokens"
        src = source_of(spec)
        value = read_unit(src, src.units()[0])[0][2]
        assert value.dtype == np.int32 and value.tolist() in ids
        stream = stream_over(spec, tokenizer, tmp_path / f"counts-{folder}")
        got = windows_of(stream, 60)
        assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(got, reference)), folder
        # The same documents and token ranges (the name and units are the folder's).
        assert [[sp[1:5] for sp in s] for _, s in got] == [
            [sp[1:5] for sp in s] for _, s in reference
        ]


def test_compressed_json_lines_are_read_whole_and_restore(tmp_path, tokenizer):
    (tmp_path / "d").mkdir()
    for f in range(2):
        with gzip.open(tmp_path / "d" / f"part-{f}.jsonl.gz", "wt") as out:
            out.writelines(json.dumps(d) + "\n" for d in DOCS[f * 64 : (f + 1) * 64])
    assert source_of(tmp_path / "d").units().tolist() == [(0, 0, -1), (1, 0, -1)]
    (loader,) = streaming(tmp_path / "d", tokenizer, global_batch_size=8)
    global_steps([loader], 30)
    state = loader.state_dict()
    reference = global_steps([loader], 6)
    (resumed,) = streaming(tmp_path / "d", tokenizer, global_batch_size=8)
    resumed.load_state_dict(state)
    assert global_steps([resumed], 6) == reference


class _Forgetful(dict):
    """A stream cache that keeps nothing."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.parametrize(
    "lines,words",
    [
        (600, 100),  # ~620 bytes a line: a read of 64 KiB holds ~105 documents
        (2000, 10),  # ~80 bytes a line: a read holds ~800 documents, more than a map-style
        # reader keeps (the streaming one keeps its whole last read)
    ],
)  # fmt: skip
def test_a_compressed_file_is_decompressed_once_per_pass(tmp_path, tokenizer, monkeypatch,
                                                         lines, words):  # fmt: skip
    """A compressed file cannot seek without decompressing what comes before: the reader
    keeps its stream open between reads (reads of 64 KiB here, several in a pass), so a
    pass opens it once and decodes each line once, whether a read holds fewer documents
    than the reader keeps or more. Negative control: reopening per read (a stream cache
    that keeps nothing) opens it once per read, decompressing O(position) each time."""
    (tmp_path / "d").mkdir()
    with gzip.open(tmp_path / "d" / "big.jsonl.gz", "wt") as out:
        out.writelines(json.dumps({"id": str(i), "text": "verse " * words}) + "\n"
                       for i in range(lines))  # fmt: skip
    monkeypatch.setattr(streaming_module, "READ_BYTES", 1 << 16)
    real_open = streaming_module._open_binary
    opens = []

    def read_pass(forgetful: bool) -> tuple[int, int]:
        """(opens of the file, lines decoded) while one loader reads pass 0 (and no window
        of pass 1)."""
        (loader,) = streaming(tmp_path / "d", tokenizer, shuffle="false", global_batch_size=64)
        loader.stream.readers[0].share_measured = False  # the text is read, as warm
        src = loader.stream.sources[0]
        total = loader.stream.orders[0].pass_tokens()  # measures the one unit: a read
        src.rows_decoded = 0
        if forgetful:
            monkeypatch.setattr(src._reader, "_streams", _Forgetful())
        opens.clear()
        monkeypatch.setattr(streaming_module, "_open_binary",
                            lambda path: opens.append(path) or real_open(path))  # fmt: skip
        step = 64 * (SEQ + 1)
        while loader.position.tokens()[0] + step <= total:
            loader.next_step()
        monkeypatch.setattr(streaming_module, "_open_binary", real_open)
        return len(opens), src.rows_decoded

    opened, decoded = read_pass(forgetful=False)
    assert opened == 1 and lines * 0.98 <= decoded <= lines, (opened, decoded)
    assert read_pass(forgetful=True)[0] >= 3


def test_a_read_of_more_documents_than_the_reader_keeps_is_read_whole(tmp_path, tokenizer):
    """A compressed JSON lines file of 300 short lines is one unit, and one 1 MiB read
    returns all 300 documents, more than the reader keeps: the pass reads every document
    whole, once, in file order."""
    (tmp_path / "d").mkdir()
    docs = [{"id": str(i), "text": f"verse {i}"} for i in range(300)]
    with gzip.open(tmp_path / "d" / "a.jsonl.gz", "wt") as out:
        out.writelines(json.dumps(d) + "\n" for d in docs)
    lengths = lengths_of(docs, tokenizer)
    (loader,) = streaming(tmp_path / "d", tokenizer, shuffle="false", global_batch_size=16)
    steps = sum(lengths.values()) // (16 * (SEQ + 1)) + 1
    sequences = [spans for _ in range(steps) for spans in step_spans(loader)]
    assert_spans_tile_every_document(sequences, lengths)
    first = [sp[1] for seq in sequences for sp in seq if sp[2] == 0 and sp[4] == 0]
    assert first == [d["id"] for d in docs]


def test_a_unit_of_only_bad_documents_is_stepped_over_in_every_pass(tmp_path, tokenizer):
    """4 files, one of only empty texts: its units hold no tokens, so every pass (the
    units shuffled anew, the empty ones anywhere in the order) reads every good document
    whole and none of the empty ones, pass after pass, and counts 6 skipped a pass."""
    (tmp_path / "d").mkdir()
    good = []
    for f in range(4):
        rows = [{"id": f"{f}-{i}", "text": "" if f == 3 else DOCS[i]["text"]} for i in range(6)]
        (tmp_path / "d" / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        good += rows if f < 3 else []
    lengths = lengths_of(good, tokenizer)
    (loader,) = streaming(tmp_path / "d", tokenizer, seq=15, global_batch_size=32)
    steps = 4 * sum(lengths.values()) // (32 * 16) + 1
    sequences = [spans for _ in range(steps) for spans in step_spans(loader)]
    assert_spans_tile_every_document(sequences, lengths, epochs=(0, 1, 2, 3))
    assert not {sp[1] for seq in sequences for sp in seq} - set(lengths)
    passes = loader.position.cursors[0].pass_
    assert 6 * passes <= loader.skipped_documents() <= 6 * passes + 6


def test_an_old_loader_state_is_refused_in_one_line(tmp_path, tokenizer):
    """A format-3 loader entry (per-shard cursors) is refused by the loader with the fix.
    A position over other sources is one where this run's source joins (pass 0) and the
    saved one is kept, retired (test_mix.py)."""
    (loader,) = streaming(write_jsonl(tmp_path / "j", DOCS, 2), tokenizer)
    entry = from_tensor(loader.state_dict()["dp_rank_0"])
    old = {"version": 3, "shards": {0: {"epoch": 0, "unit": 0, "at": 0}}}
    with pytest.raises(DataError, match=r"format 3, this version reads 5.*exclude_from") as e:
        loader.load_state_dict({"dp_rank_0": to_tensor(old)})
    assert "\n" not in str(e.value)
    entry["sources"] = ["another"]
    loader.load_state_dict({"dp_rank_0": to_tensor(entry)})
    assert list(loader.position.retired) == ["another"]
    (untouched,) = streaming(tmp_path / "j", tokenizer)
    assert torch.equal(next(loader)["input"], next(untouched)["input"])  # still at the start


@pytest.mark.parametrize("mode", ["true", "false"], ids=["streaming", "map-style"])
def test_a_file_appended_between_runs_joins_at_the_next_pass(tmp_path, tokenizer, mode):
    """4 parquet files, 2 steps into pass 0, then a fifth file appended and the run
    resumed: pass 0 goes on over the 4 files it began with and reads each of their tokens
    once, none of the new file's; pass 1 reads all 5 files' tokens once, from the
    provenance spans. The data fingerprints differ only by the appended file, which is no
    change to refuse. Map-style, pass 1 cuts other row ranges (8-row units over 128 rows,
    6-row ones over 96), so a reader that kept pass 0's rows by a unit's index in the pass
    reads stale rows there. Negative control: the cursor moved onto the grown corpus (its
    pass 0 over 5 files, or 128 rows) reads tokens twice or not at all."""
    from torchtitan.data import local_plan
    from torchtitan.data.fingerprint import fingerprint_diff, grown_sources

    folder = write_parquet_files(tmp_path / "c", DOCS[:96], files=4, row_group=8)
    old_lengths = lengths_of(DOCS[:96], tokenizer)
    all_lengths = lengths_of(DOCS, tokenizer)
    kw = dict(global_batch_size=8, length_index_dir=tmp_path / "counts")
    (loader,) = loaders(folder, tokenizer, streaming=mode, **kw)
    before = spans_of(global_steps([loader], 2))
    state = loader.state_dict()
    old_print = local_plan(loader_cfg(folder, tmp_path, mode), tokenizer).fingerprint
    write_parquet(folder / "part-004.parquet", DOCS[96:], row_group=8)
    new_print = local_plan(loader_cfg(folder, tmp_path, mode), tokenizer).fingerprint
    assert fingerprint_diff(old_print, new_print) == []
    assert grown_sources(old_print, new_print) == [
        "source 'c': 1 file(s) appended (part-004.parquet)"
    ]

    def resumed(entry_change=None) -> list:
        (grown,) = loaders(folder, tokenizer, streaming=mode, **kw)
        saved = {k: v for k, v in state.items()}
        if entry_change:
            entry = from_tensor(saved["dp_rank_0"])
            entry_change(entry)
            saved["dp_rank_0"] = to_tensor(entry)
        grown.load_state_dict(saved)
        sequences = list(before)
        while grown.position.cursors[0].pass_ < 2:
            sequences += spans_of(global_steps([grown], 1))
        return sequences

    sequences = resumed()
    pass_of = lambda p: [[sp for sp in seq if sp[4] == p] for seq in sequences]  # noqa: E731
    assert_spans_tile_every_document(pass_of(0), old_lengths, epochs=(0,))
    assert_spans_tile_every_document(pass_of(1), all_lengths, epochs=(1,))

    def onto_grown(entry):
        entry["cursors"][0][1] = 5 if mode == "true" else 128  # all 5 files, or 128 rows

    moved = resumed(onto_grown)
    with pytest.raises(AssertionError):
        assert_spans_tile_every_document(
            [[sp for sp in seq if sp[4] == 0] for seq in moved], old_lengths, epochs=(0,)
        )


def loader_cfg(folder, tmp_path, mode="true"):
    from helpers import cfg

    return cfg(folder, streaming=mode, length_index_dir=tmp_path / "counts").training
