"""torchtitan/data/order.py: the global order of a source's tokens (units shuffled per
pass, dealt round the files, read by lanes) and the mix of several sources (which source
each window reads).

The order is computed from the units' token counts and a seed, never from the ranks: the
unit tests walk a simulated source (harness/simulate.py: units, counts, no data);
the loader-level ones read through real loaders.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
from helpers import loaders

from harness.simulate import SimulatedCounts, SimulatedSource
from torchtitan.data.order import LANES, Cursor, MixSchedule, SourceOrder, pass_order


def walk(order: SourceOrder, windows: int, size: int, cursor: Cursor | None = None):
    """The pieces of ``windows`` windows of ``size`` tokens from ``cursor`` (or the start)."""
    cursor = cursor or Cursor()
    return [order.fill(cursor, size) for _ in range(windows)], cursor


def test_lanes_read_every_token_of_every_unit_once_per_pass():
    """Over 3 passes of 12 files x 20 documents (windows of 7 tokens): each pass reads
    every unit whole, each token once, in the lanes' order (a lane's unit from token 0
    to its end); a pass begins only when the last ended; empty documents are counted as
    skipped once per pass."""
    source, counts = SimulatedSource(12, 20), SimulatedCounts()
    order = SourceOrder(source, counts, 3, "s", shuffle=True)
    units = source.units()
    totals = [counts.counts(u).total for u in units]
    windows, cursor = walk(order, 3 * sum(totals) // 7, 7)
    read: dict[tuple, int] = {}
    last_pass = 0
    for pieces in windows:
        assert sum(p[4] - p[3] for p in pieces) == 7
        for pass_, _, u, lo, hi, unit in pieces:
            assert pass_ >= last_pass and unit == tuple(units[u])
            last_pass = pass_
            assert read.get((pass_, u), 0) == lo, "a gap or an overlap in a unit"
            read[(pass_, u)] = hi
    for p in range(2):
        assert [read.get((p, u), 0) for u in range(len(units))] == totals
    skipped = sum(int((counts.counts(u).lengths == 0).sum()) for u in units)
    assert order.skipped_before(cursor) >= 2 * skipped


def test_consecutive_windows_come_from_as_many_files_as_lanes():
    """128 one-domain files of 400 documents of ~350 tokens: 64 consecutive windows read
    from at least 32 distinct files (median over 20 steps). Negative control: one lane (the old order, a
    window after another in one stream) reads 1 or 2 files a step."""

    def median_files(lanes: int) -> float:
        source, counts = SimulatedSource(128, 400), SimulatedCounts(scale=100)
        order = SourceOrder(source, counts, 3, "s", shuffle=True, lanes=lanes)
        steps, cursor = [], Cursor()
        for _ in range(20):
            windows, cursor = walk(order, 64, 129, cursor)
            steps.append(len({p[5][0] for pieces in windows for p in pieces}))
        return float(np.median(steps))

    assert median_files(LANES) >= 32
    assert median_files(1) <= 2


def test_a_pass_deals_its_units_round_the_files():
    """``pass_order``: every unit once; consecutive units from distinct files while files
    last; another pass or seed, another order; unshuffled, the units as they lie."""
    files = np.repeat(np.arange(10), [1, 5, 3, 8, 2, 2, 7, 1, 4, 6])
    order = pass_order(files, 7, "s", 0, True)
    assert sorted(order.tolist()) == list(range(len(files)))
    assert len(set(files[order[:10]].tolist())) == 10  # the first round: every file
    assert not np.array_equal(order, pass_order(files, 7, "s", 1, True))
    assert not np.array_equal(order, pass_order(files, 8, "s", 0, True))
    assert np.array_equal(order, pass_order(files, 7, "s", 0, True))
    assert np.array_equal(pass_order(files, 7, "s", 0, False), np.arange(len(files)))


def test_a_cursor_is_a_seek():
    """A cursor saved after any number of windows (as a list, as a checkpoint holds it)
    continues exactly as the walk it was taken from, at another window size too: the
    pieces from it are the uninterrupted walk's."""
    source = SimulatedSource(12, 20)
    order = SourceOrder(source, SimulatedCounts(), 3, "s", shuffle=True)
    windows, _ = walk(order, 300, 9)
    for k in (0, 1, 57, 299):
        _, cursor = walk(order, k, 9)
        resumed = SourceOrder(source, SimulatedCounts(), 3, "s", shuffle=True)
        rest, _ = walk(resumed, 300 - k, 9, Cursor.from_list(cursor.to_list()))
        assert rest == windows[k:], k


