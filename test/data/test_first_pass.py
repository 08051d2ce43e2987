"""The first pass at full speed: each document tokenized once (the window readers take
the tokens its unit's measuring kept, index.UnitTokens, in this process or from the
sidecar another process wrote), the same batches as reading the text, sidecars that go
when their unit is read, and memory that stays flat over a long first pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import cfg, distinct_parquet

from harness import s3
from torchtitan.data import build_dataloader
from torchtitan.data import index as length_index
from torchtitan.data.order import LANES, LOOKAHEAD


def corpus(folder: Path, files: int = 6, docs: int = 80) -> tuple[Path, dict[str, str]]:
    """``files`` parquet files of ``docs`` documents, every text distinct (so a call of the
    tokenizer names its document), 4 units a file; and the texts by id."""
    return distinct_parquet(
        folder,
        files,
        docs,
        docs // 4,
        lambda f, i: f"File {f}, document {i}: " + "a verse. " * (4 + i % 9),
    )


def loader_of(folder, counts, streaming: str, workers: int = 0, share: bool = True, **kw):
    c = cfg(folder, length_index_dir=counts, streaming=streaming, num_workers=workers,
            global_batch_size=8, **kw)  # fmt: skip
    loader = build_dataloader(c, TOKENIZER, 0, 1)
    for reader in loader.stream.readers:
        reader.share_measured = share
    return loader


@pytest.fixture(autouse=True)
def _tokenizer(tokenizer):
    global TOKENIZER
    TOKENIZER = tokenizer


def measure_all(order):
    """Every unit of ``order`` measured as a lane reaching it would (its tokens kept):
    the sidecars another process leaves for this one's readers."""
    for unit in order.units(order.source.extent()):
        order.counts.counts(unit)


def first_pass(loader) -> tuple[set, set]:
    """Reads steps until the second pass has begun: (documents read in the first pass,
    those read in the second)."""
    read: dict[int, set] = {0: set(), 1: set()}
    while True:
        for batch in loader.next_step():
            for spans in batch["spans"]:
                for _, doc_id, _, _, pass_, _ in spans:
                    read.setdefault(pass_, set()).add(doc_id)
        if loader.take_epoch_starts():
            return read[0], read[1]


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_a_first_pass_tokenizes_each_document_once(tmp_path, streaming, calls):
    """Over a whole first pass, the tokenizer sees each document exactly once. Negative
    control: readers
    that do not take the measured tokens (the reader before #39) tokenize every document
    twice on the first pass."""
    folder, texts = corpus(tmp_path / "c")
    first, second = first_pass(loader_of(folder, tmp_path / "n1", streaming))
    assert first == set(texts)  # the whole corpus, read
    once = [d for d in texts if d not in second]
    assert len(once) > len(texts) // 2 and all(calls[texts[d]] == 1 for d in once)
    # Read again in the second pass: tokenized there unless its unit's tokens are still
    # kept (a unit finished in the step that began the second pass).
    assert all(calls[texts[d]] in (1, 2) for d in second)

    calls.clear()
    first, second = first_pass(loader_of(folder, tmp_path / "n2", streaming, share=False))
    assert first == set(texts)
    twice = [d for d in texts if d not in second]
    assert twice and all(calls[texts[d]] >= 2 for d in twice)


@pytest.mark.parametrize("streaming,workers", [("true", 0), ("true", 2), ("false", 2)])
def test_the_first_pass_gives_the_batches_of_reading_the_text(tmp_path, streaming, workers,
                                                              monkeypatch):  # fmt: skip
    """A cold loader taking the measured tokens, with or without workers (which measure
    in one process and read in another: the sidecars), gives the batches of a loader
    that reads and tokenizes the text, token for token and span for span, over a pass
    and into the next. Units measured in pieces from one document on (1, 3, 12 ...)."""
    monkeypatch.setattr(length_index, "FIRST_PIECE_DOCS", 1)
    folder, _ = corpus(tmp_path / "c")
    shared = loader_of(folder, tmp_path / "n1", streaming, workers)
    plain = loader_of(folder, tmp_path / "n2", streaming, share=False)
    for _ in range(45):
        for a, b in zip(shared.next_step(), plain.next_step(), strict=True):
            assert torch.equal(a["input"], b["input"]) and torch.equal(a["label"], b["label"])
            assert a["spans"] == b["spans"]
    shared.close()


