"""Pretokenized data against on-the-fly tokenization of the same corpus, side by side.

    python scripts/benchmarks/bench_pretokenized.py [--tokens 3000000] [--rounds 3] [--smoke] [--json out.json]

Pretokenizes the bundled corpus (timed, every core) into a temporary folder, then pulls
batches through the loader as training builds and pulls it (``build_dataloader`` from a
config: 1 rank, seq_len 2048, batch 8, 0 workers, map-style) from the original
(SentencePiece on the fly) and from the pretokenized folder, in interleaved rounds, and
reports the medians, their ratio (target >= 20) and whether the first batches of the
two are equal (they must be). Each source's length index is made (or read from the
cache) before any round: it is a start-up cost, not throughput.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan
import torch

from harness import bench
from torchtitan.config import parse_args
from torchtitan.data import ParallelDataLoader, build_dataloader
from torchtitan.data.pretokenized_write import available_cores, pretokenize
from torchtitan.data.sources import resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

SEQ, BATCH = 2048, 8
TARGET = 20.0


def loader(source: list[str], tokenizer) -> ParallelDataLoader:
    """Rank 0 of 1, built from a config as train.py builds it; ``source`` is the
    config's ``--training.dataset NAME`` or ``--training.dataset_path FOLDER``."""
    argv = [*source, "--training.seq_len", str(SEQ), "--training.batch_size", str(BATCH),
            "--training.num_workers", "0", "--training.seed", "0"]  # fmt: skip
    built = build_dataloader(parse_args(argv), tokenizer, 0, 1)
    # On the fly as a pass after the first runs it, every document read tokenized: a first
    # pass reads the tokens its measuring kept instead (bench_firstpass.py).
    for reader in built.stream.readers:
        reader.share_measured = False
    return built


def rate(source: list[str], tokenizer, tokens: int) -> float:
    """Tokens/s through a fresh loader, after two batches of start-up."""
    batches = loader(source, tokenizer)
    for _ in range(2):
        next(batches)
    n = max(1, tokens // (SEQ * BATCH))
    start = time.perf_counter()
    for _ in range(n):
        next(batches)
    return n * SEQ * BATCH / (time.perf_counter() - start)


def same_batches(a, b, tokenizer, n: int) -> bool:
    x, y = loader(a, tokenizer), loader(b, tokenizer)
    return all(
        torch.equal(p["input"], q["input"]) and torch.equal(p["label"], q["label"])
        and p["spans"] == q["spans"]
        for p, q in ((next(x), next(y)) for _ in range(n))
    )  # fmt: skip


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"tokens": 40_000, "rounds": 1}, rounds=3, work="")
    p.add_argument("--tokens", type=int, default=3_000_000, help="tokens per on-the-fly round")
    args = p.parse(argv)
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    with bench.work_folder(args, "bench_pretokenized_") as work:
        folder = str(work / "pretokenized")
        shutil.rmtree(folder, ignore_errors=True)  # pretokenize writes into an empty folder
        workers = available_cores()
        start = time.perf_counter()
        manifest = pretokenize(resolve_source(name="bundled"), tokenizer, folder, workers=workers)
        pretokenize_s = time.perf_counter() - start
        original = ["--training.dataset", "bundled"]
        pretokenized = ["--training.dataset_path", folder]
        for order in loader(original, tokenizer).stream.orders:
            order.pass_tokens()  # the counts, whole, before any round (a start-up cost)
        equal = same_batches(original, pretokenized, tokenizer, 4 if args.smoke else 16)
        # Interleaved rounds: drift on a shared machine hits both alike. The pretokenized
        # side reads 10x the tokens so that its rounds last long enough to time.
        fly, pre = [], []
        for _ in range(args.rounds):
            fly.append(rate(original, tokenizer, args.tokens))
            pre.append(rate(pretokenized, tokenizer, 10 * args.tokens))
    result = {
        "on_the_fly_tokens_per_s": statistics.median(fly),
        "pretokenized_tokens_per_s": statistics.median(pre),
        "rounds": {"on_the_fly": fly, "pretokenized": pre},
        "same_batches": equal,
        "corpus_tokens": manifest["tokens"],
        "corpus_documents": manifest["documents"],
        "pretokenize_s": pretokenize_s,
        "pretokenize_workers": workers,
        "target": TARGET,
    }
    result["pretokenized_over_on_the_fly"] = (
        result["pretokenized_tokens_per_s"] / result["on_the_fly_tokens_per_s"]
    )
    bench.print_table(["measure", "value"], [
        *([key, f"{result[key]:,.0f}"]
          for key in ("on_the_fly_tokens_per_s", "pretokenized_tokens_per_s")),
        [f"pretokenized / on the fly (target >= {TARGET:g})",
         f"{result['pretokenized_over_on_the_fly']:.1f}"],
        ["same batches (torch.equal)", equal],
        [f"pretokenize, s ({workers} workers)", f"{pretokenize_s:.2f}"],
    ])  # fmt: skip
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
