"""Traces and memory views of a few steps: ``[profiling]``.

Owns: the torch profiler around the training loop on rank 0 and one more rank (the
last: on a multi-node job, another node), a Chrome/Perfetto trace of every
``profile_freq``-th step (``<save_traces_folder>/iteration_<step>/rank<r>_trace.json``),
and a memory view of the same steps: on CUDA, with ``enable_memory_snapshot``, the
caching allocator's snapshot (``rank<r>_memory_snapshot.pickle``, for
pytorch.org/memory_viz); on CPU, where there is no allocator history, a text summary
(peak resident memory and the operators that allocated most).

Cost: nothing on ranks that do not trace; on the two that do, the profiler's overhead
during the one active step of every ``profile_freq`` (a warmup step before it).

Never: change what a step computes, or draw from an RNG.
"""

from __future__ import annotations

import logging
import os
import resource

import torch

logger = logging.getLogger("torchtitan")

# Allocator events kept for the CUDA memory snapshot (torchtitan uses the same order).
MEMORY_HISTORY_ENTRIES = 100_000


def tracing_ranks(world_size: int) -> set[int]:
    """Rank 0 and the last rank (one trace per node of a two-node job, say)."""
    return {0, world_size - 1}


class Profiler:
    """``with Profiler(cfg, rank, world_size) as p:`` around the loop; ``p.step(n)`` after
    each training step ``n``. Inactive (and free) unless ``profiling.enable_profiling``
    and this rank traces."""

    def __init__(self, cfg, rank: int, world_size: int):
        p = cfg.profiling
        self.rank = rank
        self.active = p.enable_profiling and rank in tracing_ranks(world_size)
        self.freq = p.profile_freq
        self.folder = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
        self.memory = p.enable_memory_snapshot
        self._profiler = None
        self._step = 0

    def __enter__(self):
        if not self.active:
            return self
        cuda = torch.cuda.is_available()
        if cuda and self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # One warmup step, then one active step, ending at every profile_freq-th step.
        schedule = torch.profiler.schedule(
            wait=max(0, self.freq - 2), warmup=min(1, self.freq - 1), active=1
        )
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._write,
            record_shapes=True,
            profile_memory=not cuda,  # the CPU memory summary needs it
        )
        self._profiler.__enter__()
        return self

    def step(self, step: int):
        if self._profiler is not None:
            self._step = step
            self._profiler.step()

    def _write(self, prof):
        folder = os.path.join(self.folder, f"iteration_{self._step}")
        os.makedirs(folder, exist_ok=True)
        trace = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(trace)
        if torch.cuda.is_available():
            if self.memory:
                torch.cuda.memory._dump_snapshot(
                    os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
                )
        elif self.memory:
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            table = prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=20)
            with open(os.path.join(folder, f"rank{self.rank}_memory.txt"), "w") as f:
                f.write(
                    f"peak resident memory of rank {self.rank}: {peak_mib:.1f} MiB\n\n{table}\n"
                )
        logger.info("step %d: profiler trace written to %s", self._step, trace)

    def __exit__(self, *exc):
        if self._profiler is not None:
            self._profiler.__exit__(*exc)
            self._profiler = None
            if torch.cuda.is_available() and self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
        return False
