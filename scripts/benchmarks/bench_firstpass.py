"""The first pass over a never-seen corpus: throughput, memory and the first batch, side by
side with torchtitan 0.3.0's loader, and against this project's own warm loader.

    python scripts/benchmarks/bench_firstpass.py [--peer-python /path/to/venv/bin/python]
        [--mb 80] [--row-group 1024] [--batches 300] [--rounds 3] [--workers 0,2]
        [--before OTHER_CHECKOUT] [--work DIR] [--smoke] [--json out.json]

Corpus, built once under --work: 16 parquet files holding --mb MB of text in row groups of
--row-group rows (1,024: a web corpus's layout, cut into units of 256 rows), the bundled
texts (Shakespeare, Milton, KJV), each document headed by its file and row so that no two
are the same. Never seen: every cold run gets a fresh, empty ``training.length_index_dir``.

Every figure is one fresh process, launched by this script and timed from its launch (the
interpreter's start and imports included), reading the corpus as training pulls it: ours
is ``build_dataloader`` from a config, as ``train.py`` builds it (rank 0 of 1, streaming,
seq_len 2048, batch 8, --workers); the peer is 0.3.0's ``HuggingFaceTextDataset`` in its
``ParallelAwareDataloader`` over ``load_dataset("parquet", ..., streaming=True)`` and the
same SentencePiece model (bench_streaming.py's adapter). Per run:

- **first batch**: seconds from the launch to the first batch;
- **300 batches**: tokens/s over the --batches batches after the first;
- **first pass**: tokens/s from the first batch to the end of the pass (ours: the step
  in which the second pass begins; the peer: its iterator's end, ``infinite=False``);
- **memory**: resident memory (MiB) after the first batch, after the --batches more and
  at the peak over the pass, of the loader's processes (with workers, the sum of their
  proportional set sizes, so that pages shared since the fork count once);
- **tokenized / read** (ours, 0 workers): tokens the tokenizer produced in the process
  over tokens the batches hold (1.0: each document tokenized once).

Rows: ours cold (a fresh index folder), ours warm (the counts measured by the cold run;
its leftover token sidecars deleted, so every document is read and tokenized once, what a
pass after the first costs), the peer; at 0 and 2 workers. Then the map-style first
batch: ours (``training.streaming false``, a fresh index folder, ``datasets``' own Arrow
cache of the corpus warmed once before, as bench_coldstart.py does) against the peer's
map-style loader (``streaming=False``, the same warmed cache). Rounds interleave every
row; the figures are medians. Targets (#39): cold first pass >= 0.95 x warm at 0 and 2
workers; cold first pass >= the peer's; memory after the batches within 10 % of that
after the first; cold peak <= the peer's; map-style first batch <= 1.2 x the peer's;
with ``--before`` (a checkout of the code before #39), warm >= 0.95 x the code before's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan
from bench_coldstart import DOMAINS, bundled_texts, file_documents
from bench_streaming import PEER_SETUP

from harness import bench
from harness.corpus import built_once, write_parquet
from torchtitan import REPO_ROOT as REPO

SEQ, BATCH, FILES = 2048, 8, 16
TOKENIZER = str(REPO / "data" / "tokenizer" / "tokenizer.model")

# What both sides' programs share: the memory of this process and its children.
MEMORY = r"""
import os

def _pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return 0.0

def _children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out

def memory():
    pids, i = [os.getpid()], 0
    while i < len(pids):
        pids += _children(pids[i])
        i += 1
    return sum(_pss(p) for p in pids)
"""

OURS = (
    MEMORY
    + r"""
import json, sys, time
args = json.loads(sys.argv[1])
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader, packing
from torchtitan.data.tokenizer import Tokenizer
tokenized = [0]
real = packing.encode_document
def counting(tokenizer, text):
    ids = real(tokenizer, text)
    tokenized[0] += len(ids)
    return ids
