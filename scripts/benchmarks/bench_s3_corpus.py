"""A corpus read from a bucket vs the same files on local disk: the loader's throughput and
its first batch, as training pulls them.

    python scripts/benchmarks/bench_s3_corpus.py [--mb 32] [--batches 100] [--rounds 3]
        [--format parquet|jsonl|arrow] [--counts-local] [--cold] [--work DIR] [--smoke]
        [--json out.json]

Corpus, built once under --work (bench_firstpass.py's): 16 parquet files holding --mb MB
of the bundled texts in row groups of 1,024 rows; ``--format jsonl`` or ``arrow``: the
same rows written as 16 JSON lines files, or 16 Arrow stream files (as ``save_to_disk``
writes them) in record batches of 1,024 rows. The same files are uploaded with s3fs to
a bucket of the local S3 server (harness/s3.py: moto's server on 127.0.0.1, reached over
HTTP through fsspec → s3fs → botocore and the AWS_* variables, as a job reaches a
bucket). The counts are measured beforehand (warm: ``prepare``, into a local folder for
the local corpus and into the bucket for the bucket's), so both runs read and tokenize
the text once and measure nothing. ``--counts-local`` adds a side: the bucket's corpus
with its counts in a local folder, so that what the count files' GETs cost shows apart.

Every figure is one fresh process launched by this script, reading with
``build_dataloader`` from a config as train.py builds it (rank 0 of 1, streaming, 0
workers, seq_len 2048, batch 8):

- **first batch s**: seconds from the launch (interpreter start and imports included) to
  the first batch;
- **tok/s**: tokens per second over the --batches batches after the first;
- **same batches**: a digest of every batch's tokens, equal on both sides.

Rounds interleave the two; the figures are medians. The local server is no network: the
ratio is the cost of the client stack (requests, HTTP, the byte cache of
``streaming._open_binary``), not of a real link's latency or bandwidth.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan
from bench_firstpass import TOKENIZER, build_corpus

from harness import bench, s3
from torchtitan import REPO_ROOT as REPO
from torchtitan.data.loader import PREFETCH_STEPS

SEQ, BATCH = 2048, 8

PROGRAM = r"""
import hashlib, json, sys, time
args = json.loads(sys.argv[1])
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import Tokenizer
argv = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset_path",
        args["corpus"], "--training.length_index_dir", args["counts"], "--training.seq_len",
        str(args["seq"]), "--training.batch_size", str(args["batch"]),
        "--training.num_workers", "0", "--training.streaming", "true"]
loader = build_dataloader(parse_args(argv), Tokenizer(args["tokenizer"]), 0, 1)
loader.prefetch_steps = args["prefetch"]
for order in loader.stream.orders:
    order.counts.reads_ahead &= args["count_ahead"]
digest = hashlib.sha1()
def take():
    batch = next(loader)
    digest.update(batch["input"].numpy().tobytes())
take()
first_s = time.time() - args["launched"]
begin = time.perf_counter()
for _ in range(args["batches"]):
    take()
seconds = time.perf_counter() - begin
measured = sum(o.counts.measured for o in loader.stream.orders)
prefetch = [s.prefetch for s in loader.stream.sources if getattr(s, "prefetch", None)]
fetched = {k: sum(getattr(p, k) for p in prefetch) for k in ("fetched", "taken", "dropped")}
print("RESULT", json.dumps({"first_s": first_s, "tps": args["batches"] * args["seq"]
      * args["batch"] / seconds, "digest": digest.hexdigest(), "measured": measured,
      "prefetch": fetched}))
