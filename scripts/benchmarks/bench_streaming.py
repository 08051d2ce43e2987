"""Streaming at full speed: this project's loader side by side with torchtitan 0.3.0's.

    python scripts/benchmarks/bench_streaming.py --peer-python /path/to/venv/bin/python \\
        [--rounds 3] [--tokens 7000000] [--resume-mb 512] [--smoke] [--json out.json]

Same documents, same SentencePiece model (data/tokenizer/tokenizer.model), one rank,
tokens/s out of the loader (seq_len 2048, batch 8 unless a row says otherwise), medians
of rounds in which every row is measured once, ours then the peer's, so drift on a
shared machine hits both alike. Ours is built as training builds it
(``build_dataloader`` from a config: the global order over the corpus's length index,
made or read from the cache when the loader is built, before any timing). The peer is
torchtitan 0.3.0's ``HuggingFaceTextDataset`` in its ``ParallelAwareDataloader``, run
in a subprocess of ``--peer-python`` (a virtual
environment where ``import torchtitan`` is 0.3.0; this script installs nothing, and
skips the peer, saying why, when it cannot import it). The peer reads the bundled
SentencePiece model through a small adapter to its tokenizer interface, defined in the
subprocess; a probe text's ids are compared to ours.

Corpora: ``bundled`` (20 parquet files, 2,221 documents) and ``pydocs``, built under
the temporary folder from this Python's standard library sources (one document per
module, 4 JSON lines files; never committed). Rows: map-style at 0 workers (the peer's
map-style with workers yields every batch twice, so it is not measured), streaming at
0 and 2 workers, and seq_len 128 at 0 and 2 workers. Then resume: a large streaming
corpus (the bundled text repeated to --resume-mb in 8 parquet files of 128-row groups,
and the same as 8 JSON lines files) is resumed at 1% and at 99% of the epoch (a
``Position``: windows taken and the token offset there), timing load_state_dict to
the first batch, alternating, in fresh loaders.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.corpus import built_once, bundled_documents, repeated, write_jsonl, write_parquet_files
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.sources import resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

SEQ, BATCH = 2048, 8
WORK = Path(tempfile.gettempdir()) / "bench_streaming"
PROBE = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"

# (label, corpus, streaming, workers, seq_len, measure the peer)
ROWS = [
    ("map-style, 0 workers", "bundled", False, 0, SEQ, True),
    ("map-style, 2 workers", "bundled", False, 2, SEQ, False),
    ("streaming, 0 workers", "bundled", True, 0, SEQ, True),
    ("streaming, 2 workers", "bundled", True, 2, SEQ, True),
    ("map-style, 0 workers", "pydocs", False, 0, SEQ, True),
    ("map-style, 2 workers", "pydocs", False, 2, SEQ, False),
    ("streaming, 0 workers", "pydocs", True, 0, SEQ, True),
    ("streaming, 2 workers", "pydocs", True, 2, SEQ, True),
    ("map-style, 0 workers", "bundled", False, 0, 128, False),
    ("map-style, 2 workers", "bundled", False, 2, 128, False),
    ("streaming, 0 workers", "bundled", True, 0, 128, False),
    ("streaming, 2 workers", "bundled", True, 2, 128, False),
]


# ---- corpora -------------------------------------------------------------------------


def build_pydocs(out: Path, max_mb: float, files: int = 4) -> Path:
    """This Python's standard library modules (tests excluded), one JSON line each, in
    ``files`` files, up to ``max_mb`` of text. Built once per size."""

    def build(folder: Path) -> dict:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "test", "tests", "idle_test"}
        docs, total = [], 0
        for path in sorted(stdlib.rglob("*.py")):
            if skip & set(path.relative_to(stdlib).parts) or total > max_mb * 2**20:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            docs.append({"id": str(path.relative_to(stdlib)), "text": text})
            total += len(text)
        write_jsonl(folder, docs, files)
        return {"documents": len(docs), "chars": total}

    built_once(out, str(max_mb), build)
    return out


def build_large(out: Path, size_mb: int, files: int = 8, row_group: int = 128):
    """The bundled documents repeated with new ids to ``size_mb`` of text, as parquet
    (``row_group`` rows per group) and as JSON lines, ``files`` files each: the folders
    and the record of what was built."""
    folders = {"parquet": out / "parquet", "jsonl": out / "jsonl"}

    def build(_) -> dict:
        docs = repeated(bundled_documents(), size_mb)
        write_parquet_files(folders["parquet"], docs, files, row_group=row_group)
        write_jsonl(folders["jsonl"], docs, files)
        return {"documents": len(docs)}

    return folders, built_once(out, str(size_mb), build)


def corpus_files(name: str, pydocs: Path) -> tuple[list[str], str]:
    if name == "bundled":
        return resolve_source(name="bundled").files, "parquet"
    return sorted(str(p) for p in pydocs.glob("*.jsonl")), "json"


# ---- this project ----------------------------------------------------------------------


def our_loader(tokenizer, where: str, streaming: bool, workers: int, seq_len: int):
    """The loader of rank 0 of 1, built from a config as train.py builds it."""
    argv = ["--training.seq_len", seq_len, "--training.batch_size", BATCH,
            "--training.num_workers", workers, "--training.seed", 0]  # fmt: skip
    argv += ["--training.dataset", "bundled"] if where == "bundled" else [
        "--training.dataset_path", where]  # fmt: skip
    if streaming:
        argv.append("--training.streaming")
    return build_dataloader(parse_args([str(a) for a in argv]), tokenizer, 0, 1)


def warmup_batches(loader) -> int:
    """Batches of start-up, not throughput: the first documents, worker start-up, and
    what workers queue meanwhile (up to 4 groups each). The peer skips as many."""
    workers = loader.num_workers
    return 2 + 2 * workers + 4 * workers * loader.group


def our_rate(tokenizer, where: str, streaming: bool, workers: int, seq_len: int, tokens: int):
    loader = our_loader(tokenizer, where, streaming, workers, seq_len)
    warmup = warmup_batches(loader)
    for _ in range(warmup):
        next(loader)
    batches = max(2, tokens // (seq_len * BATCH))
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    rate = batches * seq_len * BATCH / (time.perf_counter() - start)
    order = loader.stream.orders[0]
    units = len(order.units(order.source.extent()))  # what the order shuffles
    del loader
    return rate, {"units": units, "warmup_batches": warmup}


# ---- the peer: torchtitan 0.3.0, in its own interpreter --------------------------------

PEER_SETUP = (
    bench.peer_check(
        """
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset
    """,
        "HuggingFaceTextDataset",
    )
    + r"""
