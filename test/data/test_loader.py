"""The data path without torchrun: the global order, windows, ranks, resume, mixing.

Loaders here are the real ones (``build_dataloader`` over a parsed config, the length
index measured by the real code); several "ranks" are several loaders in one process,
which is all a rank's loader is (it never talks to other ranks).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from helpers import (
    CONFIG,
    SEQ,
    assert_spans_tile_every_document,
    assert_two_ranks_restore_at_every_step,
    assert_workers_give_the_main_batches,
    cfg,
    doc_tokens,
    global_steps,
    loaders,
    window_of,
)

from torchtitan.checkpoint.entries import from_tensor
from torchtitan.data import build_dataloader, build_stream
from torchtitan.data.dataset import Position
from torchtitan.data.loader import BatchSchedule, plan_steps
from torchtitan.data.order import MixSchedule
from torchtitan.data.sources import DataError, resolve_source


def coverage_at_first_repeat(sequences, lengths: dict[str, int]) -> float:
    """The share of the corpus's tokens read (pass 0) when a document is first read again
    (any span of pass 1 or later), over sequences in global order; 1.0 if none repeats."""
    total, read = sum(lengths.values()), 0
    for spans in sequences:
        for _, _, start, end, epoch, _ in spans:
            if epoch > 0:
                return read / total
            read += end - start
    return 1.0


# ---- windows ----------------------------------------------------------------------------


def test_windows_are_the_corpus_tokens_in_order(small_corpus, tokenizer):
    """Unshuffled, one rank: the windows laid end to end are the documents' tokens in
    file order, across the end of the pass into the next."""
    (loader,) = loaders(small_corpus, tokenizer, 1, shuffle="false")
    docs = doc_tokens(small_corpus, tokenizer)
    stream = np.concatenate([np.array(t) for t in docs.values()] * 2)
    n = len(stream) // (SEQ + 1) // 4
    windows = [w for step in global_steps([loader], n) for w, _ in step]
    assert np.array_equal(np.concatenate(windows), stream[: len(windows) * (SEQ + 1)])


def test_label_is_input_shifted_by_one_and_spans_point_at_the_tokens(small_corpus, tokenizer):
    (loader,) = loaders(small_corpus, tokenizer)
    docs = doc_tokens(small_corpus, tokenizer)
    for _ in range(8):
        batch = next(loader)
        assert batch["input"].shape == batch["label"].shape == (4, SEQ)
        assert torch.equal(batch["input"][:, 1:], batch["label"][:, :-1])
        for i, spans in enumerate(batch["spans"]):
            expected = [t for _, doc_id, a, b, _, _ in spans for t in docs[doc_id][a:b]]
            assert window_of(batch, i) == expected


# ---- coverage ---------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_no_document_repeats_before_the_corpus_is_read_through(heavy_corpus, tokenizer, streaming):
    """240 heavy-tailed documents, 2 ranks, defaults: every token of pass 0 is read before
    any document is read again (the old equal-rate shards repeated short ones after 8 %),
    and every pass is read whole once. Negative control: the measure reports an early
    repeat where one is made."""
    ranks = loaders(heavy_corpus, tokenizer, 2, streaming=streaming, global_batch_size=16)
    lengths = {k: len(v) for k, v in doc_tokens(heavy_corpus, tokenizer).items()}
    per_pass = sum(lengths.values()) // (16 * (SEQ + 1)) + 1
    sequences = [spans for step in global_steps(ranks, per_pass * 2 + 3) for _, spans in step]
    assert coverage_at_first_repeat(sequences, lengths) >= 0.99
    assert_spans_tile_every_document(sequences, lengths, epochs=(0, 1))
    early = sequences[:10] + [[["heavy", "h0001", 0, 5, 1, 0]]] + sequences[10:]
    assert coverage_at_first_repeat(early, lengths) < 0.01


def simulate(stream, schedule: BatchSchedule, steps: int, step: int = 0, position=None):
    """Every rank's windows ``(source, offset)`` of ``steps`` steps, planned by the
    loader's own function (no tokens read): {rank: [[windows of a step], ...]}."""
    position = position or stream.start()
    out = {}
    for rank in range(schedule.dp_world):
        plans = itertools.islice(plan_steps(stream, schedule, rank, step, position), steps)
        out[rank] = [[w for micro in p.micro for w in micro] for p in plans]
    return out


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_1024_ranks_read_each_token_once_and_nothing_repeats_early(heavy_corpus, tokenizer,
                                                                   streaming):  # fmt: skip
    """1,024 data-parallel ranks, 8 sequences each (simulated through the loader's own
    planning, windows of 4 tokens so that steps cross passes), then 1,016 (a lost node):
    the windows of every step, ranks in order, tile the stream with no gap or overlap
    across the change, so a pass ends before the next begins; each rank reads one
    contiguous run; the busiest rank has at most 1.15 x the mean (9 vs 8.06)."""
    seq = 3
    stream = build_stream(cfg(heavy_corpus, seq=seq, streaming=streaming).training, tokenizer)
    tokens, w = stream.orders[0].epoch_tokens, seq + 1
    size = 8192
    steps = -(-2 * tokens // (size * w))
    half = steps // 2
    before = simulate(stream, BatchSchedule([(0, size)], 8, 1024), half)
    resumed = Position(half * size, [half * size * w])
    after = simulate(stream, BatchSchedule([(0, size)], 8, 1016), steps - half, half, resumed)
    offsets = []
    for part in (before, after):
        for s in range(len(part[0])):
            offsets += [o for rank in sorted(part) for _, o in part[rank][s]]
    assert offsets == list(range(0, len(offsets) * w, w)), "not one tiling"
    assert offsets[-1] >= 2 * tokens - w
    for part, ranks in ((before, 1024), (after, 1016)):
        counts = [len(part[r][0]) for r in range(ranks)]
        assert sum(counts) == size and max(counts) / (size / ranks) <= 1.15
    assert all(b - a == w for r in before.values() for (_, a), (_, b) in zip(r[0], r[0][1:]))


def test_an_uneven_split_over_1_016_ranks_is_measured_and_said():
    """Where the global batch does not split evenly enough (2,048 over 1,016 ranks: 2 or
    3 each), the loader says so with the figure and a batch that divides; where it does
    (8,192), it is silent."""
    import io
    import logging

    said = io.StringIO()
    handler = logging.StreamHandler(said)
    log = logging.getLogger("torchtitan.data.loader")
    log.addHandler(handler)
    try:
        assert BatchSchedule([(0, 8192)], 8, 1016).imbalance(8192) == pytest.approx(
            9 / (8192 / 1016)
        )
        assert not said.getvalue()
        BatchSchedule([(0, 2048)], 3, 1016)
    finally:
        log.removeHandler(handler)
    assert "1.49 x the mean" in said.getvalue() and "2032" in said.getvalue()


# ---- resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
@pytest.mark.parametrize("workers", [0, 2])
def test_restore_at_every_step(tiny_corpus, tokenizer, streaming, workers):
    """The state after k steps, loaded into fresh loaders, gives exactly the rest: 2
    ranks, tiny documents, so steps cross document and pass boundaries. Negative
    control: a position one token off does not reproduce the reference."""
    assert_two_ranks_restore_at_every_step(tiny_corpus, tokenizer, streaming, workers)


def test_the_state_is_a_position_of_a_few_bytes(heavy_corpus, tokenizer):
    """The entry is the windows taken and a token offset per source, the same on every
    rank, a few hundred bytes (the issue's limit is 16 KB per rank)."""
    ranks = loaders(heavy_corpus, tokenizer, 3, global_batch_size=12)
    global_steps(ranks, 5)
    entries = [from_tensor(r.state_dict()[f"dp_rank_{i}"]) for i, r in enumerate(ranks)]
    assert entries[0] == entries[1] == entries[2]
    assert (entries[0]["windows"], entries[0]["offsets"]) == (60, [60 * (SEQ + 1)])
    assert ranks[0].state_dict()["dp_rank_0"].numel() < 16_384  # bytes of JSON


@pytest.mark.parametrize("chain", [(4, 3, 1, 5), (8, 7, 2)], ids=["4-3-1-5", "8-7-2"])
def test_resume_on_any_rank_count_gives_the_same_global_batches(heavy_corpus, tokenizer, chain):
    """Stop every 3 steps and resume on another rank count, divisors or not: each step's
    sequences over all ranks (in rank order) are those of the uninterrupted 1-rank run.
    So every token is read exactly once, whatever the chain."""
    reference = global_steps(
        loaders(heavy_corpus, tokenizer, 1, global_batch_size=24), 3 * len(chain)
    )
    got, state = [], None
    for world in chain:
        ranks = loaders(heavy_corpus, tokenizer, world, global_batch_size=24)
        for r in ranks:
            if state is not None:
                r.load_state_dict(state)
        got += global_steps(ranks, 3)
        state = ranks[-1].state_dict()
    assert got == reference
    restarted = global_steps(loaders(heavy_corpus, tokenizer, chain[1], global_batch_size=24), 3)
    assert restarted != reference[3:6], "a leg that does not load the position differs"


def test_batch_size_changes_and_schedules_keep_every_token_once(heavy_corpus, tokenizer):
    """A schedule 0:8,3:20,6:12 over 2 ranks, resumed at step 4 with another global batch
    and on 3 ranks: the global order continues where it stopped, so the windows laid end
    to end tile the stream. The schedule is by training step (set_step)."""
    ranks = loaders(heavy_corpus, tokenizer, 2, batch_size_schedule="0:8,3:20,6:12")
    steps = global_steps(ranks, 4)
    assert [len(s) for s in steps] == [8, 8, 8, 20]
    state = ranks[0].state_dict()
    ranks = loaders(heavy_corpus, tokenizer, 3, global_batch_size=10)
    for r in ranks:
        r.load_state_dict(state)
        r.set_step(4)
    steps += global_steps(ranks, 2)
    assert [len(s) for s in steps[4:]] == [10, 10]
    windows = [w for step in steps for w, _ in step]
    assert len(windows) == 64
    reference = global_steps(loaders(heavy_corpus, tokenizer, 1, global_batch_size=64), 1)[0]
    assert windows == [w for w, _ in reference]


def test_the_schedule_is_by_training_step(heavy_corpus, tokenizer):
    """A data restart at training step 3 (``exclude_from_loading dataloader``: no loader
    state) takes the schedule's batch of step 3, not of its own first step. Negative
    control: without ``set_step`` it starts over at the first entry."""
    (restarted,) = loaders(heavy_corpus, tokenizer, 1, batch_size_schedule="0:8,3:20")
    restarted.set_step(3)
    assert len(global_steps([restarted], 1)[0]) == 20
    (plain,) = loaders(heavy_corpus, tokenizer, 1, batch_size_schedule="0:8,3:20")
    assert len(global_steps([plain], 1)[0]) == 8


def test_a_changed_sequence_length_continues_at_the_token_offset(heavy_corpus, tokenizer):
    """5 steps at seq_len 31, then 5 at 15: the tokens laid end to end are the stream of
    an uninterrupted run (nothing skipped or read twice at the change)."""
    (first,) = loaders(heavy_corpus, tokenizer)
    tokens = [t for step in global_steps([first], 5) for w, _ in step for t in w]
    (second,) = loaders(heavy_corpus, tokenizer, 1, seq=15)
    second.load_state_dict(first.state_dict())
    tokens += [t for step in global_steps([second], 5) for w, _ in step for t in w]
    (reference,) = loaders(heavy_corpus, tokenizer, 1, seq=len(tokens) - 1, batch=1)
    assert tokens == window_of(next(reference), 0)
    # Negative control: resuming at the saved window count in windows of the new length
    # (not at the token offsets) skips tokens.
    (windows_based,) = loaders(heavy_corpus, tokenizer, 1, seq=15)
    windows_based.seek(Position(20, [20 * 16]))
    skipped = [t for step in global_steps([windows_based], 5) for w, _ in step for t in w]
    assert tokens[20 * 32 :] != skipped


def test_unequal_splits_weigh_every_sequence_alike(tiny_corpus, tokenizer):
    """10 sequences over 3 ranks in micro-batches of 2: rank slices 4, 3, 3, and per
    micro-batch the weight ranks x sequences / global batch, so the ranks' averaged
    gradient is the global batch's mean (the weights of all sequences sum to the ranks)."""
    schedule = BatchSchedule([(0, 10)], 2, 3)
    slices = [schedule.rank_slice(10, r) for r in range(3)]
    assert slices == [(0, 4), (4, 7), (7, 10)]
    assert schedule.accumulation(10) == 2
    assert [schedule.micro_sizes(b - a, 2) for a, b in slices] == [[2, 2], [2, 1], [2, 1]]
    # Micro-batches of 1 split unevenly too: 8 or 9 windows a rank in 8 micro-batches
    # (one of 2 where there are 9), never a refusal; only fewer windows than ranks is one.
    ones = BatchSchedule([(0, 8192)], 1, 1016)
    assert (ones.accumulation(8192), ones.largest_micro(8192)) == (8, 2)
    with pytest.raises(DataError, match="cannot give each of 4"):
        BatchSchedule([(0, 3)], 1, 4)
    stream = build_stream(cfg(tiny_corpus).training, tokenizer)
    plans = [next(plan_steps(stream, schedule, r, 0, stream.start())) for r in range(3)]
    weights = [(len(m), w) for p in plans for m, w in zip(p.micro, p.weights)]
    assert all(w == 3 * n / 10 for n, w in weights) and sum(n for n, _ in weights) == 10


# ---- mixing -----------------------------------------------------------------------------


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


def test_a_mix_loses_nothing_of_either_source(tmp_path, small_corpus, tokenizer):
    """A large source at 0.9 and a 3-document one at 0.1: the small one is read pass after
    pass, the large one once through with nothing left out, and the tokens each source
    gave are reported. (Before, shards without a unit of the small source were skipped
    with their share of the large one.)"""
    from helpers import write_jsonl

    small = write_jsonl(tmp_path / "few", [{"id": f"f{i}", "text": f"Few {i}. " * 20}
                                           for i in range(3)], 1)  # fmt: skip
    mix = f"{small_corpus}:0.9,{small}:0.1"
    (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8)
    big = {k: len(v) for k, v in doc_tokens(small_corpus, tokenizer).items()}
    sequences = []
    while loader.position.offsets[0] < sum(big.values()) + 8 * (SEQ + 1):
        sequences += [spans for b in loader.next_step() for spans in b["spans"]]
    assert_spans_tile_every_document(
        [[s for s in sp if s[0] == "shakespeare"] for sp in sequences], big
    )
    passes = {s[4] for sp in sequences for s in sp if s[0] == "few"}
    assert len(passes) > 2
    by_source = loader.tokens_by_source()
    assert by_source == {
        "shakespeare": loader.position.offsets[0],
        "few": loader.position.offsets[1],
    }
    assert abs(by_source["shakespeare"] / sum(by_source.values()) - 0.9) < 0.02


def test_passes_begun_are_reported_once_each(tiny_corpus, second_corpus, tokenizer):
    """Each source's new pass is one event ``[source, pass]``, in order, none repeated,
    one per pass whatever the rank count (the old loader logged one per virtual shard)."""
    mix = f"{tiny_corpus}:0.5,{second_corpus}:0.5"
    (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8)
    events = []
    for _ in range(30):
        loader.next_step()
        events += loader.take_epoch_starts()
    for name, s in (("shakespeare", 0), ("kjv", 1)):
        passes = [e for src, e in events if src == name]
        assert passes == list(
            range(1, loader.stream.orders[s].epoch_of(loader.position.offsets[s]) + 1)
        )
    assert len([e for e in events if e[0] == "shakespeare"]) >= 3
    from torchtitan.metrics import passes_begun

    line = passes_begun([[7, "few", 31], [8, "few", 32], [9, "few", 45], [9, "big", 1]])
    assert line == "passes 31-45 of few began at steps 7-9; pass 1 of big began at step 9"


# ---- workers ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_give_the_batches_of_the_main_process(
    heavy_corpus, tokenizer, workers, monkeypatch
):
    """Any worker count, with groups of several micro-batches per message, gives the
    micro-batches of the loader without workers, in order, with their weights."""
    assert_workers_give_the_main_batches(heavy_corpus, tokenizer, workers, monkeypatch)


