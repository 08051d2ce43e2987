"""Start-up at scale: what one rank of R opens and reads before its first batch.

    python scripts/benchmarks/bench_startup.py [--files 10000] [--ranks 1,64,1024] [--work DIR]
        [--smoke] [--json out.json]

One process simulates rank r of R (r = R // 2; R = 1, 64, 1,024) over a streaming
parquet corpus of --files tiny files (4 documents each, generated under the temporary
folder), through the path train.py runs (``data.plan.resolve_plan``): rank 0 lists the sources
once (``list_sources``), every rank inspects its share of the files
(``inspect_share``), rank 0 combines them (``combine``); then rank r builds its loader
from the plan and takes its first batch (``build_dataloader``, ``next``), the counts of
the units its step's windows lie in measured by rank 0 first, untimed (the ranks share
the measuring of a first start through the count folder: index.py), so rank r reads
them. The other ranks' shares of the files are inspected too, untimed. Printed per R:
the rank's data files opened, bytes read and seconds to its first batch; rank 0's
once-per-job work; and, as the baseline, the same rank resolving the data alone
(``local_plan``), as every rank did before the plan.

Opens are counted from Python's audit events, bytes from /proc/self/io (rchar), each
phase after a warm-up run, so the page cache is warm and imports are done.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.corpus import built_once, write_parquet
from harness.io_count import counting
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader, combine, inspect_share, list_sources, local_plan
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer


def build_corpus(folder: Path, files: int) -> Path:
    """``files`` tiny parquet files of 4 documents each under ``folder``; built once."""

    def build(out: Path) -> dict:
        for f in range(files):
            write_parquet(out / f"part-{f:05d}.parquet", [
                {"id": f"d{f}-{r}",
                 "text": f"Document {f}-{r}. " + "A few words of a tiny file. " * (3 + (f + r) % 9)}
                for r in range(4)])  # fmt: skip
        return {"files": files}

    built_once(folder, str(files), build)
    return folder


def measure(fn, corpus: Path):
    begin = time.perf_counter()
    with counting() as access:
        value = fn()
    seconds = time.perf_counter() - begin
    opened = {p for p in access.files_under(str(corpus)) if p.endswith(".parquet")}
    return value, {"files_opened": len(opened), "bytes_read": access.bytes_read,
                   "seconds": seconds, "files": opened}  # fmt: skip


def simulate(cfg, tokenizer, corpus: Path, ranks: int) -> dict:
    t, rank = cfg.training, ranks // 2
    shutil.rmtree(t.length_index_dir, ignore_errors=True)  # this R's run is a first start
    specs, listing = measure(lambda: list_sources(t), corpus)
    others = [inspect_share(specs, t, tokenizer, r, ranks) for r in range(ranks) if r != rank]
    mine, share = measure(lambda: inspect_share(specs, t, tokenizer, rank, ranks), corpus)
    plan, combining = measure(lambda: combine(specs, [*others, mine], t, tokenizer), corpus)

    # First start: no counts in the folder. Rank 0 (untimed, as the other ranks share
    # the measuring) takes its first batch, measuring the units the first step's windows
    # lie in; rank r then reads those counts from the folder: a later start's cost too.
    next(build_dataloader(cfg, tokenizer, 0, ranks, plan=plan))

    def first_batch():
        loader = build_dataloader(cfg, tokenizer, rank, ranks, plan=plan)
        next(loader)
        return len(loader.stream.orders[0].units(len(specs[0].files)))

    units, first = measure(first_batch, corpus)
    _, alone = measure(lambda: local_plan(t, tokenizer), corpus)
    per_rank = total(share, first)
    for phase in (share, first, listing, combining, alone):
        phase.pop("files")
    return {"ranks": ranks, "rank": rank, "units": units, "per_rank": per_rank,
            "per_rank_first_start": per_rank, "share": share, "first_batch": first,
            "rank0_listing": listing, "rank0_combine": combining,
            "baseline_resolving_alone": alone}  # fmt: skip


def total(*phases: dict) -> dict:
    """One rank's phases summed: distinct files opened, bytes, seconds."""
    out = {k: sum(p[k] for p in phases) for k in ("bytes_read", "seconds")}
    out["files_opened"] = len(set().union(*(p["files"] for p in phases)))
    return out


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"files": 200, "ranks": "1,64"},
                        work=str(Path(tempfile.gettempdir()) / "bench_startup"))  # fmt: skip
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--ranks", default="1,64,1024")
    args = p.parse(argv)
    root = Path(args.work) / str(args.files)
    corpus = build_corpus(root / "data", args.files)
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    cfg = parse_args(["--training.dataset_path", str(corpus), "--training.streaming",
                      "--training.seq_len", "64", "--training.batch_size", "8",
                      "--training.length_index_dir", str(root / "length_index")])  # fmt: skip
    simulate(cfg, tokenizer, corpus, 2)  # warm-up: imports, page cache
    results = [simulate(cfg, tokenizer, corpus, int(r)) for r in args.ranks.split(",")]

    print(f"\nstart-up of one rank over {args.files:,} streaming parquet files (tiny)\n")
    header = ["R", "rank", "counts measured: files opened", "MB read", "s to first batch",
              "first start: files", "MB", "s", "before: files", "before: MB",
              "before: s"]  # fmt: skip
    rows = []
    for r in results:
        row = [f"{r['ranks']:,}", r["rank"]]
        for phase in (r["per_rank"], r["per_rank_first_start"], r["baseline_resolving_alone"]):
            row += [f"{phase['files_opened']:,}", f"{phase['bytes_read'] / 1e6:.2f}",
                    f"{phase['seconds']:.3f}"]  # fmt: skip
        rows.append(row)
    bench.print_table(header, rows)
    r = results[-1]
    print(f"\nonce per job, rank 0: listing {r['rank0_listing']['seconds']:.3f} s "
          f"({r['rank0_listing']['files_opened']} files opened), combining "
          f"{r['rank0_combine']['seconds']:.3f} s; no token counted at start (the first "
          "step's units are measured as the windows reach them, shared by the ranks)")  # fmt: skip
    return bench.save(args, {"files": args.files, "results": results})


if __name__ == "__main__":
    sys.exit(main())
