"""A unit measured in pieces (index.SourceCounts): a cold first step waits for the first
documents of the units its windows lie in, not for whole units; the batches and the
positions are those of counts measured whole; a piece left torn or half-done by a killed
process is measured again or continued."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cfg, distinct_parquet, write_parquet

from torchtitan.data import build_dataloader
from torchtitan.data import index as length_index


def corpus(folder: Path, files: int, docs: int) -> tuple[Path, dict[str, str]]:
    """``files`` parquet files of ``docs`` distinct documents (a tokenizer call names its
    document); the texts by id."""
    return distinct_parquet(
        folder,
        files,
        docs,
        docs // 2,
        lambda f, i: f"File {f}, row {i}: " + "a verse. " * (3 + i % 7),
    )


def loader_of(folder, counts, streaming: str, rank: int = 0, world: int = 1):
    c = cfg(folder, length_index_dir=counts, streaming=streaming, global_batch_size=8)
    return build_dataloader(c, TOKENIZER, rank, world)


@pytest.fixture(autouse=True)
def _tokenizer(tokenizer):
    global TOKENIZER
    TOKENIZER = tokenizer


def pieces_on_disk(counts: Path) -> list[Path]:
    return sorted(p for p in counts.rglob("*@*.npz"))


def test_a_cold_first_step_measures_only_the_first_pieces(tmp_path, calls, monkeypatch):
    """Map-style, 1,600 rows in units of 100: the first step's 8 windows (32 tokens each)
    wait for the first piece (16 documents) of the 8 units they lie in, 128 documents,
    written as piece files, no unit whole; a unit of a few rows (50, in a corpus of small
    files) is measured whole. Negative control: with pieces as large as a unit (measured
    whole, as before), the same step tokenizes all 800 rows."""
    folder, _ = corpus(tmp_path / "c", files=4, docs=400)
    loader = loader_of(folder, tmp_path / "n", "false")
    assert len(loader.stream.orders[0].units(1600)) == 16
    loader.next_step()
    assert sum(calls.values()) == 8 * length_index.FIRST_PIECE_DOCS
    assert len(pieces_on_disk(tmp_path / "n")) == 8
    assert not [p for p in (tmp_path / "n").rglob("*.npz") if "@" not in p.name]

    calls.clear()  # units of 50 rows (at most 4 x 16): whole, one file and claim a unit
    small, _ = corpus(tmp_path / "small", files=8, docs=800)
    few = loader_of(small, tmp_path / "few", "true")
    assert len(few.stream.orders[0].units(8)) == 128
    few.next_step()
    assert sum(calls.values()) == 8 * 50 and not pieces_on_disk(tmp_path / "few")

    calls.clear()
    monkeypatch.setattr(length_index, "FIRST_PIECE_DOCS", 10**9)
    whole = loader_of(folder, tmp_path / "whole", "false")
    whole.next_step()
    assert sum(calls.values()) == 8 * 100 and not pieces_on_disk(tmp_path / "whole")


def steps_of(loader, extra: int) -> list:
    """Every step's batches and position, until ``extra`` steps after the second pass began."""
    out, left = [], None
    while left is None or left > 0:
        batches = loader.next_step()
        position = [c.to_list() for c in loader.position.cursors]
        out.append(([(b["input"], b["label"], b["spans"]) for b in batches], position))
        if left is None and loader.take_epoch_starts():
            left = extra
        elif left is not None:
            left -= 1
    return out