def test_a_sidecar_of_another_process_is_read_instead_of_the_text(tmp_path, calls):
    """Tokens measured by another process (a worker, another rank) reach this one through
    the sidecars: a loader whose units were all measured elsewhere tokenizes nothing on
    its first pass. Negative control: without the sidecars, it tokenizes every document."""
    folder, texts = corpus(tmp_path / "c")
    counts = tmp_path / "n"
    measurer = loader_of(folder, counts, "true").stream.orders[0]
    measure_all(measurer)  # every unit measured, its tokens left for the readers
    assert len(list(counts.rglob("*.tokens"))) == len(measurer.units(measurer.source.extent()))
    calls.clear()
    reader = loader_of(folder, counts, "true")
    for _ in range(8):
        reader.next_step()
    assert sum(calls.values()) == 0

    for sidecar in counts.rglob("*.tokens"):
        sidecar.unlink()
    reader = loader_of(folder, counts, "true")
    for _ in range(8):
        reader.next_step()
    assert sum(calls.values()) > 0


@pytest.mark.parametrize("first_piece", [16, 1])
def test_two_ranks_tokenize_each_document_once_and_keep_what_their_lanes_read(
    tmp_path, calls, monkeypatch, first_piece
):
    """Two ranks (two loaders on one counts folder, stepped in turn) split the measuring
    and each reads its slice of every step: over the first pass, each document is
    tokenized once in all (the other rank's through the sidecars), and once the pass is
    read, neither keeps the measured tokens of a unit of that pass, also of units it
    measured ahead and never read the end of (let go by the plan, not by who read the
    last token). Negative control: midway, each keeps those of the units its lanes are
    in. Units of 5 documents, measured whole (first pieces of 16) or in pieces of 1, 3
    and 1, each piece claimed by one rank."""
    monkeypatch.setattr(length_index, "FIRST_PIECE_DOCS", first_piece)
    folder, texts = corpus(tmp_path / "c", files=8, docs=80)
    c = cfg(folder, length_index_dir=tmp_path / "n", streaming="true", global_batch_size=8)
    ranks = [build_dataloader(c, TOKENIZER, r, 2) for r in range(2)]
    second: set = set()
    for step in range(10_000):
        for loader in ranks:
            for batch in loader.next_step():
                second |= {d for spans in batch["spans"] for _, d, _, _, p, _ in spans if p}
        if step == 20:
            assert all(r.stream.orders[0].counts._unit_tokens for r in ranks)
        if any(r.take_epoch_starts() for r in ranks):
            break
    assert all(calls[texts[d]] == 1 for d in texts if d not in second)
    for _ in range(2):
        for loader in ranks:
            loader.next_step()
    for loader in ranks:  # kept: at most units the lanes read now (a sidecar a second pass
        order, cursor = loader.stream.orders[0], loader.position.cursors[0]  # met again)
        lanes = {tuple(int(x) for x in order.unit(cursor, k)[1]) for _, k, _ in cursor.lanes}
        assert {unit for unit, _ in order.counts._unit_tokens} <= lanes


def test_a_unit_whose_counts_kept_no_tokens_is_not_looked_for(tmp_path, monkeypatch):
    """Counts measured with no reader to keep tokens for (scripts/prepare_data.py) say so:
    a loader over them never looks for a sidecar (a request a unit in a bucket). Negative
    control: over counts whose measuring kept tokens, it does."""
    folder, _ = corpus(tmp_path / "c")
    looked: list = []

    def loader_counting(counts):
        loader = loader_of(folder, counts, "true")
        real = loader.stream.orders[0].counts._load_tokens
        loader.stream.orders[0].counts._load_tokens = lambda *k: looked.append(k) or real(*k)
        return loader

    prepared = loader_of(folder, tmp_path / "prepared", "true").stream.orders[0]
    prepared.pass_tokens()  # as prepare_data measures: no lane reads them, none kept
    assert not list((tmp_path / "prepared").rglob("*.tokens"))
    first_pass(loader_counting(tmp_path / "prepared"))
    assert looked == []
    measure_all(loader_of(folder, tmp_path / "kept", "true").stream.orders[0])
    first_pass(loader_counting(tmp_path / "kept"))
    assert looked