@pytest.mark.time_limit(20)  # the bug it guards against hangs the close
def test_closing_a_loader_ends_a_worker_that_does_not_stop(tiny_corpus, tokenizer, monkeypatch):
    """A worker that does not stop when its loader closes (busy in an endless loop, its
    iterator held by a thread still waiting in it, as a failed test's traceback holds
    one) is ended: it ignores SIGTERM, so multiprocessing's stop at exit (SIGTERM, then
    a join without a timeout) would wait for it forever, and pytest hung at exit. It
    exits with status 0 (killed, torch's SIGCHLD handler would raise in this process).
    Negative control: without that, the workers are alive after the close."""
    import contextlib
    import multiprocessing
    import os
    import threading

    import torchtitan.data.loader as loader_module
    from torchtitan.data.dataset import DocumentReader

    main, read = os.getpid(), DocumentReader.document

    def endless(self, *args):
        while os.getpid() != main:  # in the workers only
            pass
        return read(self, *args)

    def wait_in(loader):
        with contextlib.suppress(Exception):  # the workers it waits on are killed
            next(loader)

    def busy_workers() -> tuple:
        loader = build_dataloader(cfg(tiny_corpus, num_workers=2), tokenizer, 0, 1)
        waiting = threading.Thread(target=wait_in, args=(loader,), daemon=True)
        waiting.start()
        # The loader's own record of its workers, set by the waiting thread once they
        # run: a close before that (seeing the processes alone) would have none to end.
        while len(workers := list(loader._workers)) < 2:
            assert waiting.is_alive()
            waiting.join(0.05)
        assert all(p in multiprocessing.active_children() for p in workers)
        return loader, workers, waiting

    monkeypatch.setattr(DocumentReader, "document", endless)
    monkeypatch.setattr(loader_module, "WORKER_STOP_S", 0.5)
    loader, workers, waiting = busy_workers()
    loader.close()
    assert not [p.pid for p in workers if p.is_alive()]
    assert [p.exitcode for p in workers] == [0, 0]

    end_workers = loader_module.ParallelDataLoader._end_workers
    monkeypatch.setattr(loader_module.ParallelDataLoader, "_end_workers", lambda self: None)
    loader, workers, waiting = busy_workers()
    loader.close()
    alive = [p for p in workers if p.is_alive()]
    end_workers(loader)  # (a kill would have torch's SIGCHLD handler raise in this process)
    assert len(alive) == 2 and not [p for p in workers if p.is_alive()]