import sentencepiece
from datasets import load_dataset


class SentencePieceAdapter(BaseTokenizer):
    # The bundled SentencePiece model behind torchtitan's tokenizer interface.
    def __init__(self, path):
        super().__init__()
        self.sp = sentencepiece.SentencePieceProcessor(model_file=path, num_threads=1)
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()

    def encode(self, text, add_bos=True, add_eos=True):
        return [self.bos_id] * add_bos + self.sp.encode(text) + [self.eos_id] * add_eos

    def decode(self, ids):
        return self.sp.decode(ids)

    def get_vocab_size(self):
        return self.sp.vocab_size()


tokenizer = SentencePieceAdapter(args["tokenizer"])
"""
)

PEER_RATE = (
    PEER_SETUP
    + r"""
DATASETS["bench"] = DatasetConfig(
    path="bench",
    loader=lambda _: load_dataset(args["fmt"], data_files=args["files"], split="train",
                                  streaming=args["streaming"]),
    sample_processor=lambda sample: sample["text"],
)
dataset = HuggingFaceTextDataset("bench", None, tokenizer, seq_len=args["seq_len"],
                                 dp_rank=0, dp_world_size=1, infinite=True)
workers = args["workers"]
loader = ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=args["batch"],
                                 num_workers=workers, persistent_workers=False,
                                 prefetch_factor=None)
it = iter(loader)
for _ in range(args["warmup"]):  # as many batches as ours skips
    next(it)
start = time.perf_counter()
for _ in range(args["batches"]):
    next(it)
rate = args["batches"] * args["batch"] * args["seq_len"] / (time.perf_counter() - start)
print("RESULT", json.dumps({"tokens_per_s": rate, "probe": tokenizer.encode(args["probe"])}))
"""
)


# Resume to the first batch, as a relaunched job does: build the dataset and loader, load
# the state, take a batch. The peer's state is its streaming dataset's (``datasets``'
# IterableDataset: a file and a row in it), made for the position without iterating to it.
PEER_RESUME = (
    PEER_SETUP
    + r"""
import pyarrow.parquet as pq
rows = [pq.ParquetFile(f).metadata.num_rows for f in args["files"]]
target = int(args["fraction"] * sum(rows))
shard = 0
while target >= rows[shard]:
    target, shard = target - rows[shard], shard + 1