packing.encode_document = counting
argv = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset_path",
        args["corpus"], "--training.length_index_dir", args["counts"], "--training.seq_len",
        str(args["seq"]), "--training.batch_size", str(args["batch"]), "--training.num_workers",
        str(args["workers"]), "--training.streaming", "true" if args["streaming"] else "false"]
cfg = parse_args(argv)
loader = build_dataloader(cfg, Tokenizer(args["tokenizer"]), 0, 1)
next(loader)
first_s = time.time() - args["launched"]
memory_first = memory()
per_batch = args["seq"] * args["batch"]
begin, batches, peak, done = time.perf_counter(), 0, memory_first, False
while not done:
    next(loader)
    batches += 1
    if batches == args["batches"]:
        window_s, memory_window = time.perf_counter() - begin, memory()
        if not args["pass"]:
            break
    if batches % 50 == 0:
        peak = max(peak, memory())
    done = bool(loader.take_epoch_starts())
pass_s = time.perf_counter() - begin
print("RESULT", json.dumps({
    "first_s": first_s, "window_tps": args["batches"] * per_batch / window_s,
    "pass_tps": batches * per_batch / pass_s if args["pass"] else None,
    "memory_first": memory_first, "memory_window": memory_window, "memory_peak": peak,
    "tokenized_over_read": tokenized[0] / ((batches + 1) * per_batch),
}))
"""
)

PEER = (
    MEMORY
    + PEER_SETUP
    + r"""
DATASETS["bench"] = DatasetConfig(
    path="bench",
    loader=lambda _: load_dataset("parquet", data_files=args["files"], split="train",
                                  streaming=args["streaming"]),
    sample_processor=lambda sample: sample["text"],
)
dataset = HuggingFaceTextDataset("bench", None, tokenizer, seq_len=args["seq"],
                                 dp_rank=0, dp_world_size=1, infinite=False)
loader = ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=args["batch"],
                                 num_workers=args["workers"], persistent_workers=False,
                                 prefetch_factor=2 if args["workers"] else None)
it = iter(loader)
next(it)
first_s = time.time() - args["launched"]
memory_first = memory()
per_batch = args["seq"] * args["batch"]
begin, batches, peak = time.perf_counter(), 0, memory_first
for _ in it:
    batches += 1
    if batches == args["batches"]:
        window_s, memory_window = time.perf_counter() - begin, memory()
        if not args["pass"]:
            break
    if batches % 50 == 0:
        peak = max(peak, memory())
pass_s = time.perf_counter() - begin
print("RESULT", json.dumps({
    "first_s": first_s, "window_tps": args["batches"] * per_batch / window_s,
    "pass_tps": batches * per_batch / pass_s if args["pass"] else None,
    "memory_first": memory_first, "memory_window": memory_window, "memory_peak": peak,
}))
"""
)


def build_corpus(folder: Path, mb: float, row_group: int) -> dict:
    """FILES parquet files of ``mb`` MB of text in all, ``row_group`` rows a group; built
    once per size and layout."""

    def build(out: Path) -> dict:
        pools = {d: bundled_texts(d) for d in DOMAINS}
        documents = 0
        for f in range(FILES):
            domain = DOMAINS[f % len(DOMAINS)]
            rows = [{"id": i, "text": t} for i, t in
                    file_documents(f, pools[domain], domain, int(mb * 2**20) // FILES)]  # fmt: skip
            write_parquet(out / "data" / f"part-{f:03d}.parquet", rows, row_group=row_group)
            documents += len(rows)
        return {"documents": documents, "mb": mb, "row_group": row_group}

    record = built_once(folder, f"{mb}-{row_group}", build)
    return {**record, "path": str(folder / "data"),
            "files": sorted(str(p) for p in (folder / "data").glob("*.parquet"))}  # fmt: skip


def fresh(folder: Path) -> str:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return str(folder)


def run_ours(corpus: dict, counts: str, workers: int, args, streaming=True, whole=True,
             checkout: Path = REPO) -> dict:  # fmt: skip
    """One run of ``checkout``'s loader (this one's by default; ``--before``'s for the warm
    rows of the code before)."""
    return bench.run_program(OURS, {
        "corpus": corpus["path"], "counts": counts, "workers": workers, "seq": SEQ,
        "batch": BATCH, "batches": args.batches, "pass": whole, "streaming": streaming,
        "tokenizer": TOKENIZER, "launched": time.time(), "repo": str(checkout)},
        pythonpath=str(checkout), cwd=checkout, what=f"ours ({checkout})")  # fmt: skip


def run_peer(corpus: dict, workers: int, args, streaming=True, whole=True) -> dict | None:
    if not args.peer_python:
        return None
    try:
        return bench.run_program(PEER, {
            "files": corpus["files"], "workers": workers, "seq": SEQ, "batch": BATCH,
            "batches": args.batches, "pass": whole, "streaming": streaming,
            "tokenizer": TOKENIZER, "launched": time.time()},
            python=args.peer_python, what="the peer")  # fmt: skip
    except bench.PeerUnavailable as e:
        print(f"peer skipped: {e}", file=sys.stderr)
        args.peer_python = ""
        return None


def warm_map_style_cache(corpus: dict, work: Path, args):
    """``datasets``' Arrow cache of the corpus (map-style's O(corpus) conversion, the
    library's cost, paid once on both sides before any timing)."""
    run_ours(corpus, fresh(work / "throwaway"), 0, _Few(args), streaming=False, whole=False)
    run_peer(corpus, 0, _Few(args), streaming=False, whole=False)


