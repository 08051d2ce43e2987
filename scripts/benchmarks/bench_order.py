"""The global order at corpus scale: the mix of a step, memory at 10^9 documents, and
streaming throughput side by side with a baseline checkout.

    python scripts/benchmarks/bench_order.py [--baseline-repo DIR] [--rounds 3] [--tokens 2000000]
                                  [--work DIR] [--smoke] [--json out.json]

1. Mix: a streaming parquet corpus of 128 files, one domain each (each file one bundled
   text, 64 documents), read with global batches of 64 sequences of 128 tokens. For
   each of 20 steps, the distinct files the step's windows lie in, counted from every
   rank's plan (``plan_steps``, the loader's own) at 1, 8 and 64 ranks; the median over
   steps, for the whole step and per rank. Control: the same order with one lane (a
   window after the other in one stream, as before).
2. Memory: ``SourceOrder`` over a simulated source of 10^9 documents (10,000 files of
   100,000; ``harness/simulate.py``), walking 2,000 windows of 2,048 tokens from the start
   and 2,000 from a cursor deep in the pass: the peak of Python allocations
   (``tracemalloc``), the units in the order and the units whose counts were asked for.
3. Throughput (``--baseline-repo``: a checkout of the code before the change): the
   streaming loader as training builds and pulls it (``build_dataloader``, bundled
   corpus, seq_len 2048, batch 8, no workers), tokens per second over ``--tokens``
   tokens after the counts are measured (a warm start: the first pass of a never-seen
   corpus also measures each unit once, shared by the ranks), in fresh processes,
   ours and the baseline alternating; medians.
"""

from __future__ import annotations

import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.corpus import write_parquet
from torchtitan import REPO_ROOT as REPO


def one_domain_corpus(folder: Path, files: int, docs: int) -> Path:
    """``files`` parquet files of ``docs`` documents, each file from one bundled text."""
    import pyarrow.parquet as pq

    texts = sorted((REPO / "data" / "corpus").rglob("*.parquet"))
    for f in range(files):
        rows = pq.read_table(texts[f % len(texts)], columns=["text"]).column("text").to_pylist()
        write_parquet(folder / f"domain-{f:03d}.parquet",
                      [{"id": f"f{f}-{i}", "text": f"[domain {f}] " + rows[(f * 7 + i) % len(rows)][:2000]}
                       for i in range(docs)])  # fmt: skip
    return folder


