"""The data path without torchrun: packing, sharding, restore at every step, mixing, resharding."""

from __future__ import annotations

import copy
import itertools
import pickle
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from conftest import error_lines, losses, opened, train_here

from torchtitan.data.dataset import TokenDataset
from torchtitan.data.loader import ParallelDataLoader
from torchtitan.data.sources import DataError, SourceSpec, resolve_source

SEQ = 31  # windows of 32 tokens: documents of a few hundred tokens span many windows


def make(corpus, tokenizer, **kw) -> TokenDataset:
    """A dataset over ``corpus``; its source is opened once per test session and order."""
    kw = {**dict(data_shards=4, seed=7, shuffle=True, streaming=False), **kw}
    sources = kw.pop("sources", None) or [
        opened(str(corpus), kw["seed"], kw["shuffle"], kw["streaming"])
    ]
    return TokenDataset(sources, tokenizer, kw.pop("seq_len", SEQ), **kw)


def take(ds, n: int, it=None) -> list[dict]:
    it = it if it is not None else iter(ds)
    return [next(it) for _ in range(n)]


def doc_tokens(corpus, tokenizer) -> dict[str, list[int]]:
    import datasets

    ds = datasets.load_dataset(
        "json", data_files=sorted(str(p) for p in corpus.glob("*.jsonl")), split="train"
    )
    return {row["id"]: tokenizer.encode(row["text"], bos=True, eos=True) for row in ds}


def first_epoch_coverage(samples: list[dict]) -> dict[str, list[tuple[int, int]]]:
    """Spans per document read in epoch 0."""
    out: dict[str, list] = defaultdict(list)
    for sample in samples:
        for _, doc_id, start, end, epoch, _ in sample["spans"]:
            if epoch == 0:
                out[doc_id].append((start, end))
    return out


def assert_exactly_once(coverage, lengths: dict[str, int]):
    assert set(coverage) == set(lengths), "some documents never read, or unknown ones read"
    for doc_id, spans in coverage.items():
        spans = sorted(spans)
        assert spans[0][0] == 0 and spans[-1][1] == lengths[doc_id], doc_id
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (
            f"{doc_id}: gap or overlap {spans}"
        )


# ---- packing ---------------------------------------------------------------------------


def test_packing_emits_every_token_once_in_order(small_corpus, tokenizer):
    ds = make(small_corpus, tokenizer, data_shards=1, shuffle=False)
    docs = doc_tokens(small_corpus, tokenizer)
    stream = np.concatenate([np.array(t) for t in docs.values()])  # file order = id order here
    n = len(stream) // (SEQ + 1)
    samples = take(ds, n)
    windows = np.concatenate([torch.cat([s["input"], s["label"][-1:]]).numpy() for s in samples])
    assert np.array_equal(windows, stream[: n * (SEQ + 1)])


def test_label_is_input_shifted_by_one(small_corpus, tokenizer):
    for s in take(make(small_corpus, tokenizer), 20):
        assert s["input"].shape == s["label"].shape == (SEQ,)
        assert torch.equal(s["input"][1:], s["label"][:-1])


def test_spans_point_at_the_tokens(small_corpus, tokenizer):
    docs = doc_tokens(small_corpus, tokenizer)
    for s in take(make(small_corpus, tokenizer), 30):
        window = torch.cat([s["input"], s["label"][-1:]]).tolist()
        expected = [t for _, doc_id, a, b, _, _ in s["spans"] for t in docs[doc_id][a:b]]
        assert window == expected