@pytest.mark.parametrize("streaming", ["true", "false"])
def test_pieces_give_the_batches_and_positions_of_whole_counts(tmp_path, calls, monkeypatch,
                                                               streaming):  # fmt: skip
    """Measured in pieces of 2, 6, 24 ... documents as the lanes reach them, a cold pass
    gives every batch and every position (the cursors a checkpoint saves) of a loader
    over counts measured whole beforehand, tokenizes each document once, and leaves
    each unit's counts whole on disk, equal to those measured whole, and no piece. A
    lane ends its unit only where the unit has no token more: were a piece's last token
    taken for the unit's, the lanes would take the next units in another order."""
    monkeypatch.setattr(length_index, "FIRST_PIECE_DOCS", 2)
    folder, texts = corpus(tmp_path / "c", files=4, docs=160)
    cold = loader_of(folder, tmp_path / "cold", streaming)
    got = steps_of(cold, 3)
    second = {d for batches, _ in got[-4:] for _, _, spans in batches for s in spans
              for _, d, _, _, p, _ in s if p}  # fmt: skip
    assert all(calls[texts[d]] == 1 for d in texts if d not in second)
    assert not pieces_on_disk(tmp_path / "cold")
    order = cold.stream.orders[0]
    assert order.counts.measured > len(order.units(order.source.extent()))  # in pieces

    warm_counts = loader_of(folder, tmp_path / "warm", streaming).stream.orders[0]
    warm_counts.pass_tokens()  # measured whole, as prepare_data does
    for unit in warm_counts.units(warm_counts.source.extent()):
        with (
            np.load(warm_counts.counts.path(unit)) as a,
            np.load(cold.stream.orders[0].counts.path(unit)) as b,
        ):
            assert np.array_equal(a["lengths"], b["lengths"])
    warm = loader_of(folder, tmp_path / "warm", streaming)
    for (batches, position), (w_batches, w_position) in zip(got, steps_of(warm, 3), strict=True):
        assert position == w_position
        for (i, lab, spans), (wi, wl, ws) in zip(batches, w_batches, strict=True):
            assert torch.equal(i, wi) and torch.equal(lab, wl) and spans == ws


def test_a_lane_ends_a_unit_measured_in_pieces_where_its_tokens_end(tmp_path, monkeypatch):
    """Documents of exactly one window each (32 tokens) and units whose documents after
    the first two are empty (skipped): a window ends exactly where a unit's first piece
    ends, and the unit has no token more. The lane must end the unit there, in that
    window's step, as over whole counts; the positions show it (a lane that waits for
    the next piece to learn the unit is done takes the next unit a turn later)."""
    from torchtitan.data.packing import document_tokens

    monkeypatch.setattr(length_index, "FIRST_PIECE_DOCS", 2)

    def one_window(prefix: str) -> str:
        text = prefix
        while len(document_tokens(TOKENIZER, "", text, "", "skip")) < 32:
            text += " a"
        return text

    for f in range(4):  # units of 10 rows; in every other unit, 8 empty rows after 2
        rows = [{"id": f"d{f}-{i}", "text": "" if (i // 10) % 2 and i % 10 >= 2
                 else one_window(f"File {f}, row {i}:")} for i in range(160)]  # fmt: skip
        write_parquet(tmp_path / "c" / f"part-{f}.parquet", rows, row_group=80)
    cold = steps_of(loader_of(tmp_path / "c", tmp_path / "cold", "true"), 1)
    warm_order = loader_of(tmp_path / "c", tmp_path / "warm", "true").stream.orders[0]
    warm_order.pass_tokens()
    warm = steps_of(loader_of(tmp_path / "c", tmp_path / "warm", "true"), 1)
    assert [p for _, p in cold] == [p for _, p in warm]


def test_a_left_piece_is_continued_and_a_torn_one_measured_again(tmp_path, calls, caplog):
    """A process killed after writing a unit's first piece leaves it for the next: a fresh
    process asking for the whole unit measures only the rest (84 of 100 rows), and the
    unit's file is whole, equal to one measured in one go, with no piece left. A piece
    torn by a crash is passed over and the unit measured from its start (100), a warning
    naming it."""
    folder, _ = corpus(tmp_path / "c", files=1, docs=1600)

    def counts_in(name: str):
        return loader_of(folder, tmp_path / name, "false").stream.orders[0].counts

    unit = tuple(int(x) for x in loader_of(folder, tmp_path / "x", "false").stream.orders[0]
                 .units(1600)[0])  # fmt: skip
    assert unit[2] - unit[1] == 100
    reference = counts_in("reference").counts(unit)
    counts_in("n").counts(unit, upto=1)  # the first piece, then the process is gone
    assert len(pieces_on_disk(tmp_path / "n")) == 1
    calls.clear()
    whole = counts_in("n")
    assert np.array_equal(whole.counts(unit).lengths, reference.lengths)
    assert sum(calls.values()) == 100 - length_index.FIRST_PIECE_DOCS
    assert not pieces_on_disk(tmp_path / "n") and Path(whole.path(unit)).exists()

    counts_in("torn").counts(unit, upto=1)
    (piece,) = pieces_on_disk(tmp_path / "torn")
    piece.write_bytes(piece.read_bytes()[:40])
    calls.clear()
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(counts_in("torn").counts(unit).lengths, reference.lengths)
    assert sum(calls.values()) == 100 and piece.name in caplog.text