def mix(work: Path, ranks: list[int], steps: int, files: int) -> dict:
    from torchtitan.config import parse_args
    from torchtitan.data import build_stream
    from torchtitan.data.loader import plan_steps
    from torchtitan.data.schedule import BatchSchedule
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    corpus = one_domain_corpus(work / "domains", files, 64)
    cfg = parse_args(["--training.dataset_path", str(corpus), "--training.streaming",
                      "--training.seq_len", "128",
                      "--training.length_index_dir", str(work / "counts")])  # fmt: skip
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    out = {}
    for lanes, label in ((None, "lanes"), (1, "one lane (control)")):
        stream = build_stream(cfg.training, tokenizer)
        if lanes:
            stream.orders[0].lanes = lanes
        for world in ranks:
            schedule = BatchSchedule([(0, 64)], max(1, 64 // world), world)
            gens = [plan_steps(stream, schedule, r, 0, stream.start()) for r in range(world)]
            whole, per_rank = [], []
            for _ in range(steps):
                files_of = []
                for gen in gens:
                    plan = next(gen)
                    files_of.append({p[5][0] for micro in plan.micro for _, pieces in micro
                                     for p in pieces})  # fmt: skip
                whole.append(len(set().union(*files_of)))
                per_rank.append(statistics.median(len(f) for f in files_of))
            out[f"{label}, {world} ranks"] = {
                "files_per_step_median": statistics.median(whole),
                "files_per_step_min": min(whole),
                "files_per_rank_median": statistics.median(per_rank),
            }
    return out


def memory(files: int, rows: int, windows: int) -> dict:
    from harness.simulate import SimulatedCounts, SimulatedSource
    from torchtitan.data.order import Cursor, SourceOrder

    tracemalloc.start()
    begin = time.perf_counter()
    try:
        source, counts = SimulatedSource(files, rows), SimulatedCounts()
        order = SourceOrder(source, counts, 3, "s", shuffle=True)
        cursor = Cursor()
        for _ in range(windows):
            order.fill(cursor, 2049)
        units = len(order.units(files))
        deep = Cursor(extent=files, taken=units - 64,
                      lanes=[[s, units - 96 + s, 5] for s in range(32)])  # fmt: skip
        for _ in range(windows):
            order.fill(deep, 2049)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"documents": files * rows, "units": units, "units_asked": counts.measured,
            "peak_mb": peak / 2**20, "seconds": time.perf_counter() - begin}  # fmt: skip


RATE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
cfg = parse_args(["--training.streaming", "--training.seq_len", "2048",
                  "--training.batch_size", "8", "--training.length_index_dir", args["counts"]])
tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
loader = build_dataloader(cfg, tokenizer, 0, 1)
stream = loader.stream
if hasattr(stream.orders[0], "pass_tokens"):
    for order in stream.orders:
        order.pass_tokens()  # the counts measured before the timing (a warm start)
for _ in range(2):
    next(loader)
begin, tokens = time.perf_counter(), 0
while tokens < args["tokens"]:
    tokens += next(loader)["input"].numel()
print("RESULT", json.dumps({"tokens_per_s": tokens / (time.perf_counter() - begin)}))
"""


def rate(repo: str, counts: Path, tokens: int) -> float:
    """Tokens/s of the streaming loader of the checkout ``repo``, in a fresh process."""
    args = {"repo": repo, "counts": str(counts), "tokens": tokens}
    return bench.run_program(RATE, args, cwd=repo, timeout=1800, what=f"the loader of {repo}")[
        "tokens_per_s"
    ]


def throughput(work: Path, baseline: str, rounds: int, tokens: int) -> dict:
    sides = {"ours": str(REPO)} | ({"baseline": baseline} if baseline else {})
    got = {side: [] for side in sides}
    for side, repo in sides.items():  # untimed: each side's counts measured once
        rate(repo, work / f"counts-{side}", 10_000)
    for _ in range(rounds):
        for side, repo in sides.items():
            got[side].append(rate(repo, work / f"counts-{side}", tokens))
    out = {side: {"runs": v, "median": statistics.median(v)} for side, v in got.items()}
    if baseline:
        out["ours_over_baseline"] = out["ours"]["median"] / out["baseline"]["median"]
    return out


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={}, rounds=3, work="")
    p.add_argument("--baseline-repo", default="", help="a checkout of the code before")
    p.add_argument("--tokens", type=int, default=2_000_000)
    args = p.parse(argv)
    with bench.work_folder(args, "bench_order_") as work:
        if args.smoke:
            result = {"mix": mix(work, [1, 2], 3, 16), "memory": memory(100, 5000, 50),
                      "throughput": throughput(work, "", 1, 20_000)}  # fmt: skip
        else:
            result = {"mix": mix(work, [1, 8, 64], 20, 128),
                      "memory": memory(10_000, 100_000, 2000),
                      "throughput": throughput(work, args.baseline_repo, args.rounds,
                                               args.tokens)}  # fmt: skip
    bench.print_table(["order", "files a step (median, min)", "files a rank's slice (median)"],
                      [[name, f"**{row['files_per_step_median']:g}**, {row['files_per_step_min']}",
                        f"{row['files_per_rank_median']:g}"]
                       for name, row in result["mix"].items()])  # fmt: skip
    m = result["memory"]
    print(
        f"\nmemory: {m['documents']:,} documents, {m['units']:,} units, counts of "
        f"{m['units_asked']:,} asked for; peak **{m['peak_mb']:.1f} MB** ({m['seconds']:.1f} s)"
    )
    t = result["throughput"]
    print("\nstreaming tokens/s: " + "; ".join(
        f"{side} {v['median']:,.0f} ({', '.join(f'{x:,.0f}' for x in v['runs'])})"
        for side, v in t.items() if isinstance(v, dict)))  # fmt: skip
    if "ours_over_baseline" in t:
        print(f"ours / baseline: **{t['ours_over_baseline']:.3f}** (target >= 0.9)")
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
