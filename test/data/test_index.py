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
    with pytest.raises(DataError, match="length index") as raised:
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
