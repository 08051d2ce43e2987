"""Data pipeline throughput and state size, measured side by side in one run.

    python scripts/benchmarks/bench_data.py [--tokens 3000000] [--smoke] [--json out.json]

Measures, on the bundled corpus, through the loader as training builds and pulls it
(``build_dataloader`` from a config, seq_len 2048, batch 8):
  raw      SentencePiece ``encode_batch`` over the documents the pipeline tokenized, in this process
  workers0 the full pipeline (HF datasets -> tokenize -> window -> torch DataLoader), num_workers=0
  workers2 the same with num_workers=2
and reports tokens/s, the ratios workers0/raw and workers2/workers0, and the
dataloader state size per rank (pickled bytes) at 1 and 2 ranks, map-style and
streaming, after a few batches and at 99 % of the epoch. The length index of each
corpus is made (or read from the cache) when its first loader is built, before any
timing: it is a start-up cost, not throughput.
"""

from __future__ import annotations

import statistics
import sys
import time

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.sources import MapSource, resolve_source
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

SEQ, BATCH = 2048, 8


def raw_encode_rate(tokenizer, texts: list[str]) -> float:
    start = time.perf_counter()
    n = sum(len(ids) + 2 for ids in tokenizer.encode_batch(texts))  # +2: BOS/EOS, as the pipeline
    return n / (time.perf_counter() - start)


def loader(tokenizer, workers: int, world: int = 1, streaming: bool = False):
    """Rank 0 of ``world``, built from a config as train.py builds it."""
    argv = ["--training.dataset", "bundled", "--training.seq_len", str(SEQ),
            "--training.batch_size", str(BATCH), "--training.num_workers", str(workers),
            "--training.seed", "0"]  # fmt: skip
    if streaming:
        argv.append("--training.streaming")
    built = build_dataloader(parse_args(argv), tokenizer, 0, world)
    # The pipeline as a pass after the first runs it, every document read tokenized: a
    # first pass reads the tokens its measuring kept instead (bench_firstpass.py).
    for reader in built.stream.readers:
        reader.share_measured = False
    return built


def pipeline_rate(
    tokenizer, workers: int, tokens: int, streaming: bool = False
) -> tuple[float, set[str]]:
    """Tokens/s of the full pipeline, and the ids of the documents it tokenized."""
    batches = loader(tokenizer, workers, streaming=streaming)
    # start-up (worker processes, first documents) is not throughput
    for _ in range(2 + 2 * workers):
        next(batches)
    n = max(1, tokens // (SEQ * BATCH))
    docs = set()
    start = time.perf_counter()
    for _ in range(n):
        batch = next(batches)
        docs.update(span[1] for seq in batch["spans"] for span in seq)
    rate = n * SEQ * BATCH / (time.perf_counter() - start)
    del batches
    return rate, docs


def state_bytes(tokenizer, world: int, streaming: bool, workers: int = 0, at: float = 0.0) -> int:
    """Pickled bytes of rank 0's entry after 4 steps, from the start or from ``at`` of
    the epoch (a seek: the position a checkpoint taken there would hold)."""
    batches = loader(tokenizer, workers, world, streaming)
    if at:
        stream = batches.stream
        tokens = sum(int(at * order.pass_tokens()) for order in stream.orders)
        batches.seek(stream.position_after(tokens // stream.window_size))
    for _ in range(4):
        batches.next_step()
    return len(next(iter(batches.state_dict().values())))


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"tokens": 40_000, "rounds": 1}, rounds=3)
    p.add_argument("--tokens", type=int, default=3_000_000, help="tokens per pipeline measurement")
    args = p.parse(argv)
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)

    source = MapSource(resolve_source(name="bundled"), "text", "id")
    text_of = dict(zip(source.ds["id"], source.ds["text"]))
    # Interleaved rounds, so drift on a shared machine hits every measurement alike.
    # The raw rate is measured on exactly the documents the pipeline tokenized.
    raw, w0, w2 = [], [], []
    for _ in range(args.rounds):
        rate, docs = pipeline_rate(tokenizer, 0, args.tokens)
        w0.append(rate)
        raw.append(raw_encode_rate(tokenizer, [text_of[d] for d in sorted(docs)]))
        w2.append(pipeline_rate(tokenizer, 2, args.tokens)[0])
    # Medians: this machine's speed drifts by tens of percent.
    result = {
        "raw_encode_tokens_per_s": statistics.median(raw),
        "workers0_tokens_per_s": statistics.median(w0),
        "workers2_tokens_per_s": statistics.median(w2),
        "streaming_workers0_tokens_per_s": pipeline_rate(tokenizer, 0, args.tokens, streaming=True)[
            0
        ],
        "state_bytes_per_rank": {
            "map_1rank": state_bytes(tokenizer, 1, False),
            "map_2ranks": state_bytes(tokenizer, 2, False),
            "map_1rank_2workers": state_bytes(tokenizer, 1, False, workers=2),
            "streaming_2ranks": state_bytes(tokenizer, 2, True),
            "map_2ranks_at_99pct": state_bytes(tokenizer, 2, False, at=0.99),
        },
    }
    result["workers0_over_raw"] = (
        result["workers0_tokens_per_s"] / result["raw_encode_tokens_per_s"]
    )
    result["workers2_over_workers0"] = (
        result["workers2_tokens_per_s"] / result["workers0_tokens_per_s"]
    )
    rows = [[key, f"{result[key]:,.0f}", ""] for key in (
        "raw_encode_tokens_per_s", "workers0_tokens_per_s", "workers2_tokens_per_s",
        "streaming_workers0_tokens_per_s")]  # fmt: skip
    rows += [["workers0 / raw", f"{result['workers0_over_raw']:.3f}", ">= 0.85"],
             ["workers2 / workers0", f"{result['workers2_over_workers0']:.3f}", ">= 1.6"]]  # fmt: skip
    rows += [[f"state bytes/rank {key}", f"{value:,}", "<= 16,384"]
             for key, value in result["state_bytes_per_rank"].items()]  # fmt: skip
    bench.print_table(["measure", "value", "target"], rows)
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