def test_two_ranks_read_disjoint_data_that_covers_the_corpus(small_corpus, tokenizer):
    docs = doc_tokens(small_corpus, tokenizer)
    total = sum(map(len, docs.values()))
    coverage = {}
    for rank in range(2):
        ds = make(small_corpus, tokenizer, dp_rank=rank, dp_world=2, shuffle=False)
        samples = take(ds, total // (SEQ + 1) + 40)
        coverage[rank] = first_epoch_coverage(samples)
    assert not set(coverage[0]) & set(coverage[1])
    assert_exactly_once({**coverage[0], **coverage[1]}, {k: len(v) for k, v in docs.items()})


# ---- restore at every step --------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
@pytest.mark.parametrize("rank", [0, 1])
def test_restore_at_every_step(tiny_corpus, tokenizer, streaming, rank):
    """State after k sequences, loaded into a fresh dataset, yields exactly the rest.

    8 short documents over 4 shards and 2 ranks: each rank's shards end an epoch
    every ~15 sequences (map-style; streaming shards hold byte ranges of the files, so
    one may hold three documents and its neighbour one: it runs longer), so every k
    crosses document and epoch boundaries. One opened source serves every fresh
    dataset. Negative control: a state one token off in the shard read next does not
    reproduce the reference.
    """
    kw = dict(dp_rank=rank, dp_world=2, streaming=streaming)
    ds = make(tiny_corpus, tokenizer, **kw)
    it = iter(ds)
    reference, states = [], []
    steps = 70 if streaming else 46
    for _ in range(steps):
        states.append(ds.state_dict())
        reference.append(next(it))
    epochs = {p.cursor.epoch for shard in ds._shards.values() for p in shard.packers}
    assert min(epochs) >= 2, "the test must cross epoch boundaries"

    def same(state, k) -> bool:
        fresh = make(tiny_corpus, tokenizer, **kw)
        fresh.load_state_dict(state)
        return all(
            torch.equal(a["input"], b["input"]) and torch.equal(a["label"], b["label"])
            and a["spans"] == b["spans"]
            for a, b in zip(take(fresh, 5), reference[k : k + 5])
        )  # fmt: skip

    for k in range(0, steps - 5):
        assert same(states[k], k), k
    k = next(k for k in range(1, steps - 5) if _next_source_state(states[k])["offset"] > 0)
    off_by_one = copy.deepcopy(states[k])
    _next_source_state(off_by_one)["offset"] -= 1
    assert not same(off_by_one, k)


def _next_source_state(state: dict) -> dict:
    """The packer state of the shard a dataset state will read from next."""
    v = sorted(state["shards"])[state["next"]]
    return state["shards"][v]["sources"][0]


def test_batches_carry_per_document_positions_and_ids(small_corpus, tokenizer):
    """Positions restart at 0 where a document starts (and at the sequence start for a
    document continued from the previous sequence); document ids step at each boundary;
    both agree with the spans, token for token."""
    loader = ParallelDataLoader(
        make(small_corpus, tokenizer, data_shards=1), 4, document_layout=True
    )
    for _ in range(10):
        batch = next(loader)
        for row, spans in enumerate(batch["spans"]):
            expected_pos, expected_ids = [], []
            for i, (_, _, start, end, *_) in enumerate(spans):
                expected_pos += list(range(end - start))
                expected_ids += [i] * (end - start)
            assert batch["positions"][row].tolist() == expected_pos[:SEQ]
            assert batch["document_ids"][row].tolist() == expected_ids[:SEQ]
            starts = [i for i, sp in enumerate(spans) if sp[2] == 0]
            assert all(batch["positions"][row][sum(e - s for _, _, s, e, *_ in spans[:i])] == 0
                       for i in starts if sum(e - s for _, _, s, e, *_ in spans[:i]) < SEQ)  # fmt: skip


def test_labels_crossing_into_the_next_document_are_marked(small_corpus, tokenizer):
    """label_document_ids differ from document_ids exactly where the label is the next
    document's first token: the label is BOS and the input the previous document's EOS
    (what training.mask_document_boundaries ignores), found from the tokens alone; a
    document continued from the previous window is not a crossing. The batches hold
    crossings, so ids that were not shifted by one token (all equal) or shifted the
    wrong way would fail the comparison."""
    loader = ParallelDataLoader(
        make(small_corpus, tokenizer, data_shards=1), 4, document_layout=True
    )
    crossings = 0
    for _ in range(30):
        batch = next(loader)
        crossing = batch["label_document_ids"] != batch["document_ids"]
        boundary = (batch["label"] == tokenizer.bos_id) & (batch["input"] == tokenizer.eos_id)
        assert torch.equal(crossing, boundary)
        for row, spans in enumerate(batch["spans"]):
            starts = list(itertools.accumulate(e - s for _, _, s, e, *_ in spans))[:-1]
            assert crossing[row].nonzero().flatten().tolist() == [t - 1 for t in starts]
        crossings += int(crossing.sum())
    assert crossings >= 5


def test_state_holds_positions_not_tokens(small_corpus, tokenizer):
    """With one shard read in file order, the state after n windows is the document the
    next token comes from and the offset into it, computed here from the documents."""
    lengths = [len(t) for t in doc_tokens(small_corpus, tokenizer).values()]
    ds = make(small_corpus, tokenizer, data_shards=1, shuffle=False)
    it = iter(ds)
    for n in (1, 7, 40):
        while ds.state_dict()["shards"][0]["emitted"] < n:
            next(it)
        consumed = n * (SEQ + 1)
        doc = int(np.searchsorted(np.cumsum(lengths), consumed, side="right"))
        offset = consumed - sum(lengths[:doc])
        state = ds.state_dict()["shards"][0]
        assert state == {
            "emitted": n,
            "sources": [{"cursor": {"epoch": 0, "pos": doc}, "offset": offset, "skipped": 0}],
        }


def test_exactly_once_check_sees_duplicates_and_holes():
    from torchtitan.provenance import check_exactly_once

    def report(*spans):
        seqs = [[["src", doc, a, b, e, 0]] for doc, a, b, e in spans]
        return check_exactly_once({0: {1: seqs}})["src"]

    fine = report(("d", 0, 10, 0), ("d", 10, 25, 0), ("d", 0, 5, 1))  # a new epoch reads again
    assert (fine.duplicate_tokens, fine.gaps, fine.tokens) == (0, 0, 30)
    assert report(("d", 0, 10, 0), ("d", 6, 12, 0)).duplicate_tokens == 4
    assert report(("d", 0, 10, 0), ("d", 12, 20, 0)).gaps == 1
    assert report(("d", 3, 10, 0)).gaps == 1, "a document must be read from its start"


def test_exactly_once_check_counts_a_replayed_step():
    """A step trained twice (a relaunch that replayed it, here as step 3, or another rank
    reading the same data) repeats its spans exactly: every token of them is a duplicate.
    A checker that kept a set of spans would see each once and report nothing."""
    from torchtitan.provenance import check_exactly_once

    step = [[["src", "a", 0, 10, 0, 0], ["src", "b", 0, 6, 0, 1]], [["src", "a", 10, 16, 0, 0]]]
    later = [[["src", "a", 16, 20, 0, 0]]]
    replayed = check_exactly_once({0: {1: step, 2: later, 3: step}})["src"]
    assert (replayed.duplicate_tokens, replayed.gaps, replayed.tokens) == (22, 0, 48)
    two_ranks = check_exactly_once({0: {1: step}, 1: {1: step}})["src"]
    assert (two_ranks.duplicate_tokens, two_ranks.gaps) == (22, 0)
    overlapping = [[["src", "a", 0, 10, 0, 0]], [["src", "a", 4, 12, 0, 0]]]
    assert check_exactly_once({0: {1: overlapping}})["src"].duplicate_tokens == 6


def test_completeness_check_sees_a_skipped_document(tiny_corpus, tokenizer):
    """Two ranks read several epochs; check_complete finds every document of every finished
    epoch read whole. Negative controls: a document dropped from one epoch, and a second
    partly read document in a shard, are each reported."""
    from torchtitan.provenance import check_complete

    lengths = {"shakespeare": {k: len(v) for k, v in doc_tokens(tiny_corpus, tokenizer).items()}}
    provenance = {}
    for rank in range(2):
        ds = make(tiny_corpus, tokenizer, dp_rank=rank, dp_world=2, data_shards=4)
        provenance[rank] = {step: [s["spans"]] for step, s in enumerate(take(ds, 60))}
    report = check_complete(provenance, lengths, 4)["shakespeare"]
    assert len(report.finished_epochs) >= 2 and (report.missing, report.partial) == (0, 0)

    doc = provenance[0][0][0][0][1]
    dropped = {r: {k: [[sp for sp in seq if not (sp[1] == doc and sp[4] == 0)] for seq in v]
                   for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(dropped, lengths, 4)["shakespeare"].missing >= 1
    cut = {r: {k: [[sp if sp[2] > 0 or sp[1] != doc else [*sp[:3], 1, *sp[4:]] for sp in seq]
               for seq in v] for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(cut, lengths, 4)["shakespeare"].partial >= 1


# ---- shuffling and looping --------------------------------------------------------------


def doc_order(samples) -> list[str]:
    return [doc for s in samples for _, doc, a, *_ in s["spans"] if a == 0]


def test_shuffle_is_seeded_and_differs_per_epoch(tiny_corpus, tokenizer):
    def order(**kw):
        return doc_order(take(make(tiny_corpus, tokenizer, data_shards=1, **kw), 120))

    one, again, other_seed, plain = order(), order(), order(seed=8), order(shuffle=False)
    assert len(one) > 24, "the test must span several epochs"
    assert one == again and one != other_seed
    epoch0, epoch1, epoch2 = one[:8], one[8:16], one[16:24]
    assert sorted(epoch0) == sorted(epoch1) == sorted(epoch2)
    assert len({tuple(epoch0), tuple(epoch1), tuple(epoch2)}) == 3
    assert plain[:8] == plain[8:16] == plain[16:24]


# ---- mixing -----------------------------------------------------------------------------


def mixed(small_corpus, second_corpus, tokenizer, **kw):
    sources = [
        SourceSpec(
            name="shakespeare", files=resolve_source(path=str(small_corpus)).files, weight=0.7
        ),
        SourceSpec(name="kjv", files=resolve_source(path=str(second_corpus)).files, weight=0.3),
    ]
    return make(small_corpus, tokenizer, sources=sources, **kw)


def test_mixing_follows_weights(small_corpus, second_corpus, tokenizer):
    samples = take(mixed(small_corpus, second_corpus, tokenizer), 3000)
    counts = Counter(s["spans"][0][0] for s in samples)
    share = counts["shakespeare"] / 3000
    # 3000 draws at p=0.7: the standard deviation of the share is 0.008.
    assert abs(share - 0.7) < 0.03, counts
    assert all(len({sp[0] for sp in s["spans"]}) == 1 for s in samples), "a window mixes sources"


def test_mixing_restores_exactly(small_corpus, second_corpus, tokenizer):
    ds = mixed(small_corpus, second_corpus, tokenizer)
    it = iter(ds)
    take(ds, 37, it)
    state = ds.state_dict()
    reference = take(ds, 30, it)
    fresh = mixed(small_corpus, second_corpus, tokenizer)
    fresh.load_state_dict(state)
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(take(fresh, 30), reference))


# ---- resharding (elastic) at the dataset level ------------------------------------------


def epoch_coverage(samples: list[dict], epoch: int) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list] = defaultdict(list)
    for sample in samples:
        for _, doc_id, start, end, e, _ in sample["spans"]:
            if e == epoch:
                out[doc_id].append((start, end))
    return out


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("before,after", [(4, 3), (8, 3), (3, 5)])
def test_reshard_reads_every_token_exactly_once(small_corpus, tokenizer, before, after, shuffle):
    """Consumers (ranks x workers) 4->3, 8->3, 3->5 over 8 shards, two of the three layouts
    not dividing the shard count; consumers stop at different points, and the resumed
    layout reads past the end of every shard's second epoch. Epochs 0 and 1 are each read
    completely, every token once. Negative control: a shard state lost in the handover
    leaves a hole or a duplicate."""
    docs = doc_tokens(small_corpus, tokenizer)
    lengths = {k: len(v) for k, v in docs.items()}

    def run(drop_shard=None):
        kw = dict(data_shards=8, shuffle=shuffle)
        samples, shard_states = [], {}
        for c in range(before):
            ds = make(small_corpus, tokenizer, dp_rank=c, dp_world=before, **kw)
            samples += take(ds, 3 + 2 * c)  # consumers stop at different points
            shard_states.update(ds.state_dict()["shards"])
        assert sorted(shard_states) == list(range(8))
        if drop_shard is not None:  # as if its state were lost: it restarts from zero
            shard_states.pop(drop_shard)
        for c in range(after):
            ds = make(small_corpus, tokenizer, dp_rank=c, dp_world=after, **kw)
            ds.load_shard_states(shard_states)
            samples += take(ds, 300)
        return samples

    samples = run()
    assert min(sp[4] for s in samples[-after:] for sp in s["spans"]) >= 2, "reads past epoch 1"
    for epoch in (0, 1):
        assert_exactly_once(epoch_coverage(samples, epoch), lengths)
    with pytest.raises(AssertionError):
        assert_exactly_once(epoch_coverage(run(drop_shard=5), 0), lengths)


def test_every_shard_advances_at_the_same_rate_or_the_layout_is_refused(small_corpus, tokenizer):
    """4 consumers over 8 shards: after every consumer took n sequences, the shards' counts
    differ by at most one. Negative control: 3 consumers over 8 shards (the dataset allows
    it) skew by far more, and the loader refuses that layout up front, naming what works."""

    def spread(consumers: int, n: int) -> int:
        emitted = {}
        for c in range(consumers):
            ds = make(small_corpus, tokenizer, dp_rank=c, dp_world=consumers, data_shards=8)
            take(ds, n)
            emitted.update({v: s["emitted"] for v, s in ds.state_dict()["shards"].items()})
        return max(emitted.values()) - min(emitted.values())

    assert spread(4, 13) <= 1
    assert spread(3, 13) > 1
    ds = make(small_corpus, tokenizer, dp_rank=0, dp_world=3, data_shards=8)
    with pytest.raises(DataError, match=r"among \[1, 2, 4, 8\], or data_shards a multiple of 3"):
        ParallelDataLoader(ds, 2)


def test_automatic_shard_count_fits_clusters_and_tiny_corpora():
    from torchtitan.data import auto_data_shards

    for consumers, documents in [(1024, 100_000), (48, 10**6), (2, 2221), (2, 24), (1, 5)]:
        v = auto_data_shards(consumers, documents)
        assert v % consumers == 0 and consumers <= v <= documents, (consumers, documents, v)
    assert auto_data_shards(2, 24) % 3 == 0, "a small corpus still admits 3 consumers"
    with pytest.raises(DataError, match="fewer than the 8 data consumers"):
        auto_data_shards(8, 5)


def test_resume_takes_the_chosen_shard_count_given_explicitly(tmp_path, dozen_corpus):
    """A run with the automatic shard count (12 for this corpus) resumes with
    --training.data_shards 12, the count the loader names, and that run's checkpoint
    resumes with the automatic count again; the losses are those of an uninterrupted
    run. Negative control: another count is refused in one line naming the one to use."""
    common = ["--training.steps", 6, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 2,
              "--training.dataset_path", dozen_corpus, "--training.seq_len", 32,
              "--training.batch_size", 2]  # fmt: skip
    train_here(tmp_path / "whole", *common)
    dump = tmp_path / "resumed"
    train_here(dump, *common, "--training.stop_at_step", 2)
    status, log = train_here(dump, *common, "--training.data_shards", 6, expect_ok=False)
    assert status != 0 and len(error_lines(log)) == 1, log[-2000:]
    assert "12 virtual shards" in log and "--training.data_shards 12" in log, log[-2000:]
    train_here(dump, *common, "--training.data_shards", 12, "--training.stop_at_step", 4)
    train_here(dump, *common)
    assert losses(dump) == losses(tmp_path / "whole")
    assert sorted(losses(dump)) == list(range(1, 7))


def test_a_shard_without_usable_documents_is_skipped_on_every_run(tmp_path, tokenizer):
    """Shard 1 of 4 holds only empty documents: its consumer skips it, deterministically,
    so a restore lands on the same sequence of shards."""
    import json

    docs = [{"id": f"d{i}", "text": "" if i % 4 == 1 else f"Line {i} of a document.\n" * 6}
            for i in range(16)]  # fmt: skip
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    ds = make(tmp_path, tokenizer, data_shards=4, shuffle=False)
    it = iter(ds)
    samples, states = [], []
    for _ in range(20):
        states.append(ds.state_dict())
        samples.append(next(it))
    assert {sp[5] for s in samples for sp in s["spans"]} == {0, 2, 3}
    for k in (0, 1, 5, 11):
        fresh = make(tmp_path, tokenizer, data_shards=4, shuffle=False)
        fresh.load_state_dict(states[k])
        assert [s["spans"] for s in take(fresh, 5)] == [s["spans"] for s in samples[k : k + 5]]


def test_too_many_consumers_is_a_clear_error(small_corpus, tokenizer):
    ds = make(small_corpus, tokenizer, data_shards=4, dp_rank=0, dp_world=5)
    with pytest.raises(DataError, match="raise training.data_shards to at least 5"):
        next(iter(ds))


def test_fewer_documents_than_shards_is_a_clear_error(small_corpus, tokenizer):
    with pytest.raises(DataError, match="fewer than training.data_shards=64"):
        make(small_corpus, tokenizer, data_shards=64)


# ---- the loader ------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_exactly_and_workers_do_not_duplicate(small_corpus, tokenizer, workers):
    def loader():
        ds = make(small_corpus, tokenizer, dp_rank=0, dp_world=1, data_shards=4)
        return ParallelDataLoader(ds, 2, num_workers=workers)

    first = loader()
    batches = [next(first) for _ in range(6)]
    state = first.state_dict()
    reference = [next(first) for _ in range(8)]
    spans = [sp for b in batches + reference for seq in b["spans"] for sp in seq]
    coverage = defaultdict(list)
    for _, doc, a, b, *_ in spans:
        coverage[doc].append((a, b))
    for doc, cov in coverage.items():
        cov.sort()
        assert all(x[1] == y[0] for x, y in zip(cov, cov[1:])), f"{doc} read twice or with a gap"
    resumed = loader()
    resumed.load_state_dict(state)
    for a, b in zip((next(resumed) for _ in range(8)), reference):
        assert torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_workers_send_groups_without_changing_the_order_or_a_resume(
    small_corpus, tokenizer, monkeypatch, streaming
):
    """2 workers sending groups of 3 batches give the batches of groups of 1 (one worker
    at a time), and a loader resumed after k batches, for k at every place in a group,
    gives the rest. Negative control: a state naming the other worker's turn does not."""
    from torchtitan.data import loader as loader_module

    def loader(group: int):
        monkeypatch.setattr(loader_module, "GROUP_TOKENS", group * 2 * (SEQ + 1))
        ds = make(small_corpus, tokenizer, data_shards=4, streaming=streaming)
        made = ParallelDataLoader(ds, 2, num_workers=2)
        assert made.group == group
        return made

    ones = loader(1)
    reference = [next(ones) for _ in range(16)]
    first = loader(3)
    states = []
    for expected in reference:
        states.append(first.state_dict())
        got = next(first)
        assert torch.equal(got["input"], expected["input"]) and got["spans"] == expected["spans"]

    def resumed_from(state, k) -> bool:
        again = loader(3)
        again.load_state_dict(state)
        return all(torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]
                   for a, b in zip((next(again) for _ in range(7)), reference[k : k + 7]))  # fmt: skip

    for k in (1, 2, 3, 4, 8):
        assert resumed_from(states[k], k), k
    entry = pickle.loads(states[3]["dp_rank_0"])
    entry["turn"] = 1 - entry["turn"]
    assert not resumed_from({"dp_rank_0": pickle.dumps(entry)}, 3)


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_state_counts_only_batches_handed_out(small_corpus, tokenizer, monkeypatch, workers):
    """A loader resumed after k batches, for every k through two groups per worker, gives
    the rest. Each worker owns 8 / workers shards and a batch of 2 reads only 2 of them,
    so a state that counted a received group as consumed (shards the trainer has not
    seen yet placed at the group's end) would skip their sequences on resume; with as
    many shards per worker as a batch has sequences, every batch overwrites them all."""
    from torchtitan.data import loader as loader_module

    monkeypatch.setattr(loader_module, "GROUP_TOKENS", 3 * 2 * (SEQ + 1))  # groups of 3

    def loader():
        made = ParallelDataLoader(make(small_corpus, tokenizer, data_shards=8), 2,
                                  num_workers=workers)  # fmt: skip
        assert made.group == 3
        return made

    first = loader()
    steps, ahead = 6 * workers + 1, 4
    states, reference = [], []
    for _ in range(steps + ahead):
        states.append(first.state_dict())
        reference.append(next(first))
    for k in range(steps):
        again = loader()
        again.load_state_dict(states[k])
        for i in range(k, k + ahead):
            got = next(again)
            assert torch.equal(got["input"], reference[i]["input"]), (k, i)
            assert got["spans"] == reference[i]["spans"], (k, i)


def test_loader_reshards_workers_2_to_0(tiny_corpus, tokenizer):
    def loader(workers):
        ds = make(tiny_corpus, tokenizer, dp_rank=0, dp_world=1, data_shards=4, shuffle=False)
        return ParallelDataLoader(ds, 2, num_workers=workers)

    first = loader(2)
    seen = [next(first) for _ in range(3)]
    state = first.state_dict()
    after = loader(0)
    after.load_state_dict(state)
    seen += [next(after) for _ in range(30)]
    docs = doc_tokens(tiny_corpus, tokenizer)
    samples = [{"spans": seq} for b in seen for seq in b["spans"]]
    assert_exactly_once(first_epoch_coverage(samples), {k: len(v) for k, v in docs.items()})


def test_changed_global_batch_is_a_clear_error(small_corpus, tokenizer):
    ds = make(small_corpus, tokenizer)
    state = ParallelDataLoader(ds, 2).state_dict()
    other = ParallelDataLoader(make(small_corpus, tokenizer), 3)
    with pytest.raises(DataError, match="global batch size changed from 2"):
        other.load_state_dict(state)


# ---- bad data ---------------------------------------------------------------------------


def test_bad_documents_are_skipped_and_counted(tmp_path, tokenizer):
    import json

    docs = [{"id": f"d{i}", "text": f"Line {i} of a good document.\n" * 5} for i in range(8)]
    docs[2]["text"] = ""
    docs[4]["text"] = "   \n\t "
    docs[6]["text"] = None
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    ds = make(tmp_path, tokenizer, data_shards=1, shuffle=False)
    samples = take(ds, 12)
    seen = {sp[1] for s in samples for sp in s["spans"]}
    assert seen == {"d0", "d1", "d3", "d5", "d7"}
    assert samples[-1]["skipped"] == 3
    strict = make(tmp_path, tokenizer, data_shards=1, shuffle=False, bad_data="error")
    with pytest.raises(DataError, match="'d2'.*empty or whitespace-only"):
        take(strict, 12)


def test_missing_path_is_a_clear_error():
    with pytest.raises(DataError, match="matches no data files"):
        resolve_source(path="/nonexistent/corpus")


def test_missing_text_column_is_a_clear_error(small_corpus, tokenizer):
    with pytest.raises(DataError, match="no column 'body'"):
        make(small_corpus, tokenizer, sources=[resolve_source(path=str(small_corpus))],
             text_field="body")  # fmt: skip


def test_id_less_documents_get_stable_ids(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("A plain text document.\nWith two lines.\n")
    (tmp_path / "b.txt").write_text("Another document entirely.\n")
    for streaming in (False, True):
        ds = make(tmp_path, tokenizer, data_shards=1, shuffle=False, streaming=streaming)
        ids = {sp[1] for s in take(ds, 4) for sp in s["spans"]}
        assert len(ids) == 2, ids


def test_streaming_resumes_twice_in_a_row(small_corpus, tokenizer):
    """Guards against `datasets` reporting the initial state right after a load (a second
    resume would then silently restart the data from zero)."""
    kw = dict(streaming=True, data_shards=2)
    ds = make(small_corpus, tokenizer, **kw)
    it = iter(ds)
    take(ds, 5, it)
    state1 = ds.state_dict()
    reference = take(ds, 12, it)
    second = make(small_corpus, tokenizer, **kw)
    second.load_state_dict(state1)
    it2 = iter(second)
    got = take(second, 1, it2)
    state2 = second.state_dict()  # taken right after a resume
    third = make(small_corpus, tokenizer, **kw)
    third.load_state_dict(state2)
    got += take(third, 11)
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(got, reference))


def test_source_registry_covers_bundled_corpus():
    spec = resolve_source(name="bundled")
    assert len(spec.files) == 20 and spec.fmt == "parquet"
    assert (
        list(
            itertools.chain(
                *[resolve_source(name=n).files for n in ("shakespeare", "milton", "kjv")]
            )
        )
        == spec.files
    )
