"""torchtitan/data/index.py: the length index (each document's token count, per unit),
measured by the real code, cached by corpus and tokenizer, and refused when stale."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import cfg

from torchtitan.data import build_dataloader
from torchtitan.data import index as length_index
from torchtitan.data.sources import DataError


@pytest.mark.parametrize("workers,delta", [(0, 1), (0, -1), (2, 1)])
def test_a_stale_length_index_stops_with_one_clear_error(tmp_path, tokenizer, workers, delta):
    """A document whose token count is not the index's (the data or tokenizer changed
    behind the cache), whether the entry is one token too long or one too short, is a
    DataError naming the cache, not a silently shifted order; from a loader worker too,
    as one line (not the worker's traceback). A damaged cache file is measured again."""
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"id": f"d{i}", "text": f"Document {i}. " * (5 + i)}) + "\n" for i in range(6)))  # fmt: skip
    cache = tmp_path / "cache"
    c = cfg(tmp_path / "d.jsonl", length_index_dir=cache, num_workers=workers)
    loader = build_dataloader(c, tokenizer, 0, 1)
    next(loader)
    loader.close()
    (path,) = cache.glob("*.npz")
    with np.load(path) as z:
        lengths = z["lengths"].copy()
    lengths[0] += delta
    np.savez(path, lengths=lengths)
    stale = build_dataloader(c, tokenizer, 0, 1)
    with pytest.raises(
        DataError, match=r"tokens, the length index \d+: the data or the tokenizer changed"
    ) as raised:
        for _ in range(6):
            next(stale)
    assert "\n" not in str(raised.value) and "Traceback" not in str(raised.value)
    stale.close()
    path.write_bytes(path.read_bytes()[:40])  # a truncated file
    assert length_index.load_cached(str(cache), path.stem) is None
    again = build_dataloader(c, tokenizer, 0, 1)  # measured and cached again
    next(again)
    again.close()
    assert length_index.load_cached(str(cache), path.stem) is not None


def test_an_index_of_another_size_than_the_data_is_one_line(tmp_path, tokenizer):
    """A cached index holding another number of documents than the source (rows added
    behind an unchanged signature) is refused when the loader is built, naming the
    cache, instead of reading past the data or leaving its tail unread."""
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"id": f"d{i}", "text": f"Document {i}."}) + "\n" for i in range(6)))  # fmt: skip
    c = cfg(tmp_path / "d.jsonl", length_index_dir=tmp_path / "cache")
    build_dataloader(c, tokenizer, 0, 1)
    (path,) = (tmp_path / "cache").glob("*.npz")
    with np.load(path) as z:
        np.savez(path, lengths=np.concatenate([z["lengths"], [5]]))
    with pytest.raises(DataError, match="holds 7 units, the data 6"):
        build_dataloader(c, tokenizer, 0, 1)


# ---- unit tests of the index and its cache -----------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_a_saved_index_loads_back_equal(tmp_path, streaming):
    """save_cached then load_cached gives the same arrays (streaming: with the units'
    rows and where each row is), and leaves no temporary file beside it."""
    measured = {0: (np.array([5, 0, 3]), np.array([0, 40, 90])), 1: (np.array([4]), np.array([0]))}
    index = length_index.assemble(2, streaming, measured)
    length_index.save_cached(str(tmp_path), "k", index)
    back = length_index.load_cached(str(tmp_path), "k")
    assert [p.name for p in tmp_path.iterdir()] == ["k.npz"]
    assert back.arrays().keys() == index.arrays().keys()
    assert all(np.array_equal(back.arrays()[k], v) for k, v in index.arrays().items())
    assert back.units == (2 if streaming else 4) and back.unit_totals()[0].sum() == 12
    assert length_index.load_cached(str(tmp_path), "other") is None


def test_an_index_missing_a_unit_is_refused():
    """A unit no rank measured would shift every later count: assemble refuses it,
    naming the unit."""
    measured = {0: (np.array([5]), np.array([0])), 2: (np.array([4]), np.array([0]))}
    with pytest.raises(DataError, match=r"no rank measured units \[1\]: the length index"):
        length_index.assemble(3, True, measured)


def test_the_cache_key_changes_with_what_the_lengths_depend_on(tmp_path):
    """The key follows the files' signatures, the tokenizer and the settings that change
    the counts (bad-data policy, streaming units); an unrelated setting keeps it."""
    from dataclasses import replace

    training = cfg(tmp_path).training
    fingerprint = {"identity": "path:x", "files": [["a.jsonl", 10, "crc"]]}
    key = length_index.index_key(fingerprint, "sha-a", training)
    assert key == length_index.index_key(fingerprint, "sha-a", replace(training, steps=99))
    changed = [
        length_index.index_key({**fingerprint, "files": [["a.jsonl", 11, "crc"]]}, "sha-a",
                               training),
        length_index.index_key(fingerprint, "sha-b", training),
        length_index.index_key(fingerprint, "sha-a", replace(training, bad_data="error")),
        length_index.index_key(fingerprint, "sha-a", replace(training, streaming=True)),
    ]  # fmt: skip
    assert len({key, *changed}) == 5


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_measuring_says_how_far_it_is(tmp_path, tokenizer, monkeypatch, streaming):
    """While a rank measures, it says every PROGRESS_EVERY_S seconds how many units of
    its share are done, at what rate and how long is left (a first start may measure for
    hours). Negative control: without ``log`` (every rank but rank 0) it says nothing."""
    import io
    import logging

    from torchtitan.data.sources import open_source, resolve_source

    (tmp_path / "d").mkdir()
    for f in range(3):
        (tmp_path / "d" / f"{f}.jsonl").write_text("".join(
            json.dumps({"id": f"d{f}-{i}", "text": f"Document {i}. " * 5}) + "\n" for i in range(4)))  # fmt: skip
    source = open_source(resolve_source(path=str(tmp_path / "d")), "text", "id", streaming)
    units = list(range(len(length_index.source_units(source))))
    monkeypatch.setattr(length_index, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(length_index, "MAP_BATCH", 4)  # map-style documents a read
    # On the module's own logger: a run in this process (train.main) stops the project's
    # logger from propagating to the root, where pytest's caplog listens.
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    level = length_index.logger.level
    length_index.logger.setLevel(logging.INFO)
    length_index.logger.addHandler(handler)
    try:
        quiet = length_index.measure(source, tokenizer, units, "skip")
        assert not said.getvalue()
        loud = length_index.measure(source, tokenizer, units, "skip", log=True)
    finally:
        length_index.logger.removeHandler(handler)
        length_index.logger.setLevel(level)
    assert loud.keys() == quiet.keys()
    lines = said.getvalue().splitlines()
    assert lines and all(f"of this rank's {len(units)} units" in line for line in lines)
    assert "measuring the length index of d: " in lines[0] and "s left" in lines[0]