# Slow tier: two interpreter launches and a wait for a hang (12 s); the kill at close
# is checked in-process above.
@pytest.mark.slow
def test_a_process_that_exits_with_running_workers_exits(tmp_path):
    """Workers ignore SIGTERM (a scheduler's is for the rank to handle), and at exit
    multiprocessing stops daemon children with SIGTERM and joins them: a loader still
    referenced at exit (a module global here) must have its workers shut down first.
    Negative control: without that, the same process hangs (killed at the timeout)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from helpers import REPO

    script = tmp_path / "exits.py"
    script.write_text(
        "import sys\n"
        "from torchtitan.config import parse_args\n"
        "from torchtitan.data import build_dataloader\n"
        "from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer\n"
        f"cfg = parse_args({[*CONFIG, '--training.num_workers', '2']!r})\n"
        "LOADER = build_dataloader(cfg, Tokenizer(DEFAULT_TOKENIZER_PATH), 0, 1)\n"
        "next(LOADER)\n"
        "if sys.argv[1:] == ['hang']:\n"
        "    import atexit, torchtitan.data.loader as loader\n"
        "    atexit.unregister(loader._close_running_loaders)\n"
        "print('exiting', flush=True)\n"
    )

    def exits_within(seconds: float, *args) -> bool:
        """Whether the script, once it says it is exiting, is gone within ``seconds``."""
        # A session of its own: a hung one is killed with its workers (which ignore SIGTERM).
        proc = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        try:
            assert proc.stdout.readline().strip() == "exiting"
            return proc.wait(timeout=seconds) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert exits_within(60)
    assert not exits_within(3, "hang")


# ---- bad data, the length index ----------------------------------------------------------


def test_bad_documents_are_skipped_and_counted(tmp_path, tokenizer):
    docs = [{"id": f"d{i}", "text": f"Line {i} of a good document.\n" * 5} for i in range(8)]
    docs[2]["text"], docs[4]["text"], docs[6]["text"] = "", "   \n\t ", None
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (loader,) = loaders(tmp_path, tokenizer, 1, shuffle="false")
    seen = {sp[1] for _ in range(3) for b in loader.next_step() for s in b["spans"] for sp in s}
    assert seen == {"d0", "d1", "d3", "d5", "d7"}
    assert loader.skipped_documents() == 3
    with pytest.raises(DataError, match="'d2'.*empty or whitespace-only"):
        loaders(tmp_path, tokenizer, 1, shuffle="false", bad_data="error")


def test_the_order_locates_tokens_and_counts_skipped_documents_inside_units():
    """Two streaming units of rows [5, 0, 3] and [0, 4] tokens, unshuffled: every offset
    locates the right row and token (rows of no tokens are never located), and the
    skipped documents before an offset count the empty rows the stream has passed, in
    this pass and the ones before."""
    from torchtitan.data.index import SourceIndex
    from torchtitan.data.order import SourceOrder

    index = SourceIndex(np.array([5, 0, 3, 0, 4], np.int32), np.array([0, 3, 5]),
                        np.arange(5))  # fmt: skip
    order = SourceOrder(index, "s", 0, "s", shuffle=False)
    assert order.epoch_tokens == 12 and order.epoch_skipped == 2
    rows = [order.locate(o)[3] for o in range(24)]
    assert rows == ([0] * 5 + [2] * 3 + [4] * 4) * 2
    assert [order.locate(o)[4] for o in (0, 4, 5, 7, 8, 11)] == [0, 4, 0, 2, 0, 3]
    skipped = [order.skipped_before(o) for o in (0, 4, 5, 8, 12, 17)]
    assert skipped == [0, 0, 1, 2, 2, 3]


@pytest.mark.parametrize("workers,delta", [(0, 1), (0, -1), (2, 1)])
def test_a_stale_length_index_stops_with_one_clear_error(tmp_path, tokenizer, workers, delta):
    """A document whose token count is not the index's (the data or tokenizer changed
    behind the cache), whether the entry is one token too long or one too short, is a
    DataError naming the cache, not a silently shifted order; from a loader worker too,
    as one line (not the worker's traceback). A damaged cache file is measured again."""
    from torchtitan.data import index as length_index

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


def test_missing_path_and_column_are_clear_errors(small_corpus, tokenizer):
    with pytest.raises(DataError, match="matches no data files"):
        resolve_source(path="/nonexistent/corpus")
    with pytest.raises(DataError, match="no column 'body'"):
        loaders(small_corpus, tokenizer, 1, text_field="body")


def test_id_less_documents_get_stable_ids(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("A plain text document.\nWith two lines.\n")
    (tmp_path / "b.txt").write_text("Another document entirely.\n")
    for streaming in ("false", "true"):
        (loader,) = loaders(tmp_path, tokenizer, 1, shuffle="false", streaming=streaming)
        ids = {sp[1] for _ in range(2) for s in next(loader)["spans"] for sp in s}
        assert len(ids) == 2, ids


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


def test_source_registry_covers_bundled_corpus():
    spec = resolve_source(name="bundled")
    assert len(spec.files) == 20 and spec.fmt == "parquet"
    names = ("shakespeare", "milton", "kjv")
    assert list(itertools.chain(*[resolve_source(name=n).files for n in names])) == spec.files


# ---- provenance checks --------------------------------------------------------------------


def test_exactly_once_check_sees_duplicates_and_holes():
    from torchtitan.provenance import check_exactly_once

    def report(*spans):
        seqs = [[["src", doc, a, b, e, 0]] for doc, a, b, e in spans]
        return check_exactly_once({0: {1: seqs}})["src"]

    fine = report(("d", 0, 10, 0), ("d", 10, 25, 0), ("d", 0, 5, 1))  # a new pass reads again
    assert (fine.duplicate_tokens, fine.gaps, fine.tokens) == (0, 0, 30)
    assert report(("d", 0, 10, 0), ("d", 6, 12, 0)).duplicate_tokens == 4
    assert report(("d", 0, 10, 0), ("d", 12, 20, 0)).gaps == 1
    assert report(("d", 3, 10, 0)).gaps == 1, "a document must be read from its start"


def test_exactly_once_check_counts_a_replayed_step():
    """A step trained twice repeats its spans exactly: every token of them is a duplicate
    (a checker keeping a set of spans would see each once and report nothing)."""
    from torchtitan.provenance import check_exactly_once

    step = [[["src", "a", 0, 10, 0, 0], ["src", "b", 0, 6, 0, 1]], [["src", "a", 10, 16, 0, 0]]]
    later = [[["src", "a", 16, 20, 0, 0]]]
    replayed = check_exactly_once({0: {1: step, 2: later, 3: step}})["src"]
    assert (replayed.duplicate_tokens, replayed.gaps, replayed.tokens) == (22, 0, 48)
    two_ranks = check_exactly_once({0: {1: step}, 1: {1: step}})["src"]
    assert (two_ranks.duplicate_tokens, two_ranks.gaps) == (22, 0)


def test_completeness_check_sees_a_skipped_document(tiny_corpus, tokenizer):
    """Two ranks read several passes; check_complete finds every document of every
    finished pass read whole. Negative controls: a document dropped from one pass, and a
    second partly read document, are each reported."""
    from torchtitan.provenance import check_complete

    lengths = {"shakespeare": {k: len(v) for k, v in doc_tokens(tiny_corpus, tokenizer).items()}}
    ranks = loaders(tiny_corpus, tokenizer, 2, global_batch_size=6)
    provenance = {0: {}, 1: {}}
    for step in range(20):
        for r, loader in enumerate(ranks):
            provenance[r][step] = [s for b in loader.next_step() for s in b["spans"]]
    report = check_complete(provenance, lengths)["shakespeare"]
    assert len(report.finished_epochs) >= 2 and (report.missing, report.partial) == (0, 0)

    doc = provenance[0][0][0][0][1]
    dropped = {r: {k: [[sp for sp in seq if not (sp[1] == doc and sp[4] == 0)] for seq in v]
                   for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(dropped, lengths)["shakespeare"].missing >= 1
    cut = {r: {k: [[sp if sp[2] > 0 or sp[1] != doc else [*sp[:3], 1, *sp[4:]] for sp in seq]
               for seq in v] for k, v in steps.items()} for r, steps in provenance.items()}  # fmt: skip
    assert check_complete(cut, lengths)["shakespeare"].partial >= 1