"""


def converted(corpus: dict, fmt: str) -> str:
    """The folder of ``corpus``'s rows in ``fmt`` (parquet: the corpus itself), written
    once beside it."""
    import json
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "parquet":
        return corpus["path"]
    out = Path(corpus["path"]).parent / f"data-{fmt}"
    if (out / "done").exists():
        return str(out)
    out.mkdir(exist_ok=True)
    for path in corpus["files"]:
        table = pq.read_table(path)
        name = out / f"{Path(path).stem}.{fmt}"
        if fmt == "jsonl":
            rows = table.to_pylist()
            name.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            with pa.OSFile(str(name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=1024):
                    w.write_batch(batch)
    (out / "done").write_text("")
    return str(out)


def prepare_counts(corpus: str, counts: str):
    """Every unit measured into ``counts`` before any timing (warm)."""
    from torchtitan.config import parse_args
    from torchtitan.data.prepare import prepare
    from torchtitan.data.tokenizer import Tokenizer

    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml",
                      "--training.dataset_path", corpus, "--training.length_index_dir", counts,
                      "--training.seq_len", str(SEQ), "--training.streaming", "true"])  # fmt: skip
    prepare(cfg.training, Tokenizer(TOKENIZER), num_proc=2, progress=False)


class Requests(logging.Handler):
    """The requests the local server answered, by method and file suffix (``GET
    parquet``, ``GET tokens 404``), from its request log: what a run asked of the store."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def emit(self, record):
        parts = record.getMessage().split('"')
        if len(parts) < 3:
            return
        method, path = (parts[1].split() + ["", ""])[:2]
        method = method.rsplit("m", 1)[-1]  # the log colours some lines
        key = path.split("?")[0].strip("/")
        suffix = key.rsplit("/", 1)[-1].rpartition(".")[2] if "/" in key else "(listing)"
        status = parts[2].split()[0] if parts[2].split() else ""
        key = f"{method} {suffix}" + ("" if status.startswith("2") else f" {status}")
        self.seen[key] = self.seen.get(key, 0) + 1


def run(corpus: str, counts: str, args) -> dict:
    return bench.run_program(PROGRAM, {
        "corpus": corpus, "counts": counts, "seq": SEQ, "batch": BATCH,
        "batches": args.batches, "tokenizer": TOKENIZER, "launched": time.time(),
        "prefetch": args.prefetch, "count_ahead": not args.no_count_ahead},
        pythonpath=str(REPO), cwd=REPO, what=f"the loader over {corpus}")  # fmt: skip


def main(argv=None) -> int:
    parser = bench.Arguments(__doc__, smoke={"mb": 2, "batches": 5, "rounds": 1}, rounds=3,
                             work="")  # fmt: skip
    parser.add_argument("--mb", type=float, default=32, help="MB of text in the corpus")
    parser.add_argument("--batches", type=int, default=100, help="batches after the first")
    parser.add_argument("--prefetch", type=int, default=PREFETCH_STEPS,
                        help="steps the loader fetches ahead (0: none)")  # fmt: skip
    parser.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "arrow"],
                        help="the files the corpus is written as")  # fmt: skip
    parser.add_argument("--no-count-ahead", action="store_true",
                        help="count files in the bucket read in line, not ahead")  # fmt: skip
    parser.add_argument("--counts-local", action="store_true",
                        help="also the bucket's corpus with its count files on local disk "
                             "(what the count files' GETs cost)")  # fmt: skip
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also runs whose counts are measured as they read (a fresh folder)",
    )
    args = parser.parse(argv)
    reason = s3.missing()
    if reason:
        raise SystemExit(reason)
    server_log, requests = logging.getLogger("werkzeug"), Requests()
    server_log.setLevel(logging.INFO)  # the server's request log: counted, not printed
    server_log.propagate = False
    server_log.addHandler(requests)
    with bench.work_folder(args, "bench_s3_corpus_") as work, s3.local_s3() as (bucket, _):
        import s3fs

        corpus = build_corpus(work / "corpus", args.mb, 1024)
        local = converted(corpus, args.format)
        files = f"*.{args.format}"  # the format's files alone (not the folder's marker)
        s3fs.S3FileSystem().put(f"{local}/{files}", f"{bucket}/corpus/", recursive=True)
        local = f"{local}/{files}"
        sides = {"local": (local, str(work / f"counts-{args.mb}-{args.format}")),
                 "s3": (f"s3://{bucket}/corpus", f"s3://{bucket}/counts")}  # fmt: skip
        if args.counts_local:
            sides["s3, counts local"] = (f"s3://{bucket}/corpus",
                                         str(work / f"s3-counts-{args.mb}-{args.format}"))  # fmt: skip
        for where, counts in sides.values():
            prepare_counts(where, counts)
        if args.cold:  # the same corpus, its counts measured by the run itself
            sides.update({
                "local cold": (local, str(work / "cold-{round}")),
                "s3 cold": (f"s3://{bucket}/corpus", f"s3://{bucket}/cold-{{round}}")})  # fmt: skip
        runs: dict[str, list] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side, (where, counts) in sides.items():
                requests.seen = {}
                result = run(where, counts.format(round=r), args)
                runs[side].append({**result, "requests": requests.seen})
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    result = summarize(runs, corpus, args)
    result["about"] = bench.about(argv, commit=True)
    print_report(result)
    return bench.save(args, result)


