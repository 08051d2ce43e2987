"""Offline preparation: every unit's token counts measured ahead of a job, on CPU cores.

Owns: listing the units of a job's sources whose counts are not in the folder yet, and
measuring them in ``num_proc`` worker processes (``multiprocessing``, each with its own
sources and tokenizer), through the same ``index.SourceCounts`` a job uses: the same
content-keyed files, the same claims. So a job started later never waits, a job running
alongside takes the units this has not reached (and this skips the units it claims),
and a preparation killed part way goes on where it stopped when run again.

Cost: the corpus read and tokenized once, split over ``num_proc`` processes (at ~1 M
tokens/s a core: c4/en's 156 B tokens in about 5 h on 8 cores, FineWeb's 15 T in about
4 days on 100 machines of 32 cores, each running this command with the folder shared);
memory per process O(one unit). Progress on rank 0's terminal as a bar, in a log as a
line every ``index.PROGRESS_EVERY_S``.

Never: train, or write anything a job would not write itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time

from torchtitan.data import index as length_index

logger = logging.getLogger(__name__)

_STREAM = None  # a worker's token stream over the job's sources


def _start_worker(training, tokenizer):
    from torchtitan.data import build_stream

    global _STREAM
    _STREAM = build_stream(training, tokenizer)
    for order in _STREAM.orders:
        order.counts.log = False
        # No reader follows: the tokens measured are not kept (a sidecar a unit would be
        # the whole corpus's tokens on disk).
        order.counts.share_tokens = False


def _measure(task: tuple[int, tuple]) -> tuple[int, int]:
    """(units measured here: 0 where another process had or took it, tokens)."""
    s, unit = task
    counts = _STREAM.orders[s].counts
    before = counts.measured
    total = counts.counts(unit).total
    return counts.measured - before, total


def missing_units(stream) -> list[tuple[int, tuple]]:
    """``(source, unit)`` of every unit of every source whose counts are not in the
    folder. Cost: one stat per unit."""
    out = []
    for s, order in enumerate(stream.orders):
        for unit in order.units(order.source.extent()):
            unit = tuple(int(x) for x in unit)
            if not order.counts.has(unit):
                out.append((s, unit))
    return out


def prepare(training, tokenizer, num_proc: int = 0, progress=None) -> dict:
    """Measure every unit of the job's sources that has no counts yet, in ``num_proc``
    processes (0: every core). Returns ``{"units", "missing", "measured", "tokens",
    "seconds"}`` (``measured``: by this command; the rest of ``missing`` by processes
    running alongside)."""
    from torchtitan.data import build_stream

    begin = time.monotonic()
    stream = build_stream(training, tokenizer)
    units = sum(len(o.units(o.source.extent())) for o in stream.orders)
    todo = missing_units(stream)
    procs = num_proc or multiprocessing.cpu_count()
    measured = tokens = 0
    bar = _bar(len(todo), progress)
    context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    with context.Pool(procs, initializer=_start_worker, initargs=(training, tokenizer)) as pool:
        for done, (here, count) in enumerate(pool.imap_unordered(_measure, todo, chunksize=1), 1):
            measured, tokens = measured + here, tokens + count
            bar(done, tokens, time.monotonic() - begin)
    return {"units": units, "missing": len(todo), "measured": measured, "tokens": tokens,
            "seconds": time.monotonic() - begin}  # fmt: skip


def _bar(total: int, progress):
    """A callback ``(done, tokens, seconds)``: a tqdm bar on a terminal, else a log line
    every ``PROGRESS_EVERY_S`` (units done of total, tokens/s, time left)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="unit", desc="token counts")

        def update(done, tokens, seconds):
            bar.n = done
            bar.set_postfix(tokens_per_s=f"{tokens / max(seconds, 1e-9):,.0f}")
            bar.refresh()
            if done == total:
                bar.close()

        return update
    last = [time.monotonic()]

    def log(done, tokens, seconds):
        now = time.monotonic()
        if now - last[0] < length_index.PROGRESS_EVERY_S and done < total:
            return
        last[0] = now
        left = (total - done) * seconds / max(done, 1)
        logger.info("token counts: %d of %d units, %.0f tokens/s, about %.0f s left",
                    done, total, tokens / max(seconds, 1e-9), left)  # fmt: skip

    return log
