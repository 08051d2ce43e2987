"""Corpus reads from a bucket fetched ahead (streaming.BlockPrefetch, driven by
loader.fetching_ahead), on a real S3 API (moto's server on 127.0.0.1, reached through
fsspec → s3fs → botocore, its answers counted by harness.s3.Traffic): the batches are
those of reading without it (and after a resume), each row group is fetched once (the
bytes the server sent equal those a loader without prefetch asks for the same steps),
and the bounds on blocks held and fetches in flight hold."""

from __future__ import annotations

import time

import pytest
from helpers import (
    assert_workers_fetch_their_own,
    bucket_cfg,
    bucket_loader,
    distinct_parquet,
    same_steps,
)

from harness import s3
from torchtitan.data import loader as loader_module
from torchtitan.data import streaming
from torchtitan.data.prepare import prepare

pytestmark = pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))

STEPS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """A bucket holding 4 parquet files of 40 documents in row groups of 10, their counts
    measured beforehand into a local folder (warm), shared by this module's tests (a
    server and its corpus take seconds); yields (corpus URL, counts, traffic)."""
    import s3fs

    tmp = tmp_path_factory.mktemp("prefetch")
    folder, _ = distinct_parquet(tmp / "c", 4, 40, 10,
                                 lambda f, i: f"File {f}, row {i}: " + "a verse. " * (3 + i % 7))  # fmt: skip
    traffic = s3.Traffic(log=[])
    with s3.local_s3(traffic) as (bucket, _):
        s3fs.S3FileSystem().put(str(folder), f"{bucket}/corpus", recursive=True)
        url, counts = f"s3://{bucket}/corpus", str(tmp / "counts")
        prepare(bucket_cfg(url, counts).training, tokenizer, num_proc=1, progress=False)
        # the same counts in the bucket too (the files are named by content)
        s3fs.S3FileSystem().put(counts, f"{bucket}/counts", recursive=True)
        yield url, counts, traffic


@pytest.fixture
def store(served):
    """``served``, its request counts reset for this test."""
    served[2].reset()
    return served


def _parquet_bytes(traffic: s3.Traffic) -> int:
    time.sleep(0.2)  # the server counts a body once it has sent it
    with traffic.lock:
        return sum(n for name, n in traffic.by_name.items() if name.endswith(".parquet"))


def _settle(loader) -> streaming.BlockPrefetch:
    (source,) = loader.stream.sources
    source.prefetch.wait()
    return source.prefetch


def test_prefetched_batches_and_bytes_are_those_of_reading_without(tokenizer, store):
    """Reading STEPS steps fetching ahead gives the batches of a loader without it, and
    the row groups it fetched (those of its STEPS + depth steps planned) are the bytes the
    loader without prefetch fetches reading STEPS + depth steps: nothing fetched twice,
    nothing the steps do not read. Every block fetched ahead was taken by a read or is
    one of the steps planned beyond the last read, and a seek drops those. Negative
    controls: without prefetch nothing is fetched ahead, and its STEPS steps alone fetch
    fewer bytes; before the seek blocks are held."""
    url, counts, traffic = store
    depth = loader_module.PREFETCH_STEPS
    traffic.reset()
    plain = bucket_loader(tokenizer, url, counts, 0)
    reference = [plain.next_step() for _ in range(STEPS + depth)]
    assert plain.stream.sources[0].prefetch.fetched == 0
    needed = _parquet_bytes(traffic)
    traffic.reset()
    fetching = bucket_loader(tokenizer, url, counts, depth)
    got = [fetching.next_step() for _ in range(STEPS)]
    prefetch = _settle(fetching)
    assert same_steps(got, reference[:STEPS])
    assert prefetch.fetched > 0 and prefetch.dropped == 0
    assert prefetch.taken + len(prefetch._held) == prefetch.fetched
    assert _parquet_bytes(traffic) == needed
    # A seek (a restart elsewhere) drops what was fetched for the steps left behind.
    held = len(prefetch._held)
    assert held > 0
    fetching.seek()
    assert len(prefetch._held) == 0 and prefetch.dropped == held
    assert same_steps([fetching.next_step()], reference[:1])
    traffic.reset()
    short = bucket_loader(tokenizer, url, counts, 0)
    [short.next_step() for _ in range(STEPS)]
    assert _parquet_bytes(traffic) < needed


