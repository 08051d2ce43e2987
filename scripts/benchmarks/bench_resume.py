"""Resume cost versus position in the data: seek, don't skip.

    python scripts/benchmarks/bench_resume.py [--size-mb 520] [--shards 120] [--rounds 3]
        [--work DIR] [--smoke] [--json out.json]

1. Builds (once) a large parquet corpus from the bundled text under --work (default
   ``outputs/bench_corpus``, never committed): the bundled documents repeated with new
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

import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.corpus import built_once, bundled_documents, repeated, write_parquet_files
from torchtitan import REPO_ROOT as REPO

SEQ, BATCH = 2048, 8


def build_corpus(folder: Path, size_mb: int, shards: int) -> dict:
    """The bundled documents repeated with new ids to ``size_mb`` of text, in ``shards``
    files (zstd, 256-row groups) under ``folder``; built once per size."""

    def build(out: Path) -> dict:
        docs = repeated(bundled_documents(), size_mb)
        write_parquet_files(out, docs, shards, row_group=256, compression="zstd")
        text_bytes = sum(len(d["text"].encode()) for d in docs)
        print(f"built {out}: {len(docs):,} documents, {text_bytes / 2**20:.0f} MB of text, "
              f"{shards} shards")  # fmt: skip
        return {"documents": len(docs), "text_bytes": text_bytes}

    return built_once(folder, f"{size_mb}MB-{shards}", build)


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
    p = bench.Arguments(__doc__, smoke={"size_mb": 2, "shards": 4, "rounds": 1}, rounds=3,
                        work=str(REPO / "outputs" / "bench_corpus"))  # fmt: skip
    p.add_argument("--size-mb", type=int, default=520)
    p.add_argument("--shards", type=int, default=120)
    args = p.parse(argv)
    work = Path(args.work) if not args.smoke else Path(args.work + "_smoke")
    folder = work / "corpus"
    built = build_corpus(folder, args.size_mb, args.shards)
    index = build_index(folder)
    states = {}
    for label, fraction in (("1%", 0.01), ("99%", 0.99)):
        states[label] = work / f"state-{label[:-1]}.pkl"
        make_state(folder, fraction, states[label])
    if not args.smoke:
        time_to_first_batch(folder, states["1%"])  # warm the page cache and the datasets cache
    times = {"1%": [], "99%": []}
    docs = {}
    for _ in range(args.rounds):
        for label in ("1%", "99%"):
            elapsed, docs[label] = time_to_first_batch(folder, states[label])
            times[label].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "corpus": built | {"shards": args.shards},
        "seconds_to_first_batch": times,
        "median_1pct_s": med["1%"],
        "median_99pct_s": med["99%"],
        "ratio_99_over_1": med["99%"] / med["1%"],
        "first_document": docs,
        "length_index": index,
    }
    bench.print_table(["position", "median s", "runs", "first document"],
                      [[label, f"{med[label]:.2f}", ", ".join(f"{t:.2f}" for t in times[label]),
                        docs[label]] for label in ("1%", "99%")])  # fmt: skip
    print(f"\nratio 99% / 1%: {result['ratio_99_over_1']:.3f} (target <= 1.3)")
    how = "read from the cache" if index["was_cached"] else "measured (first start)"
    print(f"length index of {index['documents']:,} documents: {index['seconds']:.2f} s, {how}")
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