def test_the_order_holds_o_units_at_a_billion_documents():
    """A simulated source of 10^9 documents (10,000 files of 100,000): the order's memory
    (units, a pass's order, the counts kept) while it walks 500 windows at the
    start and 500 from a cursor deep in the pass is at most 256 MB, and no unit but
    those the lanes read is measured."""
    tracemalloc.start()
    try:
        source, counts = SimulatedSource(10_000, 100_000), SimulatedCounts()
        order = SourceOrder(source, counts, 3, "s", shuffle=True)
        walk(order, 500, 2049)
        deep = Cursor(extent=10_000, taken=900_000, lanes=[[s, 899_968 + s, 5] for s in range(32)])
        walk(order, 500, 2049, deep)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(order.units(10_000)) == 10_000 * 391  # units of 256 rows
    assert peak <= 256 << 20, peak
    # The lanes' units and those 2 x 1 M tokens lie in (~900 a unit), of 3.9 M.
    assert counts.measured < 2_500


def test_shuffle_is_seeded_and_differs_per_pass(tiny_corpus, tokenizer):
    def order(*extra, **kw):
        (loader,) = loaders(tiny_corpus, tokenizer, 1, *extra, **kw)
        seqs = [s for _ in range(24) for b in loader.next_step() for s in b["spans"]]
        return [(doc, e) for spans in seqs for _, doc, a, _, e, _ in spans if a == 0]

    one, again, other_seed = order(), order(), order("--training.seed", 8)
    plain = order(shuffle="false")
    assert one == again and one != other_seed
    passes = [[d for d, e in one if e == p] for p in range(3)]
    assert sorted(passes[0]) == sorted(passes[1]) == sorted(passes[2])
    assert len({tuple(p) for p in passes}) == 3
    plain_passes = [[d for d, e in plain if e == p] for p in range(3)]
    assert plain_passes[0] == plain_passes[1] == plain_passes[2]


def test_mix_shares_match_the_weights_within_1_percent():
    """After 10,000 windows every source's share is within 1 % of its weight, from any
    starting window. Negative control: equal weights miss a 0.9/0.1 mix by far."""
    for weights in ([0.9, 0.1], [0.5, 0.3, 0.2], [0.97, 0.02, 0.01]):
        mix = MixSchedule(weights, seed=3)
        for first in (0, 123_457, 10**9):
            shares = np.bincount(mix.sources(first, 10_000), minlength=len(weights)) / 10_000
            assert np.abs(shares - np.asarray(weights) / sum(weights)).max() < 0.01
    plain = np.bincount(MixSchedule([1, 1], 3).sources(0, 10_000)) / 10_000
    assert abs(plain[0] - 0.9) > 0.3


def test_two_seeds_mix_the_sources_in_two_orders(tiny_corpus, second_corpus, tokenizer):
    """The seed sets which source each window reads, not only each source's own order:
    the first 48 sequences of an even mix, read by the loader, come from the sources in
    another order at seed 8 than at seed 7 (and in the same one when the seed is the
    same: the negative control)."""
    mix = f"{tiny_corpus}:0.5,{second_corpus}:0.5"

    def sources_read(seed: int) -> list[str]:
        (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8, seed=seed)
        return [spans[0][0] for _ in range(6) for b in loader.next_step() for spans in b["spans"]]

    at_7 = sources_read(7)
    assert len(set(at_7)) == 2 and at_7 == sources_read(7)
    assert sources_read(8) != at_7
