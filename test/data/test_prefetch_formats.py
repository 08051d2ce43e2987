"""JSON lines and Arrow files in a bucket fetched ahead (streaming.BlockPrefetch, as
test_prefetch.py does for parquet), on the local S3 server of harness/s3.py: a JSON lines
unit's byte range in one ranged GET (and the line running past it), an Arrow file whole
(its stream format has no index of its batches) once however many of its batches are
asked at once. The batches, and a resume, are those of reading without it; nothing is
fetched twice; the counts (fetched, taken, dropped) add up.

Negative controls: without prefetch nothing is fetched ahead and the JSON lines reads
fetch more bytes (the readahead stream); the state after 2 steps does not give the steps
after 3; a unit's lines read with a span cut two bytes short differ.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import (
    assert_workers_fetch_their_own,
    bucket_cfg,
    bucket_loader,
    read_unit,
    same_steps,
)

from harness import s3
from torchtitan.data import loader as loader_module
from torchtitan.data import streaming
from torchtitan.data.prepare import prepare
from torchtitan.data.sources import resolve_source

pytestmark = pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))

STEPS = 6


def _text(f: int, i: int) -> str:
    return f"File {f}, line {i}: " + "a verse, and another. " * (2 + (i * 7 + f) % 23)


def write_jsonl(folder: Path) -> Path:
    """4 files of 150 lines (~40 KiB each: 10 units of 4 KiB), lines of 50-550 bytes."""
    folder.mkdir(parents=True)
    for f in range(4):
        rows = [{"id": f"d{f}-{i}", "text": _text(f, i)} for i in range(150)]
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_arrow(folder: Path) -> Path:
    """4 Arrow stream files (as ``save_to_disk`` writes them) of 150 rows in batches of 10."""
    folder.mkdir(parents=True)
    for f in range(4):
        table = pa.table({"id": [f"d{f}-{i}" for i in range(150)],
                          "text": [_text(f, i) for i in range(150)]})  # fmt: skip
        with pa.OSFile(str(folder / f"part-{f}.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=10):
                    writer.write_batch(batch)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """One bucket holding both corpora, their counts measured into local folders; yields
    {kind: (corpus URL, counts)} and the traffic."""
    import s3fs

    tmp = tmp_path_factory.mktemp("formats")
    traffic = s3.Traffic(ranges=[])
    with s3.local_s3(traffic) as (bucket, _):
        corpora = {}
        for kind, write in (("jsonl", write_jsonl), ("arrow", write_arrow)):
            s3fs.S3FileSystem().put(str(write(tmp / kind)), f"{bucket}/{kind}", recursive=True)
            url, counts = f"s3://{bucket}/{kind}", str(tmp / f"counts-{kind}")
            prepare(bucket_cfg(url, counts).training, tokenizer, num_proc=1, progress=False)
            corpora[kind] = (url, counts)
        yield corpora, traffic


def _reset(traffic: s3.Traffic):
    time.sleep(0.2)  # bodies still being sent are counted before the reset
    traffic.reset()
    with traffic.lock:
        traffic.ranges.clear()


def _sent(traffic: s3.Traffic, suffix: str) -> tuple[int, list]:
    """Body bytes sent of objects named ``*suffix``, and their ranged GETs (path, range)."""
    time.sleep(0.2)  # the server counts a body once it has sent it
    with traffic.lock:
        sent = sum(n for name, n in traffic.by_name.items() if name.endswith(suffix))
        return sent, [r for r in traffic.ranges if r[0].endswith(suffix)]


@pytest.mark.parametrize("kind", ["jsonl", "arrow"])
def test_fetched_ahead_once_with_the_batches_of_reading_without(tokenizer, served, kind):
    """STEPS steps read fetching ahead give the batches of a loader without it; every
    block fetched was taken or is held for the steps planned beyond; nothing is fetched
    twice: JSON lines, no ranged GET asked twice and every read served from the ranges
    fetched ahead (the server got only those and their line tails); Arrow, each file
    sent once (its bytes, at most once per object). Negative controls: without prefetch
    nothing is fetched ahead, and JSON lines reads through the readahead stream fetch
    more bytes."""
    traffic, (url, counts) = served[1], served[0][kind]
    suffix = f".{kind}"
    depth = loader_module.PREFETCH_STEPS
    plain = bucket_loader(tokenizer, url, counts, 0)
    _reset(traffic)
    reference = [plain.next_step() for _ in range(STEPS)]
    assert plain.stream.sources[0].prefetch.fetched == 0, "negative control"
    plain_bytes, _ = _sent(traffic, suffix)

    fetching = bucket_loader(tokenizer, url, counts, depth)
    _reset(traffic)
    got = [fetching.next_step() for _ in range(STEPS)]
    (source,) = fetching.stream.sources
    prefetch = source.prefetch
    prefetch.wait()
    assert same_steps(got, reference)
    assert prefetch.fetched > 0 and prefetch.dropped == 0
    assert prefetch.taken + len(prefetch._held) == prefetch.fetched
    sent, ranges = _sent(traffic, suffix)
    if kind == "jsonl":
        asked, tails, other = _ranges(source, ranges)
        assert len(asked) == len(set(asked)) == prefetch.fetched, "each range once"
        assert other == [] and len(tails) == len(set(tails)), other
        assert sent < plain_bytes, "negative control: the readahead stream fetches more"
    else:
        sizes = _sizes(url)
        assert prefetch.fetched > len(sizes), "several batches of a file asked"
        assert 0 < sent <= sum(sizes.values()), (sent, sizes)
        with traffic.lock:
            per_object = {n: b for n, b in traffic.by_name.items() if n.endswith(suffix)}
        assert all(per_object[n] <= sizes[n] for n in per_object), (per_object, sizes)


def _ranges(source, ranges: list) -> tuple[list, list, list]:
    """The ranged GETs of JSON lines objects, as (name, first byte, last byte): those of a
    unit's range (from the byte before it to LINE_TAIL_BYTES past it, or the file's
    end), those going on past such a GET's end (a longer line), and any other (a read
    through the stream)."""
    sizes = _sizes(source.spec.files[0].rsplit("/", 1)[0])
    spans = set()
    for f, lo, hi in source.units():
        name = source.spec.relative_name(source.spec.files[f])
        tail = min(streaming.LINE_TAIL_BYTES, hi - lo)
        spans.add((name, max(0, lo - 1), min(sizes[name], hi + tail) - 1))
    ends = {(name, last + 1) for name, _, last in spans}
    asked, tails, other = [], [], []
    for path, header in ranges:
        first, last = map(int, re.match(r"bytes=(\d+)-(\d+)", header).groups())
        name = path.rsplit("/", 1)[1]
        if (name, first, min(last, sizes[name] - 1)) in spans:
            asked.append((name, first, last))
        elif (name, first) in ends:
            tails.append((name, first, last))
            ends.add((name, last + 1))  # the next, if the line outruns this one too
        else:
            other.append((name, first, last))
    return asked, tails, other


def _sizes(url: str) -> dict[str, int]:
    import s3fs

    fs = s3fs.S3FileSystem()
    return {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.find(url)}


@pytest.mark.parametrize("kind", ["jsonl", "arrow"])
def test_a_resume_fetching_ahead_gives_the_same_batches(tokenizer, served, kind):
    """The state after 3 steps, loaded into a fresh loader fetching ahead, gives the
    steps after it of a run without prefetch. Negative control: the state after 2 does
    not."""
    url, counts = served[0][kind]
    reference = bucket_loader(tokenizer, url, counts, 0)
    steps, states = [], []
    for _ in range(STEPS):
        states.append(reference.state_dict())
        steps.append(reference.next_step())
    resumed = bucket_loader(tokenizer, url, counts, 2)
    resumed.load_state_dict(states[3])
    assert same_steps([resumed.next_step() for _ in range(3)], steps[3:])
    assert resumed.stream.sources[0].prefetch.fetched > 0
    other = bucket_loader(tokenizer, url, counts, 2)
    other.load_state_dict(states[2])
    assert not same_steps([other.next_step() for _ in range(3)], steps[3:])


@pytest.mark.parametrize("kind", ["jsonl", "arrow"])
def test_loader_workers_fetching_ahead_give_the_same_batches(tokenizer, served, kind):
    """With 2 loader workers, each fetching ahead what it reads, the batches are those of
    a loader without workers or prefetch. Negative control: a worker's prefetch is its
    own (the rank's process fetches nothing)."""
    url, counts = served[0][kind]
    assert_workers_fetch_their_own(tokenizer, url, counts, 3)


def test_a_jsonl_units_lines_are_those_of_the_file_read_as_a_stream(served, tmp_path, monkeypatch):
    """Every unit of two crafted files, read from its range fetched ahead, gives the
    documents (positions, ids, values) of the same unit read through the stream: lines of
    64 bytes, so that every range begins just after a newline; and lines of 1-9,000
    bytes, one longer than two ranges (an empty unit), the last without its newline, with
    tails of 100 bytes (a line outruns several, each twice the last). Negative control: a span cut two bytes short
    (its last line broken) gives other documents."""
    import s3fs

    _, traffic = served
    bucket = served[0]["jsonl"][0].split("/")[2]
    lines = [
        json.dumps({"id": f"a{i}", "text": "x" * (64 - 24 - len(str(i)))}) for i in range(1024)
    ]
    assert {len(x) + 1 for x in lines} == {64}
    odd = [json.dumps({"text": "y" * n}) for n in (1, 9000, *range(40, 4000, 97))]
    fs = s3fs.S3FileSystem()
    fs.pipe_file(f"{bucket}/crafted/even.jsonl", "".join(x + "\n" for x in lines).encode())
    fs.pipe_file(f"{bucket}/crafted/odd.jsonl", "\n".join(odd).encode())  # no last newline
    monkeypatch.setattr(streaming, "LINE_TAIL_BYTES", 100)
    spec = resolve_source(path=f"s3://{bucket}/crafted")
    stream = streaming.StreamSource(spec, "text", "id")
    streamed = streaming.StreamSource(spec, "text", "id")
    streamed.prefetch = None
    units = list(stream.units())
    assert len(units) >= 30 and any(lo % 4096 == 0 and lo for _, lo, _ in units)
    reader = stream._reader
    short = 0
    for unit in units:
        want = read_unit(streamed, unit)
        span, size = reader.fetch(stream, unit)
        assert size == len(span.data) and span.start == max(0, unit[1] - 1)
        reader._spans[span.key] = span
        assert read_unit(stream, unit) == want, unit
        assert not reader._spans, "let go once the unit is read"
        if want and span.data.endswith(b"\n") and len(span.data) > 1:
            cut = streaming._Span(span.key, span.start, span.data[:-2])
            reader._spans[cut.key] = cut
            short += read_unit(stream, unit) != want
            reader._spans.clear()
    assert short > 0, "negative control: a span two bytes short reads other lines"
    del traffic


def test_jsonl_units_read_in_turn_are_each_read_from_their_fetched_bytes(served, monkeypatch):
    """The order's lanes read their units in turn, a read at a time: each unit's bytes
    fetched ahead are kept until it is read through, so reading two units alternately
    (reads of 300 bytes) never goes back to the file, and gives each unit's documents as
    read alone. Negative control: holding one unit's bytes at a time, the first unit's
    second read goes to the file."""
    url = served[0]["jsonl"][0]
    monkeypatch.setattr(streaming, "READ_BYTES", 300)
    spec = resolve_source(path=url)
    stream = streaming.StreamSource(spec, "text", "id")
    streamed = streaming.StreamSource(spec, "text", "id")
    streamed.prefetch = None
    first, second = [u for u in stream.units() if u[2] - u[1] > 1000][:2]
    want = {u: read_unit(streamed, u) for u in (first, second)}
    reader = stream._reader

    def in_turn() -> dict:
        for unit in (first, second):
            stream.prefetch.want(tuple(unit), 0)
        stream.prefetch.wait()
        got, at = {first: [], second: []}, {first: first[1], second: second[1]}
        while any(a is not None for a in at.values()):
            for unit in (first, second):
                if at[unit] is not None:
                    docs, at[unit], _ = stream.read(unit, at[unit])
                    got[unit] += [(start, doc_id, value) for start, _, doc_id, value in docs]
        return got

    def no_file(*_):
        raise AssertionError("read from the file")

    monkeypatch.setattr(reader, "_stream", no_file)
    assert in_turn() == want
    monkeypatch.setattr(streaming, "KEEP_SPAN_BYTES", 1)
    with pytest.raises(AssertionError, match="read from the file"):
        in_turn()