target -= target % args["row_group"]  # a row group's start: where datasets resumes exactly
DATASETS["bench"] = DatasetConfig(
    path="bench",
    loader=lambda _: load_dataset("parquet", data_files=args["files"], split="train",
                                  streaming=True),
    sample_processor=lambda sample: sample["text"],
)
times = []
for _ in range(args["repeats"]):
    start = time.perf_counter()
    dataset = HuggingFaceTextDataset("bench", None, tokenizer, seq_len=args["seq_len"],
                                     dp_rank=0, dp_world_size=1, infinite=True)
    state = dataset.state_dict()
    inner = state["data"]["examples_iterable"]
    inner["examples_iterable"].update(shard_idx=shard, shard_example_idx=target)
    inner["batch_idx"] = sum(rows[:shard]) + target
    dataset.load_state_dict(state)
    loader = ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=1,
                                     batch_size=args["batch"], num_workers=0)
    batch = next(iter(loader))
    times.append(time.perf_counter() - start)
print("RESULT", json.dumps({"seconds": times}))
"""
)


def peer_rate(
    python: str, files, fmt, streaming, workers, seq_len, tokens, warmup
) -> tuple[float, list]:
    args = {"files": files, "fmt": fmt, "streaming": streaming, "workers": workers,
            "seq_len": seq_len, "batch": BATCH, "batches": max(2, tokens // (seq_len * BATCH)),
            "warmup": warmup,
            "tokenizer": DEFAULT_TOKENIZER_PATH, "probe": PROBE}  # fmt: skip
    result = bench.run_program(PEER_RATE, args, python=python, what="the peer")
    return result["tokens_per_s"], result["probe"]


# ---- resume ----------------------------------------------------------------------------


def resume_states(tokenizer, folder: Path) -> dict[str, bytes]:
    """The loader state (rank 0 of 1, streaming) at 1% and at 99% of the epoch's tokens,
    as a checkpoint taken there would hold it."""
    import pickle

    states = {}
    for label, fraction in (("1%", 0.01), ("99%", 0.99)):
        loader = our_loader(tokenizer, str(folder), True, 0, SEQ)
        stream = loader.stream
        windows = int(fraction * stream.orders[0].pass_tokens()) // stream.window_size
        loader.seek(stream.position_after(windows))
        states[label] = pickle.dumps(loader.state_dict())
    return states


def time_resume(tokenizer, folder: Path, state: bytes) -> tuple[float, str, int]:
    """Seconds from load_state_dict to the first batch in a fresh loader; the first
    document; the rows (JSON lines) decoded on the way."""
    import pickle

    loader = our_loader(tokenizer, str(folder), True, 0, SEQ)
    start = time.perf_counter()
    loader.load_state_dict(pickle.loads(state))
    batch = next(loader)
    elapsed = time.perf_counter() - start
    return elapsed, batch["spans"][0][0][1], loader.stream.sources[0].rows_decoded


def resume_from_scratch(tokenizer, folder: Path, state: bytes) -> float:
    """Seconds from nothing to the first batch, as a relaunched job pays them: the data
    plan (list, sign and count the files; the length index read from the cache), the
    loader, its state, the first batch."""
    import pickle

    start = time.perf_counter()
    loader = our_loader(tokenizer, str(folder), True, 0, SEQ)
    loader.load_state_dict(pickle.loads(state))
    next(loader)
    return time.perf_counter() - start


PEER_RESUME_TIMEOUT_S = 60


def peer_resume(python: str, folder: Path, fraction: float, repeats: int) -> list[float]:
    """The peer's seconds from nothing to its first batch, per repeat; [] if it did not
    get there within PEER_RESUME_TIMEOUT_S."""
    args = {"files": sorted(str(p) for p in folder.glob("*.parquet")), "fraction": fraction,
            "row_group": 128, "seq_len": SEQ, "batch": BATCH, "repeats": repeats,
            "tokenizer": DEFAULT_TOKENIZER_PATH}  # fmt: skip
    try:
        return bench.run_program(PEER_RESUME, args, python=python, what="the peer",
                                 timeout=PEER_RESUME_TIMEOUT_S)["seconds"]  # fmt: skip
    except subprocess.TimeoutExpired:
        return []  # seen at some positions: datasets' resume waits forever (reported)


# ---- report ----------------------------------------------------------------------------


def summarize(rows: list[dict], resume: dict, resume_side: dict) -> dict:
    """The issue's targets, each as measured: ratio and whether it is met."""

    def rate(corpus, streaming, workers, seq_len=SEQ, side="ours"):
        for r in rows:
            if (r["corpus"], r["streaming"], r["workers"], r["seq_len"]) == (
                corpus, streaming, workers, seq_len):  # fmt: skip
                return r[f"{side}_tokens_per_s"]
        return None

    targets = []
    for corpus in ("bundled", "pydocs") if rows else ():
        for workers in (0, 2):
            ours, peer = rate(corpus, True, workers), rate(corpus, True, workers, side="peer")
            if peer:
                targets.append({"target": f"{corpus} streaming {workers} workers / torchtitan "
                                f"0.3.0 streaming >= 1.0", "ratio": ours / peer,
                                "met": ours / peer >= 1.0})  # fmt: skip
            own = rate(corpus, False, workers)
            targets.append({"target": f"{corpus} streaming / own map-style, {workers} workers "
                            ">= 0.8", "ratio": ours / own, "met": ours / own >= 0.8})  # fmt: skip
    for streaming in (False, True) if rows else ():
        zero, two = rate("bundled", streaming, 0, 128), rate("bundled", streaming, 2, 128)
        kind = "streaming" if streaming else "map-style"
        targets.append({"target": f"seq_len 128 {kind}: 2 workers / 0 workers >= 1.0",
                        "ratio": two / zero, "met": two / zero >= 1.0})  # fmt: skip
    for fmt, r in resume.items():
        targets.append({"target": f"resume at 99% / at 1% ({fmt}) <= 1.3",
                        "ratio": r["ratio_99_over_1"], "met": r["ratio_99_over_1"] <= 1.3})  # fmt: skip
    for label, r in resume_side.items():
        if r["peer_s"]:
            ratio = r["ours_s"] / r["peer_s"]
            targets.append({"target": f"streaming resume to first batch at {label} (parquet): "
                            "ours / torchtitan 0.3.0 <= 1.0", "ratio": ratio, "met": ratio <= 1.0})  # fmt: skip
    return {"targets": targets}