class _Few:
    def __init__(self, args):
        self.batches, self.peer_python = 1, args.peer_python


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r and r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    parser = bench.Arguments(__doc__, smoke={"mb": 4, "batches": 20, "rounds": 1}, rounds=3,
                             work="", peer=True)  # fmt: skip
    parser.add_argument("--mb", type=float, default=80, help="MB of text in the corpus")
    parser.add_argument("--row-group", type=int, default=1024, help="rows a parquet row group")
    parser.add_argument("--batches", type=int, default=300, help="batches after the first")
    parser.add_argument("--workers", default="0,2", help="loader workers, comma-separated")
    parser.add_argument("--before", default="", metavar="CHECKOUT",
                        help="another checkout of this project (the code before a change): "
                        "its warm rows measured alongside, in the same rounds")  # fmt: skip
    args = parser.parse(argv)
    workers = [int(w) for w in args.workers.split(",")]
    import os

    with bench.work_folder(args, "bench_firstpass_") as work:
        os.environ["HF_HOME"] = str(work / "hf")  # the datasets cache, offline
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        corpus = build_corpus(work / "corpus", args.mb, args.row_group)
        warm_map_style_cache(corpus, work, args)
        runs: dict[str, list] = {}
        for r in range(args.rounds):
            for w in workers:
                counts = fresh(work / f"counts-{w}")
                runs.setdefault(f"cold {w}", []).append(run_ours(corpus, counts, w, args))
                for sidecar in Path(counts).rglob("*.tokens"):
                    sidecar.unlink()
                runs.setdefault(f"warm {w}", []).append(run_ours(corpus, counts, w, args))
                if args.before:  # the same counts, read by the code before
                    runs.setdefault(f"warm before {w}", []).append(
                        run_ours(corpus, counts, w, args, checkout=Path(args.before).resolve())
                    )
                runs.setdefault(f"peer {w}", []).append(run_peer(corpus, w, args))
            runs.setdefault("map ours", []).append(
                run_ours(corpus, fresh(work / "counts-map"), 0, args, streaming=False, whole=False)
            )
            runs.setdefault("map peer", []).append(
                run_peer(corpus, 0, args, streaming=False, whole=False)
            )
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
        result = summarize(runs, workers, corpus, args)
        result["about"] = bench.about(argv, commit=True)
        print_report(result)
        return bench.save(args, result)