def test_sidecars_that_do_not_fit_their_counts_are_not_read(tmp_path):
    """A sidecar is a cache, never the truth: one that is damaged, or that holds another
    unit's tokens under this unit's name (the sidecars swapped round), is passed over and
    the text read; the batches are those of reading the text. Negative control: the same
    swapped sidecars, trusted without the check, give other batches."""
    folder, _ = corpus(tmp_path / "c")
    counts = tmp_path / "n"
    measure_all(loader_of(folder, counts, "true").stream.orders[0])
    sidecars = sorted(counts.rglob("*.tokens"))
    data = [p.read_bytes() for p in sidecars]
    for i, path in enumerate(sidecars):  # each takes its neighbour's; the last is torn
        path.write_bytes(data[(i + 1) % len(data)] if i < len(data) - 1 else data[i][:40])
    reference = loader_of(folder, tmp_path / "plain", "true", share=False)
    shared = loader_of(folder, counts, "true")
    for _ in range(12):
        for a, b in zip(shared.next_step(), reference.next_step(), strict=True):
            assert torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]

    trusting = loader_of(folder, counts, "true")
    trusting.stream.orders[0].counts._no_tokens.clear()
    for sidecar_unit in list(trusting.stream.orders[0].units(6)):
        unit = tuple(int(x) for x in sidecar_unit)
        tokens = trusting.stream.orders[0].counts._load_tokens(unit, 0)
        if tokens is not None:
            trusting.stream.orders[0].counts._unit_tokens[(unit, 0)] = tokens
    reference = loader_of(folder, tmp_path / "plain2", "true", share=False)
    differs = False
    for _ in range(12):
        for a, b in zip(trusting.next_step(), reference.next_step(), strict=True):
            differs |= not torch.equal(a["input"], b["input"])
    assert differs


def test_a_units_sidecar_goes_once_its_last_token_is_read(tmp_path):
    """Sidecars live while their unit is read: midway through a pass over 192 units, those
    of the units the lanes read are there, and at most those of the lanes and the units
    measured ahead; once the pass is read (and the next step planned), none is left.
    Negative control: the lanes' units keep theirs while they are read."""
    folder, _ = corpus(tmp_path / "c", files=12, docs=160)
    counts = tmp_path / "n"
    loader = loader_of(folder, counts, "true")
    order = loader.stream.orders[0]
    assert len(order.units(order.source.extent())) == 192
    for _ in range(60):
        loader.next_step()
    lanes = [order.unit(loader.position.cursors[0], k)[1] for _, k, token in
             loader.position.cursors[0].lanes if token]  # fmt: skip
    assert len(lanes) > LANES // 2 and all(sidecars_of(order, u) for u in lanes)
    assert len(list(counts.rglob("*.tokens"))) <= LANES + LOOKAHEAD
    first_pass(loader)
    loader.next_step()  # the pass's last steps are read: what they finished goes
    loader.next_step()
    assert list(counts.rglob("*.tokens")) == []


def sidecars_of(order, unit) -> list:
    """The sidecars of ``unit``'s pieces on disk."""
    path = Path(order.counts.path(tuple(int(x) for x in unit)))
    return list(path.parent.glob(path.stem + "@*.tokens"))


MEMORY = textwrap.dedent("""
    import json, sys
    from harness.corpus import bundled_documents, repeated, write_parquet_files
    from torchtitan.config import parse_args
    from torchtitan.data import build_dataloader
    from torchtitan.data import index
    from torchtitan.data.order import LANES, LOOKAHEAD
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from torchtitan.tools.launch import DEBUG_CONFIG
    folder, counts = sys.argv[1], sys.argv[2]
    write_parquet_files(__import__("pathlib").Path(folder), repeated(bundled_documents(), 4), 8,
                        row_group=512)
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
    argv = ["--job.config_file", DEBUG_CONFIG, "--training.dataset_path", folder,
            "--training.length_index_dir", counts, "--training.streaming",
            "--training.seq_len", "512", "--training.batch_size", "8"]
    loader = build_dataloader(parse_args(argv), Tokenizer(DEFAULT_TOKENIZER_PATH), 0, 1)
    next(loader)
    first, peak, kept = rss(), 0.0, 0
    held = loader.stream.orders[0].counts
    while not loader.take_epoch_starts():
        next(loader)
        peak = max(peak, rss())
        kept = max(kept, len({unit for unit, _ in held._unit_tokens}))
    print(json.dumps({"first": first, "peak": peak, "kept": kept, "bytes": held._unit_token_bytes,
                      "measured": held.measured}))
""")