def print_table(result: dict):
    print(
        f"\n{'corpus':<9}{'row':<24}{'seq':>6}{'ours tok/s':>14}{'peer tok/s':>14}{'ours/peer':>11}"
    )
    for r in result["rows"]:
        peer = r["peer_tokens_per_s"]
        ratio = f"{r['ours_over_peer']:.2f}" if peer else "-"
        peer_text = f"{peer:,.0f}" if peer else "-"
        print(f"{r['corpus']:<9}{r['label']:<24}{r['seq_len']:>6}{r['ours_tokens_per_s']:>14,.0f}"
              f"{peer_text:>14}{ratio:>11}")  # fmt: skip
    for fmt, r in result["resume"].items():
        print(f"resume {fmt}: 1% {r['median_1pct_s']:.3f} s, 99% {r['median_99pct_s']:.3f} s, "
              f"ratio {r['ratio_99_over_1']:.2f}; rows decoded {r['rows_decoded']}")  # fmt: skip
    for label, r in result["resume_side_by_side"].items():
        peer = f"{r['peer_s']:.3f} s" if r["peer_s"] else "-"
        if r["peer_timeouts"]:
            peer += f" ({r['peer_timeouts']} runs did not reach a batch within {PEER_RESUME_TIMEOUT_S} s)"
        print(f"resume to first batch at {label} (parquet, from nothing): ours {r['ours_s']:.3f} s, "
              f"peer {peer}")  # fmt: skip
    print()
    for t in result["summary"]["targets"]:
        print(f"{'met ' if t['met'] else 'MISS'} {t['ratio']:6.2f}  {t['target']}")
    if result["peer"]["skipped"]:
        print(f"peer skipped: {result['peer']['skipped']}")


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"rounds": 1, "tokens": 20_000, "pydocs_mb": 0.5,
                                        "resume_mb": 4, "resume_repeats": 1},
                        rounds=3, work=str(WORK), peer=True)  # fmt: skip
    # Two epochs of either corpus (3.4 M and ~3.2 M tokens), so that every row reads the
    # same mix of documents: tokens/s depends on the text (code encodes at other speeds).
    p.add_argument("--tokens", type=int, default=7_000_000, help="tokens per measurement")
    p.add_argument("--pydocs-mb", type=float, default=7.0)
    p.add_argument("--resume-mb", type=int, default=512)
    p.add_argument("--resume-repeats", type=int, default=3)
    p.add_argument("--resume-only", action="store_true", help="skip the tokens/s rows")
    args = p.parse(argv)
    work = Path(args.work)
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    pydocs = build_pydocs(work / "pydocs", args.pydocs_mb)
    where = {"bundled": "bundled", "pydocs": str(pydocs)}

    peer = {"python": args.peer_python, "skipped": "" if args.peer_python else "no --peer-python"}
    measured = {i: {"ours": [], "peer": []} for i in range(len(ROWS))}
    layout = {}
    for _ in range(0 if args.resume_only else args.rounds):
        for i, (label, corpus, streaming, workers, seq_len, with_peer) in enumerate(ROWS):
            rate, layout[i] = our_rate(tokenizer, where[corpus], streaming, workers, seq_len,
                                       args.tokens)  # fmt: skip
            measured[i]["ours"].append(rate)
            print(f"ours {corpus} {label} seq {seq_len}: {rate:,.0f} tokens/s", flush=True)
            if with_peer and not peer["skipped"]:
                files, fmt = corpus_files(corpus, pydocs)
                try:
                    rate, probe = peer_rate(args.peer_python, files, fmt, streaming, workers,
                                            seq_len, args.tokens,
                                            layout[i]["warmup_batches"])  # fmt: skip
                except bench.PeerUnavailable as e:
                    peer["skipped"] = str(e)
                    print(f"peer skipped: {e}", flush=True)
                    continue
                peer["tokens_match"] = probe == tokenizer.encode(PROBE, bos=True, eos=True)
                measured[i]["peer"].append(rate)
                print(f"peer {corpus} {label} seq {seq_len}: {rate:,.0f} tokens/s", flush=True)

    rows = []
    for i, (label, corpus, streaming, workers, seq_len, _) in enumerate(
        [] if args.resume_only else ROWS
    ):
        ours = statistics.median(measured[i]["ours"])
        peer_runs = measured[i]["peer"]
        peer_rate_ = statistics.median(peer_runs) if peer_runs else None
        rows.append({"label": label, "corpus": corpus, "streaming": streaming,
                     "workers": workers, "seq_len": seq_len, "ours_tokens_per_s": ours,
                     "ours_runs": measured[i]["ours"], "peer_tokens_per_s": peer_rate_,
                     "peer_runs": peer_runs,
                     "ours_over_peer": ours / peer_rate_ if peer_rate_ else None,
                     **layout[i]})  # fmt: skip

    resume = {}
    large, built = build_large(work / "large", args.resume_mb)
    for fmt, folder in large.items():
        states = resume_states(tokenizer, folder)
        time_resume(tokenizer, folder, states["1%"])  # warm the page cache
        times, first, decoded = {"1%": [], "99%": []}, {}, {}
        for _ in range(args.resume_repeats):
            for label in ("1%", "99%"):
                elapsed, first[label], decoded[label] = time_resume(
                    tokenizer, folder, states[label]
                )
                times[label].append(elapsed)
        med = {k: statistics.median(v) for k, v in times.items()}
        resume[fmt] = {"seconds": times, "median_1pct_s": med["1%"], "median_99pct_s": med["99%"],
                       "ratio_99_over_1": med["99%"] / med["1%"], "first_document": first,
                       "rows_decoded": decoded,
                       "corpus": built | {"mb": args.resume_mb, "files": 8}}  # fmt: skip

    # Side by side with the peer: parquet, from nothing to the first batch, interleaved.
    folder = large["parquet"]
    states = resume_states(tokenizer, folder)
    side = {label: {"ours": [], "peer": [], "peer_timeouts": 0} for label in ("1%", "99%")}
    for _ in range(args.rounds):
        for label, fraction in (("1%", 0.01), ("99%", 0.99)):
            side[label]["ours"].append(resume_from_scratch(tokenizer, folder, states[label]))
            if not peer["skipped"]:
                try:
                    runs = peer_resume(args.peer_python, folder, fraction, 1)
                except bench.PeerUnavailable as e:
                    peer["skipped"] = str(e)
                    continue
                side[label]["peer"] += runs
                side[label]["peer_timeouts"] += not runs
    resume_side = {
        label: {"ours_s": statistics.median(v["ours"]), "ours_runs": v["ours"],
                "peer_s": statistics.median(v["peer"]) if v["peer"] else None,
                "peer_runs": v["peer"], "peer_timeouts": v["peer_timeouts"]}
        for label, v in side.items()
    }  # fmt: skip

    result = {
        **bench.about(argv), "seq_len": SEQ, "batch": BATCH, "rounds": args.rounds, "tokens": args.tokens,
        "peer": peer, "rows": rows, "resume": resume, "resume_side_by_side": resume_side,
    }  # fmt: skip
    result["summary"] = summarize(rows, resume, resume_side)
    print_table(result)
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