def summarize(runs: dict, workers: list[int], corpus: dict, args) -> dict:
    keys = ("first_s", "window_tps", "pass_tps", "memory_first", "memory_window",
            "memory_peak", "tokenized_over_read")  # fmt: skip
    med = {row: {k: median_of(rs, k) for k in keys} for row, rs in runs.items()}
    checks = []
    for w in workers:
        cold, warm, peer = med[f"cold {w}"], med[f"warm {w}"], med[f"peer {w}"]
        checks.append([f"cold / warm first pass, {w} workers", cold["pass_tps"] / warm["pass_tps"],
                       ">= 0.95"])  # fmt: skip
        checks.append([f"cold / warm {args.batches} batches, {w} workers",
                       cold["window_tps"] / warm["window_tps"], "(reported)"])  # fmt: skip
        if f"warm before {w}" in med:
            checks.append([f"warm / warm before, first pass, {w} workers",
                           warm["pass_tps"] / med[f"warm before {w}"]["pass_tps"], ">= 0.95"])  # fmt: skip
        checks.append([f"memory after {args.batches} / after the first, cold, {w} workers",
                       cold["memory_window"] / cold["memory_first"], "<= 1.10"])  # fmt: skip
        if peer["pass_tps"]:
            checks.append([f"cold / peer first pass, {w} workers",
                           cold["pass_tps"] / peer["pass_tps"], ">= 1.0"])  # fmt: skip
            checks.append([f"cold peak / peer peak memory, {w} workers",
                           cold["memory_peak"] / peer["memory_peak"], "<= 1.0"])  # fmt: skip
    if len(workers) > 1 and med[f"peer {workers[0]}"]["pass_tps"]:
        # Loader workers that scale (#61): ours from 0 to W workers against the peer's, on
        # the first pass and on a later one; and a later pass with workers against the peer.
        w0, w = workers[0], workers[-1]
        peer_gain = med[f"peer {w}"]["pass_tps"] / med[f"peer {w0}"]["pass_tps"]
        checks.append([f"peer: {w} workers / {w0}", peer_gain, "(reported)"])
        for run in ("cold", "warm"):
            gain = med[f"{run} {w}"]["pass_tps"] / med[f"{run} {w0}"]["pass_tps"]
            checks.append([f"{run}: {w} workers / {w0}, over the peer's", gain / peer_gain,
                           ">= 1.0"])  # fmt: skip
        checks.append([f"warm / peer, {w} workers (a later pass)",
                       med[f"warm {w}"]["pass_tps"] / med[f"peer {w}"]["pass_tps"], ">= 0.95"])  # fmt: skip
    if med["map peer"]["first_s"]:
        checks.append(["map-style first batch, ours / peer",
                       med["map ours"]["first_s"] / med["map peer"]["first_s"], "<= 1.2"])  # fmt: skip
    return {"corpus": {k: v for k, v in corpus.items() if k != "files"}, "medians": med,
            "checks": checks, "rounds": args.rounds, "batches": args.batches}  # fmt: skip


def _fmt(value, unit="") -> str:
    if value is None:
        return "–"
    if unit == "tps":
        return f"{value / 1e6:.2f} M"
    return f"{value:.2f}" if unit != "mib" else f"{value:.0f}"


def print_report(result: dict):
    med = result["medians"]
    rows = [[row, _fmt(m["first_s"]), _fmt(m["window_tps"], "tps"), _fmt(m["pass_tps"], "tps"),
             _fmt(m["memory_first"], "mib"), _fmt(m["memory_window"], "mib"),
             _fmt(m["memory_peak"], "mib"), _fmt(m["tokenized_over_read"])]
            for row, m in med.items()]  # fmt: skip
    bench.print_table(["run", "first batch s", f"{result['batches']} batches tok/s",
                       "first pass tok/s", "MiB first", f"MiB +{result['batches']}", "MiB peak",
                       "tokenized / read"], rows, f"corpus {result['corpus']}")  # fmt: skip
    bench.print_table(["check", "value", "target"],
                      [[c, f"{v:.2f}", t] for c, v, t in result["checks"]])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
