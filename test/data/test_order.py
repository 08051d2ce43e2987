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
