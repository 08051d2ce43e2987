"""torchtitan/data/loader.py: windows, batches and steps over the global order, ranks,
resume, mixing, workers and bad data; without torchrun.

Loaders here are the real ones (``build_dataloader`` over a parsed config, the length
index measured by the real code); several "ranks" are several loaders in one process,
which is all a rank's loader is (it never talks to other ranks).
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import time

import numpy as np
import pytest
import torch
from helpers import (
    CONFIG,
    GOOD_DOCUMENTS,
    SEQ,
    assert_pieces_tile,
    assert_spans_tile_every_document,
    assert_two_ranks_restore_at_every_step,
    assert_units_read_in_order,
    assert_workers_give_the_main_batches,
    cfg,
    child_pids,
    doc_tokens,
    global_steps,
    loaders,
    process_alive,
    window_of,
    write_jsonl_file,
)

from torchtitan.data import build_dataloader, build_stream
from torchtitan.data.loader import plan_steps
from torchtitan.data.schedule import BatchSchedule, parse_schedule
from torchtitan.data.sources import DataError
from torchtitan.data.state import from_tensor, to_tensor


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
    """Every rank's windows ``(source, pieces)`` of ``steps`` steps, planned by the
    loader's own function (no tokens read): ({rank: [[windows of a step], ...]}, the
    position after them)."""
    position = position or stream.start()
    ranks = range(schedule.dp_world)
    plans = [plan_steps(stream, schedule, rank, step, position) for rank in ranks]
    out = {rank: [] for rank in ranks}
    for _ in range(steps):  # ranks in lockstep: the stream walks each step once
        for rank in ranks:
            plan = next(plans[rank])
            out[rank].append([w for micro in plan.micro for w in micro])
    return out, plan.after


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_1024_ranks_read_each_token_once_and_nothing_repeats_early(heavy_corpus, tokenizer,
                                                                   streaming):  # fmt: skip
    """1,024 data-parallel ranks, 8 sequences each (simulated through the loader's own
    planning, windows of 4 tokens so that steps cross passes), then 1,016 (a lost node):
    the windows of every step, ranks in order, read every unit of two passes whole, each
    token once, with no gap or overlap across the change, and a pass ends before the
    next begins; the busiest rank has at most 1.15 x the mean (9 vs 8.06)."""
    seq = 3
    stream = build_stream(cfg(heavy_corpus, seq=seq, streaming=streaming).training, tokenizer)
    tokens, w = stream.orders[0].pass_tokens(), seq + 1
    size = 8192
    steps = -(-2 * tokens // (size * w)) + 1
    half = steps // 2
    before, resumed = simulate(stream, BatchSchedule([(0, size)], 8, 1024), half)
    after, _ = simulate(stream, BatchSchedule([(0, size)], 8, 1016), steps - half, half, resumed)
    windows = []
    for part in (before, after):
        for s in range(len(part[0])):
            windows.append([win for rank in sorted(part) for win in part[rank][s]])
    assert all(sum(p[4] - p[3] for p in pieces) == w for step in windows for _, pieces in step)
    assert_pieces_tile(windows, stream.orders[0], passes=2)
    for part, ranks in ((before, 1024), (after, 1016)):
        counts = [len(part[r][0]) for r in range(ranks)]
        assert sum(counts) == size and max(counts) / (size / ranks) <= 1.15
    # Negative control: a window dropped from the middle leaves a gap.
    with pytest.raises(AssertionError, match="gap or overlap"):
        assert_pieces_tile([windows[0][:100] + windows[0][101:]], stream.orders[0], passes=0)


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
    assert entries[0]["windows"] == 60
    assert sum(c[4] for c in entries[0]["cursors"]) == 60 * (SEQ + 1)  # tokens read
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
    assert sorted(windows) == sorted(w for w, _ in reference)  # a step orders its own


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
    """5 steps at seq_len 31, then 5 at 15: every lane goes on where it stopped (nothing
    skipped or read twice at the change), and the second leg equals a run at 15 resumed
    from the same position."""
    lengths = {k: len(v) for k, v in doc_tokens(heavy_corpus, tokenizer).items()}
    (first,) = loaders(heavy_corpus, tokenizer)
    spans = [s for step in global_steps([first], 5) for _, s in step]
    (second,) = loaders(heavy_corpus, tokenizer, 1, seq=15)
    second.load_state_dict(first.state_dict())
    spans += [s for step in global_steps([second], 5) for _, s in step]
    assert_units_read_in_order(spans, lengths)
    # Negative control: resuming at the saved window count in windows of the new length
    # (not at the lanes' positions) skips and repeats tokens.
    (windows_based,) = loaders(heavy_corpus, tokenizer, 1, seq=15)
    windows_based.seek(windows_based.stream.position_after(20))
    skipped = spans[:20] + [s for step in global_steps([windows_based], 5) for _, s in step]
    with pytest.raises(AssertionError, match="gap or overlap"):
        assert_units_read_in_order(skipped, lengths)


def test_a_skip_across_a_batch_size_change_passes_each_steps_own_batch(heavy_corpus, tokenizer):
    """``batch_size_schedule`` 0:4,4:8, 2 ranks, training steps 4-7 skipped (loader steps
    3-6: one step at 4 sequences, three at 8): the skip passes over exactly the windows
    an unskipped run's steps 3-6 read (28, each step at its own global batch), and the
    next step reads the windows that follow them, on both ranks. Negative control: the
    plan of a run that skipped only steps 4-6 reads other windows there."""
    schedule = BatchSchedule(parse_schedule("0:4,4:8"), 2, 2)
    stream = build_stream(cfg(heavy_corpus).training, tokenizer)

    def steps(skips, n, step=0, position=None):
        plans = [plan_steps(stream, schedule, r, step, position or stream.start(), skips)
                 for r in range(2)]  # fmt: skip
        return [[next(p) for p in plans] for _ in range(n)]

    whole = steps([], 7)
    lo, hi = whole[2][0].after, whole[6][0].after  # before loader step 3, after step 6
    assert hi.windows - lo.windows == 4 + 3 * 8
    skipping = steps([(4, 4)], 4)
    assert [p.skipped for p in skipping[3]] == [[[4, 4, lo.windows, hi.windows]]] * 2
    after = steps([], 1, 3, hi)[0]  # loader step 3 from where step 6 ended
    assert [p.micro for p in skipping[3]] == [p.micro for p in after]
    shorter = steps([(4, 3)], 4)
    assert [p.micro for p in shorter[3]] != [p.micro for p in after]


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
    while loader.position.tokens()[0] < sum(big.values()) + 8 * (SEQ + 1):
        sequences += [spans for b in loader.next_step() for spans in b["spans"]]
    assert_spans_tile_every_document(
        [[s for s in sp if s[0] == "shakespeare"] for sp in sequences], big
    )
    passes = {s[4] for sp in sequences for s in sp if s[0] == "few"}
    assert len(passes) > 2
    by_source = loader.tokens_by_source()
    assert by_source == {
        "shakespeare": loader.position.tokens()[0],
        "few": loader.position.tokens()[1],
    }
    assert abs(by_source["shakespeare"] / sum(by_source.values()) - 0.9) < 0.02


def test_a_mixed_run_resumes_its_mix_where_it_stopped(tiny_corpus, second_corpus, tokenizer):
    """Two sources at 0.5: the state after each of steps 1-5, loaded into a fresh loader,
    gives exactly the next 3 steps (tokens and spans, so the same source for each
    window). Negative control: the position with its window count moved by one (the
    mix's place, not the sources' cursors) gives other steps."""
    mix = f"{tiny_corpus}:0.5,{second_corpus}:0.5"

    def build():
        return loaders(None, tokenizer, 1, datasets=mix, global_batch_size=4)

    ranks = build()
    reference, states = [], []
    for _ in range(8):
        states.append([r.state_dict() for r in ranks])
        reference += global_steps(ranks, 1)
    read = {s for step in reference for _, spans in step for s, *_ in spans}
    assert read == {"shakespeare", "kjv"}

    def resumed(k, state) -> list:
        (fresh,) = build()
        fresh.load_state_dict(state)
        return global_steps([fresh], 3)

    for k in range(1, 6):
        assert resumed(k, states[k][0]) == reference[k : k + 3], k
    entry = from_tensor(states[3][0]["dp_rank_0"])
    entry["windows"] += 1
    assert resumed(3, {"dp_rank_0": to_tensor(entry)}) != reference[3:6]


def test_a_pass_that_ends_on_a_step_boundary_is_reported_once(tmp_path, tokenizer):
    """A window size that divides a pass's tokens, one window a step: every pass ends
    exactly at a step's end, before the next step begins the next pass. Each pass that
    began is still reported once, at the step that begins it: passes 1 and 2 over three
    passes' steps. Negative control: one window more begins pass 3."""
    from helpers import write_jsonl

    for n in range(12, 40):  # a corpus whose pass has a divisor to be the window size
        docs = [{"id": f"d{i}", "text": f"Line {i} of a short corpus. " * (2 + i % 3)}
                for i in range(n)]  # fmt: skip
        folder = write_jsonl(tmp_path / f"c{n}" / "c", docs, 2)
        total = build_stream(cfg(folder).training, tokenizer).orders[0].pass_tokens()
        window = next((d for d in range(9, total // 4) if total % d == 0), None)
        if window is not None:
            break

    def passes_begun(steps: int) -> list[int]:
        (loader,) = loaders(folder, tokenizer, 1, seq=window - 1, batch=1,
                            global_batch_size=1, length_index_dir=tmp_path / "counts")  # fmt: skip
        events = []
        for _ in range(steps):
            loader.next_step()
            events += loader.take_epoch_starts()
        assert all(name == "c" for name, _ in events)
        return [p for _, p in events]

    assert passes_begun(3 * total // window) == [1, 2]
    assert passes_begun(3 * total // window + 1) == [1, 2, 3]


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
        cursor = loader.position.cursors[s]
        assert passes == list(range(1, cursor.pass_ + (1 if cursor.lanes else 0)))
    assert len([e for e in events if e[0] == "shakespeare"]) >= 3
    from torchtitan.records.metrics import passes_begun

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


def test_two_workers_tokenize_a_document_once_on_a_pass_after_the_first(tmp_path, tokenizer,
                                                                       monkeypatch):  # fmt: skip
    """A warm pass (counts known, no measured tokens kept): every document a window reads
    is tokenized by the worker that reads it. The windows of a unit are one worker's
    (loader.window_owner), so a document cut by a window boundary, which its lane's next
    window continues, is tokenized once; only a window that runs on into its lane's next
    unit shares a document with that unit's worker. Dealt out by micro-batch, as before,
    both workers tokenized about half of the documents (155 of 292 here)."""
    from harness.corpus import bundled_documents, write_jsonl
    from torchtitan.data import packing
    from torchtitan.data.prepare import prepare

    docs = [{"id": d["id"], "text": d["text"][: 300 + (i * 137) % 1500]}
            for i, d in enumerate(bundled_documents()[:300])]  # fmt: skip
    corpus = write_jsonl(tmp_path / "corpus", docs, 4)
    settings = dict(seq=128, streaming="true", global_batch_size=8,
                    length_index_dir=str(tmp_path / "counts"))  # fmt: skip
    prepare(cfg(corpus, **settings).training, tokenizer)
    for sidecar in (tmp_path / "counts").rglob("*.tokens"):
        sidecar.unlink()  # a later pass: the measured tokens are gone
    real = packing.encode_document

    def recorded(tok, text):  # each process (the workers fork after this) its own file
        with open(tmp_path / f"tokenized-{os.getpid()}", "a") as f:
            f.write(json.dumps(text[:80] + str(len(text))) + "\n")
        return real(tok, text)

    monkeypatch.setattr(packing, "encode_document", recorded)
    loader = build_dataloader(cfg(corpus, num_workers=2, **settings), tokenizer, 0, 1)
    for _ in range(40):
        loader.next_step()
    pids = [p.pid for p in loader._workers]
    loader.close()
    by_worker = [set((tmp_path / f"tokenized-{p}").read_text().splitlines()) for p in pids]
    assert not (tmp_path / f"tokenized-{os.getpid()}").exists(), "the rank reads nothing"
    both, either = by_worker[0] & by_worker[1], by_worker[0] | by_worker[1]
    assert len(either) > 150 and len(both) <= 0.15 * len(either), (len(both), len(either))


def test_a_request_that_outgrows_the_shared_buffer_restarts_the_workers(
    tiny_corpus, tokenizer, monkeypatch
):
    """A seek or new skips reach running workers as a request in a shared buffer; one
    that no longer fits (hundreds of skips) starts the workers again with a larger one,
    and the batches stay the 0-worker loader's. Negative control: a request that fits
    keeps the same workers."""
    import torchtitan.data.loader as loader_module

    monkeypatch.setattr(loader_module, "REQUEST_BYTES", 0)  # 4 x the first request's size
    skips = [(1000 + 2 * i, 1) for i in range(400)]  # far ahead: no step read here meets one
    steps = []
    for workers in (0, 1):
        loader = build_dataloader(cfg(tiny_corpus, global_batch_size=8, num_workers=workers),
                                  tokenizer, 0, 1)  # fmt: skip
        try:
            read = [loader.next_step()]
            first = loader.worker_pids()
            loader.seek(loader.position)  # a request that fits
            read.append(loader.next_step())
            kept = loader.worker_pids()
            loader.add_skips(skips)  # one that does not
            read.append(loader.next_step())
            again = loader.worker_pids()
            steps.append([[row.tolist() for b in step for row in b["input"]] for step in read])
        finally:
            loader.close()
    assert steps[1] == steps[0]
    assert len(first) == len(again) == 1 and kept == first and again != first


@pytest.mark.time_limit(20)  # the bug it guards against hangs the close
def test_closing_a_loader_ends_a_worker_that_does_not_stop(tiny_corpus, tokenizer, monkeypatch,
                                                           tmp_path):  # fmt: skip
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
    from torchtitan.data.windows import DocumentReader

    main, read = os.getpid(), DocumentReader.document

    def endless(self, *args):
        if os.getpid() != main:  # in the workers only
            (tmp_path / f"busy-{os.getpid()}").touch()
        while os.getpid() != main:
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
        # Both busy in the endless loop (not still measuring, or starting).
        while not all((tmp_path / f"busy-{p.pid}").exists() for p in workers):
            assert waiting.is_alive()
            waiting.join(0.05)
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


# ---- bad data ---------------------------------------------------------------------------


def test_bad_documents_are_skipped_and_counted(tmp_path, tokenizer):
    docs = [{"id": f"d{i}", "text": f"Line {i} of a good document.\n" * 5} for i in range(8)]
    docs[2]["text"], docs[4]["text"], docs[6]["text"] = "", "   \n\t ", None
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (loader,) = loaders(tmp_path, tokenizer, 1, shuffle="false")
    seen = {sp[1] for _ in range(3) for b in loader.next_step() for s in b["spans"] for sp in s}
    assert seen == {"d0", "d1", "d3", "d5", "d7"}
    assert loader.skipped_documents() == 3
    (strict,) = loaders(tmp_path, tokenizer, 1, shuffle="false", bad_data="error")
    with pytest.raises(DataError, match="'d2'.*empty or whitespace-only"):
        for _ in range(3):  # the counts are measured as the stream reaches each unit
            strict.next_step()


# ---- bad data and dying ranks -------------------------------------------------------------


def read(folder, tokenizer, windows: int, **kw) -> tuple:
    """(the loader, the spans of its first ``windows`` windows): one rank, unshuffled,
    one window a step, so that passes go by."""
    (loader,) = loaders(folder, tokenizer, 1, shuffle="false", batch=1, **kw)
    return loader, [sp for _ in range(windows) for seq in next(loader)["spans"] for sp in seq]


@pytest.mark.parametrize("streaming", ["false", "true"], ids=["map", "streaming"])
def test_invalid_utf8_is_skipped_and_counted(tmp_path, tokenizer, streaming):
    good = b"".join(json.dumps(r).encode() + b"\n" for r in GOOD_DOCUMENTS)
    folder = write_jsonl_file(
        tmp_path / "d" / "a.jsonl", raw=good + b'{"id": "bad", "text": "caf\xe9 \xff"}\n'
    )
    loader, spans = read(folder, tokenizer, 12, streaming=streaming)
    assert loader.skipped_documents() >= 1
    assert {sp[1] for sp in spans} == {"g0", "g1", "g2", "g3"}


def test_null_missing_and_non_string_text_are_skipped_and_counted(tmp_path, tokenizer):
    folder = write_jsonl_file(
        tmp_path / "d" / "a.jsonl", [*GOOD_DOCUMENTS, {"id": "n", "text": None}, {"id": "m"}]
    )
    loader, spans = read(folder, tokenizer, 12)
    assert {sp[1] for sp in spans} == {"g0", "g1", "g2", "g3"}
    passes = max(sp[4] for sp in spans)
    assert passes >= 1
    assert 2 * passes <= loader.skipped_documents() <= 2 * passes + 2  # 2 skips in every pass
    ints = write_jsonl_file(tmp_path / "i" / "a.jsonl", [{"text": 5}, {"text": 7}])
    (nothing,) = loaders(ints, tokenizer, 1)
    with pytest.raises(DataError, match="no usable document"):
        nothing.next_step()


def test_a_5_mb_document_packs_and_restores(tmp_path, tokenizer):
    """Windows of 2,048 tokens inside one 5 MB document: the state after 3 is a position
    of a few bytes, and a fresh loader resumed there gives the next 2 windows, which
    start 3 x 2,048 tokens into the document."""
    line = "And thus the whirligig of time brings in his revenges.\n"
    huge = {"id": "huge", "text": line * (5_000_000 // len(line))}
    folder = write_jsonl_file(tmp_path / "d" / "a.jsonl", [huge, *GOOD_DOCUMENTS])
    loader, _ = read(folder, tokenizer, 3, seq=2047)
    state = loader.state_dict()
    assert len(pickle.dumps(state)) < 1000, "the state holds a position, not the 5 MB buffer"
    reference = [next(loader) for _ in range(2)]
    (fresh,) = loaders(folder, tokenizer, 1, shuffle="false", batch=1, seq=2047)
    fresh.load_state_dict(state)
    for a, b in zip([next(fresh) for _ in range(2)], reference):
        assert torch.equal(a["input"], b["input"]) and a["spans"] == b["spans"]
    assert reference[0]["spans"][0] == [["d", "huge", 3 * 2048, 4 * 2048, 0, 0]]


def test_a_loader_worker_ends_with_its_rank_however_it_dies(tmp_path, small_corpus, tokenizer):
    """A "rank" (a fork of this process) starts a real loader with one worker, then dies
    by SIGKILL: its worker, which ignores the stop signals, is gone within 2 s instead
    of living on with the rank's memory and sockets."""
    read, write = os.pipe()
    rank = os.fork()
    if rank == 0:  # the rank: never returns into pytest
        try:
            (loader,) = loaders(small_corpus, tokenizer, 1, num_workers=1)
            next(loader)
            os.write(write, " ".join(map(str, child_pids(os.getpid()))).encode() + b"\n")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:  # a rank stuck before it answers is killed all the same
        answered = select.select([f], [], [], 120)[0]
        workers = [int(p) for p in f.readline().split()] if answered else []
    os.kill(rank, signal.SIGKILL)
    os.waitpid(rank, 0)
    deadline = time.monotonic() + 2
    while any(map(process_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [p for p in workers if process_alive(p)]
    for pid in left:  # leave nothing behind, even when failing
        os.kill(pid, signal.SIGKILL)
    assert workers and not left, f"loader worker(s) {left} outlived their rank"