def summarize(runs: dict, corpus: dict, args) -> dict:
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("first_s", "tps")}
           for side, rs in runs.items()}  # fmt: skip
    digests = {side: sorted({r["digest"] for r in rs}) for side, rs in runs.items()}
    warm = [side for side in runs if not side.endswith("cold")]
    return {
        "corpus": {**{k: v for k, v in corpus.items() if k not in ("files", "path")},
                   "format": args.format},
        "medians": med, "s3_over_local": med["s3"]["tps"] / med["local"]["tps"],
        "cold_s3_over_local": (med["s3 cold"]["tps"] / med["local cold"]["tps"]
                               if "s3 cold" in med else None),
        "counts_local_s3_over_local": (med["s3, counts local"]["tps"] / med["local"]["tps"]
                                       if "s3, counts local" in med else None),
        "first_batch_s3_over_local": med["s3"]["first_s"] / med["local"]["first_s"],
        "same_batches": len({d for ds in digests.values() for d in ds}) == 1,
        "measured": max(r["measured"] for side in warm for r in runs[side]),
        "rounds": args.rounds, "batches": args.batches, "prefetch_steps": args.prefetch,
        "count_ahead": not args.no_count_ahead,
        "s3_requests_last_round": runs["s3"][-1]["requests"],
        "s3_requests_per_step": sum(runs["s3"][-1]["requests"].values()) / (args.batches + 1),
        "s3_prefetch_last_round": runs["s3"][-1]["prefetch"],
    }  # fmt: skip


def print_report(result: dict):
    med = result["medians"]
    rows = [[side, f"{m['first_s']:.2f}", f"{m['tps'] / 1e6:.3f} M"] for side, m in med.items()]
    bench.print_table(["corpus on", "first batch s", f"{result['batches']} batches tok/s"], rows,
                      f"corpus {result['corpus']}, medians of {result['rounds']} rounds")  # fmt: skip
    print(f"\ns3 / local tok/s {result['s3_over_local']:.2f}, first batch "
          f"{result['first_batch_s3_over_local']:.2f}; same batches: {result['same_batches']}; "
          f"units measured by the timed runs: {result['measured']}")  # fmt: skip
    if result["counts_local_s3_over_local"] is not None:
        print(f"count files on local disk: s3 / local tok/s "
              f"{result['counts_local_s3_over_local']:.2f}")  # fmt: skip
    if result["cold_s3_over_local"] is not None:
        print(f"cold counts: s3 / local tok/s {result['cold_s3_over_local']:.2f}")
    print(f"requests of the last s3 run (first batch included): "
          f"{result['s3_requests_last_round']}, {result['s3_requests_per_step']:.2f} a step; "
          f"fetched ahead ({result['prefetch_steps']} steps): "
          f"{result['s3_prefetch_last_round']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