def test_memory_stays_flat_over_a_long_first_pass(tmp_path):
    """A whole first pass over 4 MB of text (~1 M tokens, ~250 batches, ~120 units): the
    resident memory at its peak is within 10 % of that after the first batch, and the
    measured tokens kept are those of the units the lanes read and measure ahead (at
    most LANES + LOOKAHEAD units). In a process of its own: nothing else's memory."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([".", "test"]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path / "c"), str(tmp_path / "n")],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["measured"] >= 48, out  # a long pass: many units measured, each let go
    assert out["kept"] <= LANES + LOOKAHEAD, out
    assert out["bytes"] <= length_index.KEEP_TOKEN_BYTES, out
    assert out["peak"] <= 1.10 * out["first"], out


@pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))
def test_a_first_pass_with_its_counts_in_a_bucket(tmp_path, calls):
    """``training.length_index_dir`` in a bucket (a real S3 API on 127.0.0.1): the counts and
    the measured tokens' sidecars go there, the batches are those of reading the text,
    each document is tokenized once over the first pass, and no sidecar is left once the
    pass is read. Negative control: midway, the bucket holds the sidecars of the units
    read."""
    import s3fs

    folder, texts = corpus(tmp_path / "c", files=4, docs=40)
    plain = loader_of(folder, tmp_path / "plain", "true", share=False)
    reference = []
    while not plain.take_epoch_starts():
        reference.append(plain.next_step())
    calls.clear()
    with s3.local_s3() as (bucket, _):
        shared, fs, second = (
            loader_of(folder, f"s3://{bucket}/counts", "true"),
            s3fs.S3FileSystem(),
            set(),
        )
        for i, batches in enumerate(reference):
            for a, b in zip(shared.next_step(), batches, strict=True):
                assert torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]
                second |= {d for spans in a["spans"] for _, d, _, _, p, _ in spans if p}
            if i == len(reference) // 2:
                assert any(p.endswith(".tokens") for p in fs.find(f"{bucket}/counts"))
        assert all(calls[texts[d]] == 1 for d in texts if d not in second)
        shared.next_step()
        shared.next_step()
        fs.invalidate_cache()
        assert not [p for p in fs.find(f"{bucket}/counts") if p.endswith(".tokens")]
        assert any(p.endswith(".npz") for p in fs.find(f"{bucket}/counts"))


def test_a_rank_whose_workers_read_leaves_the_measuring_to_them(tmp_path, monkeypatch):
    """With loader workers, the rank's own process reads no window: it measures nothing
    and decodes no block (its workers plan the same steps ahead of it and measure them),
    so it holds none of their memory. Where no worker claims a piece (none started, or
    they are stuck), it measures the piece itself after ``DEFER_S``. Negative control:
    planning with no worker running, it waits ``DEFER_S`` and then measures."""
    import time

    from torchtitan.data.loader import plan_steps

    folder, _ = corpus(tmp_path / "c")
    loader = loader_of(folder, tmp_path / "n", "true", workers=2)
    for _ in range(6):
        loader.next_step()
    assert loader.stream.orders[0].counts.measured == 0
    assert loader.stream.sources[0].rows_decoded == 0
    loader.close()

    monkeypatch.setattr(length_index, "DEFER_S", 0.5)
    alone = loader_of(folder, tmp_path / "alone", "true", workers=2)  # its workers never start
    begin = time.monotonic()
    next(plan_steps(alone.stream, alone.schedule, 0, 0, alone.stream.start()))
    assert time.monotonic() - begin >= 0.5 and alone.stream.orders[0].counts.measured > 0