def test_a_resume_mid_run_fetching_ahead_gives_the_same_batches(tokenizer, store):
    """The state after 3 steps, loaded into a fresh loader fetching ahead, gives the steps
    after it of an uninterrupted run without prefetch. Negative control: the state after
    2 steps does not."""
    url, counts, _ = store
    reference = [bucket_loader(tokenizer, url, counts, 0) for _ in range(1)][0]
    steps, states = [], []
    for _ in range(STEPS):
        states.append(reference.state_dict())
        steps.append(reference.next_step())
    resumed = bucket_loader(tokenizer, url, counts, 2)
    resumed.load_state_dict(states[3])
    assert same_steps([resumed.next_step() for _ in range(3)], steps[3:])
    other = bucket_loader(tokenizer, url, counts, 2)
    other.load_state_dict(states[2])
    assert not same_steps([other.next_step() for _ in range(3)], steps[3:])


def test_loader_workers_fetching_ahead_give_the_same_batches(tokenizer, store):
    """With 2 loader workers, each fetching ahead the blocks of the micro-batches it
    makes, the batches are those of a loader without workers or prefetch. Negative
    control: a worker's prefetch is its own (the rank's process fetches nothing)."""
    url, counts, _ = store
    assert_workers_fetch_their_own(tokenizer, url, counts, 4)


def test_blocks_held_and_fetches_in_flight_stay_bound(tokenizer, store, monkeypatch):
    """At most PREFETCH_BLOCKS blocks fetched and not taken, and PREFETCH_THREADS fetches
    at once, however far ahead the loader plans; the batches are unchanged. Negative
    control: with the bounds raised, more are held and in flight."""
    url, counts, _ = store
    reference = [bucket_loader(tokenizer, url, counts, 0).next_step() for _ in range(1)]

    def peaks(blocks: int, threads: int) -> tuple[int, int]:
        monkeypatch.setattr(streaming, "PREFETCH_BLOCKS", blocks)
        monkeypatch.setattr(streaming, "PREFETCH_THREADS", threads)
        loader = bucket_loader(tokenizer, url, counts, STEPS)
        first = [loader.next_step()]
        assert same_steps(first, reference)
        prefetch = _settle(loader)
        return prefetch.peak_held, prefetch.peak_in_flight

    held, in_flight = peaks(2, 1)
    assert held <= 2 and in_flight <= 1
    held, in_flight = peaks(64, 4)
    assert held > 2 and in_flight > 1


def test_count_files_in_a_bucket_are_read_ahead_once(tokenizer, store):
    """Counts in the bucket: the loader reads the count files of the units the order
    reaches next ahead (index.SourceCounts.read_ahead), each once (the server sent each
    object's bytes once), and the batches are those of reading them in line. Negative
    control: with the read-ahead off, no file is read before its lane takes its unit
    (fewer files read for the same steps)."""
    import s3fs

    url, _, traffic = store
    bucket = url.split("/")[2]
    counts, fs = f"s3://{bucket}/counts", s3fs.S3FileSystem()
    sizes = {"/" + p: fs.size(p) for p in fs.find(f"{bucket}/counts")}

    def run(ahead: bool) -> tuple[list, dict]:
        with traffic.lock:
            traffic.log.clear()
        loader = bucket_loader(tokenizer, url, counts, 0)
        for order in loader.stream.orders:
            order.counts.reads_ahead = ahead
        steps = [loader.next_step() for _ in range(3)]
        for order in loader.stream.orders:  # what was read ahead and taken is let go
            assert not set(order.counts._ahead) & set(order.counts._mem)
        time.sleep(0.2)
        got: dict[str, int] = {}
        with traffic.lock:
            for _, kind, path, sent in traffic.log:
                if kind.startswith("GET") and path.endswith(".npz"):
                    got[path] = got.get(path, 0) + sent
        return steps, got

    in_line, read_in_line = run(False)
    ahead, read_ahead = run(True)
    assert same_steps(ahead, in_line)
    assert all(read_ahead[n] == sizes[n] for n in read_ahead), (read_ahead, sizes)
    assert len(read_ahead) > len(read_in_line)
