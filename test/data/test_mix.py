"""Mixtures that change (order.MixByStep, state.restore_cursors): weights by step, sources
added, retired and back, every source's promise kept across the changes; without torchrun.

Loaders are the real ones, several ranks several loaders in one process (test_loader.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections import defaultdict

import numpy as np
import pytest
from helpers import bundled_documents, doc_tokens, global_steps, loaders, write_jsonl

from torchtitan.config import ConfigError
from torchtitan.data.loader import plan_steps
from torchtitan.data.order import MixByStep, MixSchedule
from torchtitan.data.state import from_tensor, to_tensor


@contextlib.contextmanager
def _heard(caplog):
    """caplog hears the project's logger even after a train.main() in this process,
    which stops it propagating to the root (train.setup_logging)."""
    logger = logging.getLogger("torchtitan")
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)


def schedule(*points) -> str:
    """``training.mix_schedule`` as the command line takes it: JSON."""
    return json.dumps([{"step": s, "weights": w, "ramp": r} for s, w, r in points])


@pytest.fixture(scope="module")
def third_corpus(tmp_path_factory):
    """10 short documents (Milton): the third source of a mix."""
    return write_jsonl(tmp_path_factory.mktemp("third") / "milton",
                       bundled_documents("milton", 10, 300))  # fmt: skip


def tokens(steps) -> list:
    return [[t for t, _ in step] for step in steps]


def source_windows(steps, name: str) -> list:
    """The windows ``(tokens, spans)`` of source ``name``, in reading order."""
    return [(t, s) for step in steps for t, s in step if s[0][0] == name]


# ---- the schedule and the resume ----------------------------------------------------------


def test_a_schedule_change_at_k_reads_what_a_resume_at_k_with_new_weights_reads(
    tiny_corpus, second_corpus, tokenizer, caplog
):
    """Weights 0.8/0.2 until step 4, then 0.2/0.8 by the schedule; and the same run
    stopped at 4 and resumed with 0.2/0.8 on the command line: the same windows (token
    ids ==) at every step after 4, the resume logging the change at step 4. Negative
    controls: a resume with the old weights, and a schedule changing at step 5, read
    other windows."""
    before = f"{tiny_corpus}:0.8,{second_corpus}:0.2"
    after = f"{tiny_corpus}:0.2,{second_corpus}:0.8"
    new = {"shakespeare": 0.2, "kjv": 0.8}

    def run(mix, steps, state=None, **kw):
        (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8, **kw)
        if state is not None:
            loader.load_state_dict(state)
        return global_steps([loader], steps), loader

    reference, _ = run(before, 12, mix_schedule=schedule((4, new, 0)))
    _, stopped = run(before, 4)
    state = stopped.state_dict()
    with caplog.at_level(logging.INFO, logger="torchtitan"), _heard(caplog):
        resumed, _ = run(after, 8, state)
    assert tokens(resumed) == tokens(reference[4:])
    assert resumed == reference[4:]
    assert "step 4: source weights {shakespeare: 0.8, kjv: 0.2} -> {shakespeare: 0.2, kjv: 0.8}" \
        in caplog.text  # fmt: skip
    assert tokens(run(before, 8, state)[0]) != tokens(reference[4:])
    late, _ = run(before, 12, mix_schedule=schedule((5, new, 0)))
    assert tokens(late[4:]) != tokens(reference[4:])


def test_weights_ramp_in_a_straight_line_and_resume_exactly(tiny_corpus, second_corpus,
                                                           tokenizer):  # fmt: skip
    """A ramp over 4 steps from step 2: the weights of each step lie on the line, and the
    state after every step, loaded into a fresh loader with the same schedule, reads the
    next steps exactly. Negative control: the saved step moved by one (the ramp's place)
    reads other windows."""
    mix = f"{tiny_corpus}:0.9,{second_corpus}:0.1"
    points = schedule((2, {"shakespeare": 0.1, "kjv": 0.9}, 4))

    def build():
        return loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8, mix_schedule=points)

    (loader,) = build()
    weights = [loader.stream.mix.weights(s)[1] for s in range(8)]
    assert weights[:3] == [0.1, 0.1, 0.1] and weights[6:] == [0.9, 0.9]
    assert np.allclose(weights[2:7], [0.1, 0.3, 0.5, 0.7, 0.9])  # two formulas: a tolerance
    states, reference = [], []
    for _ in range(9):
        states.append(loader.state_dict())
        reference += global_steps([loader], 1)
    for k in range(1, 6):
        (fresh,) = build()
        fresh.load_state_dict(states[k])
        assert global_steps([fresh], 3) == reference[k : k + 3], k
    entry = from_tensor(states[3]["dp_rank_0"])
    entry["step"] += 1
    (fresh,) = build()
    fresh.load_state_dict({"dp_rank_0": to_tensor(entry)})
    assert tokens(global_steps([fresh], 3)) != tokens(reference[3:6])


def test_a_source_added_begins_pass_0_and_one_retired_continues_where_it_stopped(
    tiny_corpus, second_corpus, tokenizer, caplog
):
    """shakespeare + kjv for 3 steps, shakespeare alone for 3 (kjv removed from the list:
    its cursor stays in the entry), both again for 4: kjv's windows over the run are
    exactly the first ones of a kjv-only stream (each document once in its pass, the
    step-3 cursor continued). And kjv added at step 3 to a shakespeare-only run begins
    its pass 0 there: its windows are a kjv-only stream's first. Negative control: the
    entry without its retired cursor restarts kjv's pass, reading its first windows
    again."""
    both = f"{tiny_corpus}:0.5,{second_corpus}:0.5"

    def run(mix, steps, state=None):
        (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=6)
        if state is not None:
            loader.load_state_dict(state)
        return global_steps([loader], steps), loader.state_dict()

    first, s3 = run(both, 3)
    with caplog.at_level(logging.INFO, logger="torchtitan"), _heard(caplog):
        alone, s6 = run(str(tiny_corpus), 3, s3)
        back, _ = run(both, 4, s6)
    assert "step 3: source 'kjv' left training.datasets" in caplog.text
    assert "step 6: source 'kjv' is back: it continues its pass 0" in caplog.text
    saved = from_tensor(s3["dp_rank_0"])
    assert from_tensor(s6["dp_rank_0"])["retired"]["kjv"] == saved["cursors"][1]
    assert not source_windows(alone, "kjv")
    kjv = source_windows(first + back, "kjv")
    (only,) = loaders(second_corpus, tokenizer, 1, global_batch_size=len(kjv))
    expected = global_steps([only], 1)[0]
    assert len(kjv) > 10 and {s[4] for _, sp in kjv for s in sp} == {0}
    assert sorted(kjv) == sorted(expected)

    entry = from_tensor(s6["dp_rank_0"])
    entry["retired"] = {}
    forgot, _ = run(both, 4, {"dp_rank_0": to_tensor(entry)})
    assert sorted(source_windows(first + forgot, "kjv")) != sorted(expected)

    caplog.clear()
    _, s3_alone = run(str(tiny_corpus), 3)
    with caplog.at_level(logging.INFO, logger="torchtitan"), _heard(caplog):
        added, _ = run(both, 4, s3_alone)
    assert "step 3: source 'kjv' joins the mix: it begins its pass 0" in caplog.text
    kjv = source_windows(added, "kjv")
    (only,) = loaders(second_corpus, tokenizer, 1, global_batch_size=len(kjv))
    assert sorted(kjv) == sorted(global_steps([only], 1)[0])


def test_a_changed_file_of_a_present_source_is_still_refused(tmp_path, tokenizer):
    """Weights, and a source added or gone, are no difference of the data; a file of a
    source in both that changed is, named. Negative control: the same fingerprints but
    the file leave nothing."""
    from torchtitan.data.fingerprint import fingerprint_diff

    def fp(*sources):
        return {"sources": [{"name": n, "identity": n, "weight": w, "files": files}
                            for n, w, files in sources], "seed": 1}  # fmt: skip

    a, b = [["a.jsonl", 10, 1]], [["b.jsonl", 20, 2]]
    assert fingerprint_diff(fp(("web", 0.9, a), ("code", 0.1, b)),
                            fp(("code", 0.7, b), ("math", 0.3, a))) == []  # fmt: skip
    changed = [["b.jsonl", 21, 3]]
    assert fingerprint_diff(fp(("web", 0.9, a), ("code", 0.1, b)),
                            fp(("code", 0.5, changed))) == ["source 'code' file b.jsonl changed"]  # fmt: skip


# ---- every source's promise across the changes ---------------------------------------------


def assert_each_pass_reads_each_token_once(steps, lengths: dict[str, dict[str, int]]):
    """From provenance, per source: in each pass, each document's spans follow one another
    from its first token without a gap or an overlap (each token once); every pass but
    the last reads every document whole; and no span of a pass comes before the last
    span of the pass before (no document repeats before its pass is read through; a
    step's windows are one read, grouped by unit, so by step)."""
    covered = defaultdict(list)  # (source, pass, doc) -> spans
    first, last = {}, {}  # (source, pass) -> the step of its first / last span
    for i, step in enumerate(steps):
        for _, spans in step:
            for source, doc, start, end, pass_, _ in spans:
                covered[(source, pass_, doc)].append((start, end))
                first.setdefault((source, pass_), i)
                last[(source, pass_)] = i
    for key, spans in covered.items():
        spans = sorted(spans)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), key
    for source, docs in lengths.items():
        passes = sorted(p for s, p in first if s == source)
        assert passes == list(range(len(passes))), (source, passes)
        for p in passes[:-1]:
            for doc, n in docs.items():
                assert max(e for _, e in covered[(source, p, doc)]) == n, (source, p, doc)
            assert last[(source, p)] <= first[(source, p + 1)], (source, p)


def test_three_changes_on_three_sources_read_each_token_once_per_pass(
    tiny_corpus, second_corpus, third_corpus, tokenizer
):
    """Three sources, three changes (milton retired at 0 from step 4, a ramp towards kjv
    from step 8, milton back at step 14), on 2 ranks: from provenance, every token of
    every source once per pass and no document repeated before its pass ends, each
    source crossing passes. Negative control: the same spans with one window of a
    finished pass read again fail the check."""
    mix = f"{tiny_corpus}:0.4,{second_corpus}:0.3,{third_corpus}:0.3"
    points = schedule(
        (4, {"shakespeare": 0.6, "kjv": 0.4}, 0),
        (8, {"shakespeare": 0.2, "kjv": 0.8}, 4),
        (14, {"shakespeare": 0.3, "kjv": 0.3, "milton": 0.4}, 0),
    )
    ranks = loaders(None, tokenizer, 2, datasets=mix, global_batch_size=12, mix_schedule=points)
    steps = global_steps(ranks, 24)
    milton = {s[0][0] for step in steps[4:14] for _, s in step}
    assert "milton" not in milton
    lengths = {name: {d: len(t) for d, t in doc_tokens(corpus, tokenizer).items()}
               for name, corpus in (("shakespeare", tiny_corpus), ("kjv", second_corpus),
                                    ("milton", third_corpus))}  # fmt: skip
    for cursor in ranks[0].position.cursors:
        assert cursor.pass_ >= 1
    assert_each_pass_reads_each_token_once(steps, lengths)
    repeated = [list(step) for step in steps]
    repeated[-1].append(repeated[1][0])  # a window of pass 0 read again at the end
    with pytest.raises(AssertionError):
        assert_each_pass_reads_each_token_once(repeated, lengths)
    repeated = [list(step) for step in steps]
    del repeated[2][0]  # a window of pass 0 left out
    with pytest.raises(AssertionError):
        assert_each_pass_reads_each_token_once(repeated, lengths)


def share_error(mix: MixByStep, sizes: list[int], change: int, n: int, target=None) -> float:
    """The largest gap, in windows, between a source's count and ``n`` times its weight
    (``target``, else the mix's at ``change``) over the ``n`` windows from the first step
    at ``change`` on (steps of ``sizes``)."""
    g, step = 0, 0
    while step < change:
        g += sizes[step % len(sizes)]
        step += 1
    chosen, left = [], n
    while left:
        size = min(left, sizes[step % len(sizes)])
        chosen.append(mix.at(step).sources(g, size))
        g, left, step = g + size, left - size, step + 1
    counts = np.bincount(np.concatenate(chosen), minlength=len(mix.names))
    target = mix.weights(change) if target is None else target
    return float(np.abs(counts - n * np.asarray(target)).max())


def test_the_share_after_a_change_is_within_log_n_windows():
    """After a change at any of several steps, over n = 100, 1,000 and 10,000 windows
    each source's count is within 1 + ln(n) windows of n times its new weight (the bound
    docs/datasets.md states). Negative controls: a mix that kept the old weights misses
    it, and so do i.i.d. draws at the new weights at n = 10,000."""
    names = ["web", "code", "math"]
    for seed in (0, 5):
        for new in ({"web": 0.5, "code": 0.3, "math": 0.2}, {"web": 0.9, "code": 0.1},
                    {"code": 0.97, "math": 0.03}):  # fmt: skip
            mix = MixByStep(names, [0.6, 0.3, 0.1], [(7, new, 0)], seed)
            for sizes in ([8], [12, 5, 33]):
                for n in (100, 1_000, 10_000):
                    assert share_error(mix, sizes, 7, n) <= 1 + math.log(n), (new, sizes, n)
    new = {"web": 0.5, "code": 0.3, "math": 0.2}
    stale = MixByStep(names, [0.6, 0.3, 0.1], [], 0)  # the change never applied
    assert share_error(stale, [8], 7, 1_000, target=[0.5, 0.3, 0.2]) > 1 + math.log(1_000)
    for seed in range(4):
        draws = np.random.default_rng(seed).choice(3, size=10_000, p=[0.5, 0.3, 0.2])
        error = np.abs(np.bincount(draws, minlength=3) - 10_000 * np.array([0.5, 0.3, 0.2]))
        assert error.max() > 1 + math.log(10_000)


def test_a_retired_source_gets_no_window_and_the_fixed_mix_is_unchanged():
    """A source at weight 0 (also the last one) gets no window; weights that are all
    positive give the mix of before (bounds as they were). Negative control: a tiny
    weight instead of 0 does get windows."""
    for weights in ([0.5, 0.0, 0.5], [0.7, 0.3, 0.0], [0.0, 1.0]):
        chosen = MixSchedule(weights, 3).sources(0, 50_000)
        assert not np.isin(np.flatnonzero(np.asarray(weights) == 0), chosen).any()
    assert 2 in MixSchedule([0.7, 0.3, 1e-3], 3).sources(0, 50_000)
    mix = MixSchedule([0.2, 0.5, 0.3], 9)
    cumulative = np.cumsum(np.asarray([0.2, 0.5, 0.3]) / 1.0)
    old = (cumulative * 2.0**53).astype(np.uint64) << np.uint64(11)
    old[-1] = np.uint64(2**64 - 1)
    assert (mix.bounds == old).all()


def test_a_schedule_that_is_not_one_is_one_config_error(tiny_corpus, tokenizer):
    """Steps out of order, a point inside the ramp before it, negative or all-zero weights,
    bad JSON, and a name that is no source: one line each. Negative control: a good
    schedule parses."""
    from helpers import cfg

    bad = [
        (schedule((5, {"a": 1}, 0), (3, {"a": 1}, 0)), "comes before"),
        (schedule((5, {"a": 1}, 10), (12, {"a": 1}, 0)), "comes before"),
        (schedule((5, {"a": -1, "b": 1}, 0)), ">= 0"),
        (schedule((5, {"a": 0}, 0)), "one > 0"),
        ("[{step: 3}]", "is not JSON"),
        ('[{"step": 3, "weight": {}}]', "unknown key training.mix_schedule[0].weight"),
    ]
    for text, words in bad:
        with pytest.raises(ConfigError, match="training.mix_schedule") as e:
            cfg(tiny_corpus, mix_schedule=text)
        assert words in str(e.value), (text, str(e.value))
    good = cfg(tiny_corpus, mix_schedule=schedule((5, {"shakespeare": 1}, 10)))
    assert good.training.mix_schedule[0].ramp == 10
    with pytest.raises(Exception, match="names \\['cod'\\], which are not sources"):
        loaders(tiny_corpus, tokenizer, 1, mix_schedule=schedule((5, {"cod": 1}, 0)))


# ---- elastic ------------------------------------------------------------------------------


def test_a_schedule_run_resumed_on_other_ranks_and_batch_size_reads_the_same_windows(
    tiny_corpus, second_corpus, tokenizer
):
    """A schedule with a ramp across the resume: 1 rank at global batch 8 for 5 steps,
    then 3 ranks at 12, read the windows of one uninterrupted rank whose batch goes from
    8 to 12 at step 5. Negative control: the resume without the schedule reads others."""
    mix = f"{tiny_corpus}:0.7,{second_corpus}:0.3"
    points = schedule((3, {"shakespeare": 0.2, "kjv": 0.8}, 6))
    reference = global_steps(loaders(None, tokenizer, 1, datasets=mix, mix_schedule=points,
                                     batch_size_schedule="0:8,5:12"), 10)  # fmt: skip
    (first,) = loaders(None, tokenizer, 1, datasets=mix, mix_schedule=points,
                       global_batch_size=8)  # fmt: skip
    assert global_steps([first], 5) == reference[:5]
    state = first.state_dict()

    def resumed(**kw) -> list:
        ranks = loaders(None, tokenizer, 3, datasets=mix, global_batch_size=12, **kw)
        for r in ranks:
            r.load_state_dict(state)
        return global_steps(ranks, 5)

    assert resumed(mix_schedule=points) == reference[5:]
    assert tokens(resumed()) != tokens(reference[5:])


# ---- seeing it ----------------------------------------------------------------------------


def test_the_metrics_and_the_plot_show_the_weights_shares_and_passes(tmp_path, tiny_corpus,
                                                                    second_corpus, tokenizer):  # fmt: skip
    """The loader reports the weights of the step just taken and each source's pass and
    share of it read; plot_mix's shares are the tokens' over the window, and it draws a
    PNG. Negative control: a step before the change reports the old weights."""
    from torchtitan.tools.plot_mix import mix_series, plot_mix

    mix = f"{tiny_corpus}:0.5,{second_corpus}:0.5"
    points = schedule((2, {"shakespeare": 0.25, "kjv": 0.75}, 0))
    (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8, mix_schedule=points)
    loader.next_step()
    loader.next_step()
    assert loader.mix_by_source() == {"shakespeare": 0.5, "kjv": 0.5}
    loader.next_step()
    assert loader.mix_by_source() == {"shakespeare": 0.25, "kjv": 0.75}
    passes = loader.passes_by_source()
    assert all(p == 0 and 0 < read < 1 for p, read in passes.values()), passes
    records = [{"step": s, "source_tokens/a": 30 * s, "source_tokens/b": 10 * s,
                "mix_weight/a": 0.75, "mix_weight/b": 0.25, "source_pass/a": s // 4,
                "source_read/a": 0.5} for s in range(1, 11)]  # fmt: skip
    series = mix_series(records, 4)
    assert series["sources"]["a"]["share"][4] == 0.75 and series["sources"]["b"]["passes"][0] == 0
    assert series["sources"]["a"]["passes"][8] == 2.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_mix(tmp_path).stat().st_size > 0


def test_a_skip_passes_over_exactly_what_its_steps_would_read_at_their_own_weights(
    tiny_corpus, second_corpus, tokenizer
):
    """Skipping training steps 4-6 (a rewind's or --training.skip_steps) under a ramp
    that moves the weights through those steps: the position after the skip is the
    position a run that trained them reached (cursors ==), its windows range is theirs,
    and step 4 then reads from there at its own weights. Negative control: the same
    number of windows passed at step 4's weights alone leaves other cursors."""
    mix = f"{tiny_corpus}:0.9,{second_corpus}:0.1"
    points = schedule((3, {"shakespeare": 0.1, "kjv": 0.9}, 3))

    def build():
        (loader,) = loaders(None, tokenizer, 1, datasets=mix, global_batch_size=8,
                            mix_schedule=points)  # fmt: skip
        return loader

    trained = build()
    positions = [trained.position.copy()]
    for _ in range(6):
        trained.next_step()
        positions.append(trained.position.copy())
    skipping = build()
    skipping.add_skips([(4, 3)])
    global_steps([skipping], 3)
    stream, schedule_ = skipping.stream, skipping.schedule
    plan = next(plan_steps(stream, schedule_, 0, 3, skipping.position, skipping.skips))
    assert plan.skipped == [[4, 3, positions[3].windows, positions[6].windows]]
    expected, after = stream.advance(positions[6], schedule_.global_batch(3), 3)
    assert [w for m in plan.micro for w in m] == expected
    assert cursors(plan.after) == cursors(after)
    skipping.next_step()
    assert skipping.skipped_windows == {(4, 3): (positions[3].windows, positions[6].windows)}
    assert cursors(skipping.position) == cursors(after)
    _, at_one_weight = stream.advance(positions[3], positions[6].windows - positions[3].windows, 3)
    assert cursors(at_one_weight) != cursors(positions[6])


def cursors(position) -> list:
    return [c.to_list() for c in position.cursors]
