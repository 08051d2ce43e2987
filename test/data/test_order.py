"""torchtitan/data/order.py: the global order of a source's tokens (units shuffled per
pass, located by offset) and the mix of several sources (which source each window reads).

The order is computed from a length index and a seed, never from the ranks: the unit
tests build a ``SourceIndex`` by hand; the loader-level ones read through real loaders.
"""

from __future__ import annotations

import numpy as np
from helpers import loaders

from torchtitan.data.index import SourceIndex
from torchtitan.data.order import MixSchedule, SourceOrder


def test_the_order_locates_tokens_and_counts_skipped_documents_inside_units():
    """Two streaming units of rows [5, 0, 3] and [0, 4] tokens, unshuffled: every offset
    locates the right row and token (rows of no tokens are never located), and the
    skipped documents before an offset count the empty rows the stream has passed, in
    this pass and the ones before."""
    index = SourceIndex(np.array([5, 0, 3, 0, 4], np.int32), np.array([0, 3, 5]),
                        np.arange(5))  # fmt: skip
    order = SourceOrder(index, "s", 0, "s", shuffle=False)
    assert order.epoch_tokens == 12 and order.epoch_skipped == 2
    rows = [order.locate(o)[3] for o in range(24)]
    assert rows == ([0] * 5 + [2] * 3 + [4] * 4) * 2
    assert [order.locate(o)[4] for o in (0, 4, 5, 7, 8, 11)] == [0, 4, 0, 2, 0, 3]
    skipped = [order.skipped_before(o) for o in (0, 4, 5, 8, 12, 17)]
    assert skipped == [0, 0, 1, 2, 2, 3]


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


# ---- unit tests of SourceOrder over a hand-made index ----------------------------------


def index_of(units: int, rows: int = 3) -> SourceIndex:
    """A streaming-style index of ``units`` units of ``rows`` rows each, row lengths 1-7
    with an empty (skipped) row now and then."""
    lengths = np.array([(i * 5) % 8 for i in range(units * rows)], np.int32)
    return SourceIndex(lengths, np.arange(0, units * rows + 1, rows), np.arange(units * rows))


def test_each_pass_orders_every_unit_exactly_once():
    """Shuffled, every pass is a permutation of all 40 units (none left out or read
    twice), and passes differ; unshuffled, every pass is the units in index order."""
    shuffled = SourceOrder(index_of(40), "s", 7, "s", shuffle=True)
    passes = [shuffled.order(e).tolist() for e in range(4)]
    assert all(sorted(p) == list(range(40)) for p in passes)
    assert len({tuple(p) for p in passes}) == 4
    assert passes[0] != list(range(40)), "a shuffled pass is not the index order"
    plain = SourceOrder(index_of(40), "s", 7, "s", shuffle=False)
    assert [plain.order(e).tolist() for e in range(3)] == [list(range(40))] * 3


def test_the_order_follows_the_seed_and_the_source_identity_only():
    """Two orders built alike give the same units in every pass (it is computed, never
    drawn from a global RNG); another seed, or another source identity (a second source
    of a mix), gives another order."""
    built_alike = [SourceOrder(index_of(40), "s", 7, "s", True) for _ in range(2)]
    same = [[o.order(e).tolist() for e in range(3)] for o in built_alike]
    assert same[0] == same[1]
    other_seed = SourceOrder(index_of(40), "s", 8, "s", True).order(0).tolist()
    other_source = SourceOrder(index_of(40), "s", 7, "t", True).order(0).tolist()
    assert other_seed != same[0][0] and other_source != same[0][0]


def test_locate_walks_every_token_of_a_shuffled_pass_once():
    """Offsets 0 .. 2 passes, located one by one over a shuffled order: each pass visits
    the units in that pass's order, every row's tokens 0..length-1 in turn, every
    non-empty row once, and never an empty one."""
    index = index_of(12)
    order = SourceOrder(index, "s", 3, "s", shuffle=True)
    for epoch in range(2):
        seen, units = [], []
        for offset in range(epoch * order.epoch_tokens, (epoch + 1) * order.epoch_tokens):
            e, k, unit, row, token = order.locate(offset)
            assert (e, unit) == (epoch, int(order.order(epoch)[k]))
            lo, hi = index.rows(unit)
            assert lo <= row < hi and 0 <= token < index.lengths[row]
            seen.append((row, token))
            if not units or units[-1] != unit:
                units.append(unit)
        assert units == [u for u in order.order(epoch).tolist() if index.unit_totals()[0][u]]
        expected = {(r, t) for r in range(len(index.lengths)) for t in range(index.lengths[r])}
        assert len(seen) == len(expected) and set(seen) == expected
