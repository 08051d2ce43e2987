"""Resume cost versus position in the data: seek, don't skip.

    python scripts/bench_resume.py [--size-mb 520] [--shards 120] [--repeats 3] [--smoke] [--json out.json]

1. Builds (once) a large parquet corpus from the bundled text under
   ``outputs/bench_corpus`` (never committed): the bundled documents repeated with new
   ids until the text reaches --size-mb, in --shards files.
2. Makes two dataloader states of a 2-rank job: every virtual shard's cursor at 1% and
   at 99% of its documents, as a checkpoint taken there would hold them (the state is
   a position; reaching 99% by training would take hours on a CPU).
3. Times, in fresh processes, from process start to the first batch after loading
   each state (rank 0 of 2), alternating 1% and 99%, and reports the median of each
   and their ratio (target: 99% / 1% <= 1.3).
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

from torchtitan import REPO_ROOT as REPO

SEQ, BATCH, SHARDS = 2048, 8, 64


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
    base = MapSource(resolve_source(name="bundled"), "text", "id", 0, False).ds
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
    """The rank-0 loader state of a 2-rank job with every shard `fraction` through its documents."""
    from torchtitan.data import ParallelDataLoader, TokenDataset
    from torchtitan.data.sources import resolve_source
    from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    ds = TokenDataset([resolve_source(path=str(corpus))], Tokenizer(DEFAULT_TOKENIZER_PATH), SEQ,
                      dp_rank=0, dp_world=2, data_shards=SHARDS, seed=0)  # fmt: skip
    loader = ParallelDataLoader(ds, BATCH)
    documents = len(ds.sources[0])
    initial = ds.initial_shard_state()
    states, positions = {}, {}
    for v in ds.rank_shards(0):
        shard_size = -(-(documents - v) // SHARDS)
        positions[v] = int(fraction * shard_size)
        source = {**initial["sources"][0], "cursor": {"epoch": 0, "pos": positions[v]}}
        states[v] = {**initial, "sources": [source]}
    loader.seek(states)
    path.write_bytes(pickle.dumps(loader.state_dict()))
    return positions


CHILD = """
import pickle, sys, time, warnings
warnings.filterwarnings("ignore")
from torchtitan.data import ParallelDataLoader, TokenDataset
from torchtitan.data.sources import resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
ds = TokenDataset([resolve_source(path=sys.argv[1])], Tokenizer(DEFAULT_TOKENIZER_PATH), {seq},
                  dp_rank=0, dp_world=2, data_shards={shards}, seed=0)
loader = ParallelDataLoader(ds, {batch})
with open(sys.argv[2], "rb") as f:
    loader.load_state_dict(pickle.load(f))
batch = next(loader)
print("FIRST", batch["spans"][0][0][1], flush=True)
"""


def time_to_first_batch(corpus: Path, state: Path) -> tuple[float, str]:
    code = CHILD.format(seq=SEQ, shards=SHARDS, batch=BATCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, str(corpus), str(state)], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
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
    }
    print(f"{'position':<10}{'median s':>10}   runs")
    for label in ("1%", "99%"):
        print(
            f"{label:<10}{med[label]:>10.2f}   {', '.join(f'{t:.2f}' for t in times[label])}   first doc {docs[label]}"
        )
    print(f"ratio 99% / 1%: {result['ratio_99_over_1']:.3f} (target <= 1.3)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
