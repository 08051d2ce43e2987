"""Resume cost versus position in the data: seek, don't skip.

    python scripts/benchmarks/bench_resume.py [--size-mb 520] [--shards 120] [--repeats 3] [--smoke] [--json out.json]

1. Builds (once) a large parquet corpus from the bundled text under
   ``outputs/bench_corpus`` (never committed): the bundled documents repeated with new
   ids until the text reaches --size-mb, in --shards files.
2. Builds the corpus's length index (once per corpus and tokenizer, cached under
   $TORCHTITAN_CACHE), as the first start of a job on it would.
3. Makes two dataloader states of a 2-rank job: the global position (windows taken,
   token offset) at 1% and at 99% of the epoch, as a checkpoint taken there would hold
   it (``loader.seek(Position)``, then ``state_dict``; reaching 99% by training would
   take hours on a CPU).
4. Times, in fresh processes, from process start to the first batch after loading
   each state (rank 0 of 2, built from a config as train.py builds it: the data plan,
   the cached index, the loader), alternating 1% and 99%, and reports the median of
   each and their ratio (target: 99% / 1% <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from torchtitan import REPO_ROOT as REPO

SEQ, BATCH = 2048, 8


def build_corpus(out: Path, size_mb: int, shards: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan.data.sources import MapSource, resolve_source

    marker = out / f"DONE-{size_mb}MB-{shards}"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.parquet"):
        old.unlink()
    base = MapSource(resolve_source(name="bundled"), "text", "id").ds
    ids, texts = list(base["id"]), list(base["text"])
    per_copy = sum(len(t.encode()) for t in texts)
    copies = -(-size_mb * 2**20 // per_copy)
    rows = [(f"copy{c}/{i}", t) for c in range(copies) for i, t in zip(ids, texts)]
    per_shard = -(-len(rows) // shards)
    for s in range(shards):
        chunk = rows[s * per_shard : (s + 1) * per_shard]
        table = pa.table({"id": [r[0] for r in chunk], "text": [r[1] for r in chunk]})
        pq.write_table(table, out / f"part-{s:05d}.parquet", compression="zstd", row_group_size=256)
    marker.write_text(json.dumps({"documents": len(rows), "text_bytes": per_copy * copies}))
    print(
        f"built {out}: {len(rows):,} documents, {per_copy * copies / 2**20:.0f} MB of text, {shards} shards"
    )
    return out


def make_state(corpus: Path, fraction: float, path: Path):
    """The rank-0 loader state of a 2-rank job ``fraction`` of the way through the epoch;
    the first build measures (and caches) the corpus's length index."""
    from torchtitan.config import parse_args
    from torchtitan.data import build_dataloader
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    cfg = parse_args(config_argv(corpus))
    loader = build_dataloader(cfg, Tokenizer(DEFAULT_TOKENIZER_PATH), 0, 2)
    stream = loader.stream
    windows = int(fraction * stream.orders[0].pass_tokens()) // stream.window_size
    loader.seek(stream.position_after(windows))
    path.write_bytes(pickle.dumps(loader.state_dict()))
    return windows


def build_index(corpus: Path) -> dict:
    """Seconds to every unit's token counts in this process (``pass_tokens``): measured on
    a corpus's first start (every document tokenized once, O(documents)), else read from
    the folder. Training measures only the units it reaches; this is the whole corpus."""
    from torchtitan.config import parse_args
    from torchtitan.data import build_stream
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    t, tokenizer = parse_args(config_argv(corpus)).training, Tokenizer(DEFAULT_TOKENIZER_PATH)
    start = time.perf_counter()
    order = build_stream(t, tokenizer).orders[0]
    order.pass_tokens()
    seconds = time.perf_counter() - start
    units = order.units(order.source.extent())
    documents = sum(int(hi - lo) for _, lo, hi in units)
    return {"seconds": seconds, "was_cached": order.counts.measured == 0, "documents": documents}


def config_argv(corpus: Path) -> list[str]:
    return ["--training.dataset_path", str(corpus), "--training.seq_len", str(SEQ),
            "--training.batch_size", str(BATCH), "--training.seed", "0"]  # fmt: skip


CHILD = """
import pickle, sys, time, warnings
warnings.filterwarnings("ignore")
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
cfg = parse_args(sys.argv[3:])
loader = build_dataloader(cfg, Tokenizer(DEFAULT_TOKENIZER_PATH), 0, 2)
with open(sys.argv[2], "rb") as f:
    loader.load_state_dict(pickle.load(f))
batch = next(loader)
print("FIRST", batch["spans"][0][0][1], flush=True)
"""


def time_to_first_batch(corpus: Path, state: Path) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", CHILD, str(corpus), str(state), *config_argv(corpus)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return elapsed, proc.stdout.split("FIRST", 1)[1].strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=int, default=520)
    p.add_argument("--shards", type=int, default=120)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--corpus", default=str(REPO / "outputs" / "bench_corpus"))
    p.add_argument("--smoke", action="store_true", help="a 2 MB corpus in 4 shards, 1 repeat")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mb, args.shards, args.repeats = 2, 4, 1
        args.corpus = args.corpus + "_smoke"
    corpus = build_corpus(Path(args.corpus), args.size_mb, args.shards)
    index = build_index(corpus)
    states = {}
    for label, fraction in (("1%", 0.01), ("99%", 0.99)):
        states[label] = Path(args.corpus) / f"state-{label[:-1]}.pkl"
        make_state(corpus, fraction, states[label])
    if not args.smoke:
        time_to_first_batch(corpus, states["1%"])  # warm the page cache and the datasets cache
    times = {"1%": [], "99%": []}
    docs = {}
    for _ in range(args.repeats):
        for label in ("1%", "99%"):
            elapsed, docs[label] = time_to_first_batch(corpus, states[label])
            times[label].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "corpus": json.loads(next(Path(args.corpus).glob("DONE-*")).read_text())
        | {"shards": args.shards},
        "seconds_to_first_batch": times,
        "median_1pct_s": med["1%"],
        "median_99pct_s": med["99%"],
        "ratio_99_over_1": med["99%"] / med["1%"],
        "first_document": docs,
        "length_index": index,
    }
    print(f"{'position':<10}{'median s':>10}   runs")
    for label in ("1%", "99%"):
        print(
            f"{label:<10}{med[label]:>10.2f}   {', '.join(f'{t:.2f}' for t in times[label])}   first doc {docs[label]}"
        )
    print(f"ratio 99% / 1%: {result['ratio_99_over_1']:.3f} (target <= 1.3)")
    how = "read from the cache" if index["was_cached"] else "measured (first start)"
    print(f"length index of {index['documents']:,} documents: {index['seconds']:.2f} s, {how}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
