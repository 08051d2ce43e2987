"""Sampling quality of the global order: coverage, mix shares, balance after a resume.

    python scripts/benchmarks/bench_sampling.py [--seq-len 128] [--mix-sequences 10000]
        [--work DIR] [--smoke] [--json out.json]

Over a heavy-tailed corpus shaped like the one of issue #20 (1,094 documents of 81 to
20,362 tokens, median 681), cut as token slices from the bundled text and written as
JSON lines in a temporary folder (its measured lengths are printed), it reports:

1. Coverage at first repeat: the share of the corpus's tokens read (pass 0) when a
   document is first read again, in global order (step, then rank, then sequence),
   and whether passes 0 and 1 are each read exactly once (every document, its tokens
   tiled with no gap or overlap). The job is resumed on a rank count that does not
   divide the first one halfway through pass 0. With 2 ranks (then 3) the windows are
   read through the real loaders (``build_dataloader`` per rank, their spans), and
   the loader state moves between them; with 64 (then 63) and 1,024 (then 1,016) each
   rank's windows come from the loader's own planning (``plan_steps``): token ranges of
   units, no token read. The 2-rank run is also simulated that way, and the two must
   agree (each window's source, pass and tokens).
2. Mix shares: the corpus at 0.9 with a 40-document source at 0.1, and a 3-source mix;
   each source's share of the tokens of the first ``--mix-sequences`` sequences
   (real loaders, 2 ranks) against its weight, and whether every pass of a source that
   was read through was read exactly once (the large source's first one included).
3. Work imbalance after a non-divisor resume (2 -> 3, 64 -> 63, 1,024 -> 1,016 ranks,
   global batches of 8 and 2 sequences per rank of the first layout): the busiest
   rank's sequences over the mean per step, counted from ``plan_steps``, against
   ``BatchSchedule.imbalance``; the micro-batches per rank before and after; and how
   long one rank takes to plan a step at 1,024 ranks (arithmetic only).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import NormalDist

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan
import datasets
import numpy as np

from harness import bench
from harness.corpus import write_jsonl
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader, build_stream, local_plan
from torchtitan.data.loader import plan_steps
from torchtitan.data.schedule import BatchSchedule
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchtitan.tools.launch import DEBUG_CONFIG

# Quoted from issue #20 for the design before the global order (not re-measured here).
BEFORE = {
    "coverage": "8.4 % (equal-rate virtual shards: short shards ran out and repeated)",
    "mix": "24 of 64 virtual shards held no unit of the small source and were skipped, "
    "with their share of the large one",
}


# ---- the corpus ---------------------------------------------------------------------------
def heavy_tailed_lengths(count: int, low: int, median: int, high: int, seed: int) -> np.ndarray:
    """``count`` token lengths, log-normal on each side of ``median``, whose extreme
    quantiles are exactly ``low`` and ``high``, in a seeded random order."""
    normal = NormalDist()
    z = np.array([normal.inv_cdf((i + 0.5) / count) for i in range(count)])
    edge = normal.inv_cdf(1 - 0.5 / count)
    scale = np.where(z > 0, np.log(high / median), np.log(median / low)) / edge
    lengths = np.rint(median * np.exp(z * scale)).astype(np.int64)
    return np.random.default_rng(seed).permutation(lengths)


def bundled_tokens(tokenizer, chars: int) -> np.ndarray:
    """The first ``chars`` characters of the bundled corpus, tokenized."""
    from torchtitan.data.sources import resolve_source

    texts = []
    for name in ("shakespeare", "kjv", "milton"):
        files = resolve_source(name=name).files
        texts += datasets.load_dataset("parquet", data_files=files, split="train")["text"]
    text = "\n".join(texts)[:chars]
    pieces = [text[i : i + 100_000] for i in range(0, len(text), 100_000)]
    return np.concatenate([np.array(ids) for ids in tokenizer.encode_batch(pieces)])


def write_documents(folder: Path, prefix: str, lengths, tokens, tokenizer, seed: int,
                    files: int = 3) -> Path:  # fmt: skip
    """Documents of about ``lengths`` tokens (BOS and EOS included) cut from ``tokens`` at
    seeded places, as JSON lines in ``files`` files; returns the folder."""
    rng = np.random.default_rng(seed)
    docs = []
    for i, n in enumerate(lengths):
        start = int(rng.integers(0, len(tokens) - n))
        text = tokenizer.decode(tokens[start : start + max(1, int(n) - 2)])
        docs.append({"id": f"{prefix}{i:05d}", "text": text})
    return write_jsonl(folder, docs, files)


# ---- what a run read ----------------------------------------------------------------------
def config(work: Path, seq_len: int, global_batch: int, micro: int, *, path: str = "",
           mix: str = ""):  # fmt: skip
    argv = ["--job.config_file", DEBUG_CONFIG, "--training.seq_len", seq_len,
            "--training.global_batch_size", global_batch, "--training.batch_size", micro,
            "--training.length_index_dir", work / "length_index"]  # fmt: skip
    argv += ["--training.datasets", mix] if mix else ["--training.dataset_path", path]
    return parse_args([str(a) for a in argv])


def window_spans(stream, source: int, pieces: list) -> list[tuple]:
    """``(source, unit, start, end, pass)`` of the pieces of a planned window: token
    ranges of units, from the counts alone (``TokenStream.window`` without the tokens)."""
    return [(source, u, lo, hi, pass_) for pass_, _, u, lo, hi, _ in pieces]


def simulate(stream, layouts: list[tuple[BatchSchedule, int]]) -> list[list[list[tuple]]]:
    """Each step's windows, ranks in order, as ``window_spans``: ``layouts`` is a list of
    (schedule, steps) run one after the other, each from where the last one stopped,
    every rank planned by ``plan_steps`` (nothing read)."""
    steps_out, step, position = [], 0, stream.start()
    for schedule, steps in layouts:
        per_rank = []
        for rank in range(schedule.dp_world):
            plans = list(
                itertools.islice(plan_steps(stream, schedule, rank, step, position), steps)
            )
            per_rank.append([[w for micro in p.micro for w in micro] for p in plans])
        for s in range(steps):
            steps_out.append([window_spans(stream, *w) for rank in per_rank for w in rank[s]])
        step, position = step + steps, plans[-1].after
    return steps_out


def read_steps(ranks: list, steps: int, names: list[str], ids: set) -> list[list[list[tuple]]]:
    """Each step's sequences over all ``ranks`` (real loaders), as ``window_spans``; the
    document ids they read are added to ``ids``."""
    out = []
    for _ in range(steps):
        step = []
        for loader in ranks:
            for batch in loader.next_step():
                for spans in batch["spans"]:
                    step.append([(names.index(s[0]), s[1], s[2], s[3], s[4]) for s in spans])
                    ids.update((s[0], s[1], s[4]) for s in spans)
        out.append(step)
    return out


def coverage_at_first_repeat(steps, stream, source: int = 0) -> float | None:
    """The share of ``source``'s tokens read in its pass 0 when one of its documents is
    first read again, in global order; None if none is."""
    read = 0
    for step in steps:
        for window in step:
            for s, _, start, end, epoch in window:
                if s != source:
                    continue
                if epoch > 0:
                    return read / stream.orders[source].pass_tokens()
                read += end - start
    return None


def passes_read_exactly_once(steps, stream) -> dict[str, list[int]]:
    """Per source, the passes read through in which every token was read once: each
    document's (read) or unit's (planned) ranges follow one another from 0 with no gap or
    overlap, and the pass's tokens add up to the source's (so nothing is left out).
    Raises AssertionError naming the first place where that fails."""
    covered = defaultdict(list)
    tokens = defaultdict(int)
    for step in steps:
        for window in step:
            for s, key, start, end, epoch in window:
                covered[(s, epoch, key)].append((start, end))
                tokens[(s, epoch)] += end - start
    for (s, epoch, key), spans in covered.items():
        spans = sorted(spans)
        starts, ends = [a for a, _ in spans], [b for _, b in spans]
        assert starts == [0, *ends[:-1]], f"{stream.names[s]} pass {epoch} {key}: {spans}"
    out = {}
    for s, order in enumerate(stream.orders):
        total = order.pass_tokens()
        done = [e for (src, e), n in sorted(tokens.items()) if src == s and (s, e + 1) in tokens]
        for epoch in done:
            assert tokens[(s, epoch)] == total, f"{order.name} pass {epoch}: not every token"
        out[stream.names[s]] = done
    return out


def units_of(steps, stream) -> list[list[tuple]]:
    """Per window, the (source, pass) of each piece and its tokens: what a planned and a
    read run can be compared by (one has units, the other documents)."""
    return [[(w[0][0], w[0][4], sum(b - a for _, _, a, b, _ in w))] for step in steps
            for w in step]  # fmt: skip


def plain(steps) -> list[tuple]:
    return [piece for step in steps for window in step for piece in window]


# ---- 1. coverage --------------------------------------------------------------------------
def steps_for(stream, global_batch: int) -> tuple[int, int]:
    """(steps until passes 0 and 1 are read through, the resume step halfway into pass 0)."""
    tokens, per_step = stream.orders[0].pass_tokens(), global_batch * stream.window_size
    return -(-2 * tokens // per_step), max(1, tokens // per_step // 2)


def coverage_read(work: Path, corpus: Path, tokenizer, seq_len: int, before: int, after: int,
                  per_rank: int) -> dict:  # fmt: skip
    """Real loaders: ``before`` ranks to halfway through pass 0, their state loaded into
    ``after`` ranks, on past pass 1; and the same run planned without reading."""
    g = per_rank * before
    cfg = config(work, seq_len, g, per_rank, path=str(corpus))
    begin = time.perf_counter()
    plan = local_plan(cfg.training, tokenizer)
    index_s = time.perf_counter() - begin
    stream = build_stream(cfg.training, tokenizer, plan)
    steps, resume = steps_for(stream, g)
    ids: set = set()
    begin = time.perf_counter()
    first = [build_dataloader(cfg, tokenizer, r, before, plan) for r in range(before)]
    read = read_steps(first, resume, stream.names, ids)
    state = first[0].state_dict()
    second = [build_dataloader(cfg, tokenizer, r, after, plan) for r in range(after)]
    for loader in second:
        loader.load_state_dict(state)
    read += read_steps(second, steps - resume, stream.names, ids)
    read_s = time.perf_counter() - begin
    planned = simulate(stream, [(BatchSchedule([(0, g)], per_rank, before), resume),
                                (BatchSchedule([(0, g)], per_rank, after), steps - resume)])  # fmt: skip
    pass0_ids = {doc for _, doc, epoch in ids if epoch == 0}
    tokens = sum(b - a for *_, a, b, _ in plain(read))
    return {"ranks": f"{before} -> {after}", "how": "read (real loaders)", "global_batch": g,
            "steps": steps, "resume_step": resume, "coverage": coverage_at_first_repeat(read, stream),
            "exactly_once": passes_read_exactly_once(read, stream),
            "documents_read_pass0": len(pass0_ids), "planned_equals_read": units_of(planned, stream) == units_of(read, stream),
            "index_s": index_s, "read_s": read_s, "tokens_per_s": tokens / read_s}  # fmt: skip


def coverage_planned(stream, before: int, after: int, per_rank: int) -> dict:
    g = per_rank * before
    steps, resume = steps_for(stream, g)
    begin = time.perf_counter()
    planned = simulate(stream, [(BatchSchedule([(0, g)], per_rank, before), resume),
                                (BatchSchedule([(0, g)], per_rank, after), steps - resume)])  # fmt: skip
    return {"ranks": f"{before:,} -> {after:,}", "how": "planned (plan_steps + locate)",
            "global_batch": g, "steps": steps, "resume_step": resume,
            "coverage": coverage_at_first_repeat(planned, stream),
            "exactly_once": passes_read_exactly_once(planned, stream),
            "simulate_s": time.perf_counter() - begin}  # fmt: skip


# ---- 2. mix shares ------------------------------------------------------------------------
def mix_shares(work: Path, mix: list[tuple[Path, float]], tokenizer, seq_len: int,
               sequences: int, through_first: bool) -> dict:  # fmt: skip
    """Two real loaders over ``mix``: the token shares of the first ``sequences``
    sequences, and (``through_first``) on until the first source's pass 0 is read."""
    g = 16
    cfg = config(work, seq_len, g, 8, mix=",".join(f"{p}:{w}" for p, w in mix))
    plan = local_plan(cfg.training, tokenizer)
    ranks = [build_dataloader(cfg, tokenizer, r, 2, plan) for r in range(2)]
    stream = ranks[0].stream
    assert sequences % g == 0, f"--mix-sequences must be a multiple of {g}"
    read = read_steps(ranks, sequences // g, stream.names, set())
    by_source = ranks[0].tokens_by_source()
    counted, windows = defaultdict(int), defaultdict(int)
    for s, _, a, b, _ in plain(read):
        counted[stream.names[s]] += b - a
    for window in (w for step in read for w in step):
        windows[stream.names[window[0][0]]] += 1
    assert dict(counted) == by_source, (dict(counted), by_source)
    while through_first and ranks[0].position.cursors[0].pass_ < 1:
        read += read_steps(ranks, 1, stream.names, set())
    total, weights = sum(by_source.values()), sum(w for _, w in mix)
    return {"mix": " + ".join(f"{n} {w:g}" for n, (_, w) in zip(stream.names, mix)),
            "sequences": sequences,
            "sources": [{"name": n, "weight": w / weights, "share": by_source[n] / total,
                         "sequences": windows[n],
                         "units": len(o.units(o.source.extent())),
                         "tokens_per_pass": o.pass_tokens()}
                        for n, (_, w), o in zip(stream.names, mix, stream.orders)],
            "coverage": {n: coverage_at_first_repeat(read, stream, s)
                         for s, n in enumerate(stream.names)},
            "exactly_once": passes_read_exactly_once(read, stream)}  # fmt: skip


# ---- 3. imbalance after a resume ----------------------------------------------------------
class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def imbalance(stream, before: int, after: int, per_rank: int, resume_step: int = 3) -> dict:
    """Sequences per rank of the first step after resuming ``before`` ranks' job on
    ``after``, counted from each rank's ``plan_steps``; and the time to plan a step."""
    g = per_rank * before
    old = BatchSchedule([(0, g)], per_rank, before)
    said, log = Said(), logging.getLogger("torchtitan.data.schedule")
    log.addHandler(said)
    try:
        new = BatchSchedule([(0, g)], per_rank, after)
    finally:
        log.removeHandler(said)
    position = stream.position_after(resume_step * g)
    counts = []
    for rank in range(after):
        plan = next(plan_steps(stream, new, rank, resume_step, position))
        counts.append(sum(len(m) for m in plan.micro))
    mean = g / after
    mine = plan_steps(stream, new, after // 2, resume_step, position)
    times = []
    for _ in range(30):
        begin = time.perf_counter()
        next(mine)
        times.append(time.perf_counter() - begin)
    return {"ranks": f"{before:,} -> {after:,}", "global_batch": g, "per_rank_before": per_rank,
            "sequences_min": min(counts), "sequences_max": max(counts), "mean": mean,
            "max_over_mean": max(counts) / mean, "schedule_imbalance": new.imbalance(g),
            "sum": sum(counts), "micro_before": old.accumulation(g),
            "micro_after": new.accumulation(g), "warned": bool(said.messages),
            "plan_ms_per_step": statistics.median(times) * 1e3}  # fmt: skip


# ---- the report ---------------------------------------------------------------------------
def pct(x: float | None) -> str:
    return "no repeat yet" if x is None else f"{100 * x:.2f} %"


def print_report(r: dict):
    c = r["corpus"]
    print(f"\ncorpus: {c['documents']:,} documents, {c['tokens']:,} tokens; document tokens "
          f"min {c['min']:,}, median {c['median']:,.0f}, max {c['max']:,} (p90 {c['p90']:,.0f}); "
          f"seq_len {r['seq_len']}\n")  # fmt: skip
    print("| ranks (resumed halfway into pass 0) | how | global batch | steps | coverage at "
          "first repeat | passes read exactly once |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in r["coverage"]:
        once = ", ".join(str(p) for p in row["exactly_once"]["heavy"])
        extra = "; planned = read" if row.get("planned_equals_read") else ""
        print(f"| {row['ranks']} | {row['how']}{extra} | {row['global_batch']:,} | "
              f"{row['steps']:,} | **{pct(row['coverage'])}** | {once} |")  # fmt: skip
    read, planned = r["coverage"][0], r["coverage"][1:]
    print(f"\n{read['ranks']} ranks: length index measured in {read['index_s']:.1f} s, "
          f"{read['tokens_per_s']:,.0f} tokens/s read, {read['documents_read_pass0']:,} "
          "documents in pass 0; planning the other layouts and locating their windows: "
          + ", ".join(f"{row['ranks']} {row['simulate_s']:.2f} s" for row in planned))  # fmt: skip
    print(f"before (issue #20, not re-measured): {BEFORE['coverage']}\n")
    print("| mix | source | units | weight | sequences | token share | share - weight | "
          "coverage at first repeat | passes read exactly once |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for m in r["mix"]:
        for s in m["sources"]:
            once = m["exactly_once"][s["name"]]
            passes = f"0-{once[-1]}" if len(once) > 2 else ", ".join(map(str, once)) or "none yet"
            print(f"| {m['mix']} | {s['name']} | {s['units']:,} | {s['weight']:.3f} | "
                  f"{s['sequences']:,} | {s['share']:.5f} | {s['share'] - s['weight']:+.5f} | "
                  f"{pct(m['coverage'][s['name']])} | {passes} |")  # fmt: skip
    print(f"\nshares over the first {r['mix'][0]['sequences']:,} sequences; before (issue #20, "
          f"not re-measured): {BEFORE['mix']}\n")  # fmt: skip
    print(
        "| resume | global batch | sequences per rank (min-max) | mean | max / mean | "
        "BatchSchedule.imbalance | micro-batches per rank | warned | plan a step, ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in r["imbalance"]:
        print(f"| {row['ranks']} | {row['global_batch']:,} ({row['per_rank_before']} a rank) | "
              f"{row['sequences_min']}-{row['sequences_max']} | {row['mean']:.3f} | "
              f"**{row['max_over_mean']:.3f}** | {row['schedule_imbalance']:.3f} | "
              f"{row['micro_before']} -> {row['micro_after']} | "
              f"{'yes' if row['warned'] else 'no'} | {row['plan_ms_per_step']:.3f} |")  # fmt: skip


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"seq_len": 32, "mix_sequences": 400}, work="")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--mix-sequences", type=int, default=10_000)
    args = p.parse(argv)
    shape = dict(count=1094, low=81, median=681, high=20362)
    layouts, text_chars = [(2, 3), (64, 63), (1024, 1016)], 4_000_000
    if args.smoke:
        # a corpus of 120 short documents, 2 -> 3 read and 16 -> 15 planned
        shape, text_chars = dict(count=120, low=20, median=120, high=2000), 300_000
        layouts = [(2, 3), (16, 15)]
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    with bench.work_folder(args, "bench_sampling_") as work:
        tokens = bundled_tokens(tokenizer, text_chars)
        heavy = write_documents(work / "heavy", "h", heavy_tailed_lengths(**shape, seed=0),
                                tokens, tokenizer, seed=1)  # fmt: skip
        few = write_documents(work / "few", "f", heavy_tailed_lengths(40, 20, 80, 400, 2),
                              tokens, tokenizer, seed=3, files=1)  # fmt: skip
        verses = write_documents(work / "verses", "v", np.random.default_rng(4).integers(50, 500, 300),
                                 tokens, tokenizer, seed=5, files=2)  # fmt: skip
        rows = [coverage_read(work, heavy, tokenizer, args.seq_len, *layouts[0], per_rank=8)]
        stream = build_stream(
            config(work, args.seq_len, 16, 8, path=str(heavy)).training, tokenizer
        )
        rows += [coverage_planned(stream, a, b, 8) for a, b in layouts[1:]]
        order = stream.orders[0]
        lengths = np.concatenate([order.counts.counts(tuple(int(x) for x in u)).lengths
                                  for u in order.units(order.source.extent())])  # fmt: skip
        mixes = [mix_shares(work, [(heavy, 0.9), (few, 0.1)], tokenizer, args.seq_len,
                            args.mix_sequences, through_first=True),
                 mix_shares(work, [(heavy, 0.5), (verses, 0.3), (few, 0.2)], tokenizer,
                            args.seq_len, args.mix_sequences, through_first=False)]  # fmt: skip
        balance = [imbalance(stream, a, b, per) for a, b in layouts for per in (8, 2)]
    result = {
        "corpus": {"documents": len(lengths), "tokens": int(lengths.sum()),
                   "min": int(lengths.min()), "median": float(np.median(lengths)),
                   "max": int(lengths.max()), "p90": float(np.percentile(lengths, 90))},
        "seq_len": args.seq_len, "coverage": rows, "mix": mixes, "imbalance": balance,
        "before_issue_20": BEFORE, "smoke": args.smoke,
    }  # fmt: skip
    print_report(result)
    return bench.save(args, result)


if __name__ == "__main__":
    datasets.disable_progress_bars()
    sys.exit(main())
