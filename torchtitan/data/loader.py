"""The data-parallel loader: a rank's micro-batches of the global stream, with its own state.

Owns: the steps a rank hands out, by the batch-size schedule (schedule.py: which
windows of a step each data-parallel rank reads and how they split into its
micro-batches), the worker processes that read them
(each ends with its rank, however the rank dies), and the loader state as checkpointed.

A step takes the next ``G`` windows of the global order (order.py), grouped by the unit
each starts in. Rank ``r`` of ``R`` reads a contiguous slice of them, ``G // R`` windows, one more for the first ``G % R``
ranks, so any rank count works, and split into the step's ``A`` micro-batches (the same
``A`` on every rank: ``ceil((G // R) / training.batch_size)``; a rank with the one
window more may have a micro-batch of ``batch_size + 1``). Each micro-batch
carries the weight that makes the averaged gradient the one of the global batch's mean
loss, however unevenly the windows fell (``loss_weight = R * n / G``).

The state is the position after the last step handed out in full: windows taken and a
cursor per source (windows.Position: a few integers per lane), the same on every rank,
and the skips (``training.skip_steps``, a rewind's): the data of given steps passed over
(``plan_steps``), a few integers each. Saving it costs
nothing and no worker round-trip; resuming on any layout, batch size or sequence length
is a seek to it. Workers prefetch from there without changing it.

Workers split the windows, not the micro-batches: worker ``w`` of ``W`` reads the
windows that start in the units ``window_owner`` gives it (by the unit's place in its
pass, so the ``LANES`` units open at once fall evenly to the workers). A lane reads its
unit's windows one after another, each cutting a document that the next one continues:
one worker reading them all tokenizes that document once, and decodes the unit's rows
once. (Dealing out whole micro-batches, each of which holds a window of many lanes, had
every worker tokenize most boundary documents: 1.75 x the tokens with 2 workers, which
then read barely faster than none.) A worker sends its windows of a *run* of
consecutive micro-batches (enough for ``GROUP_TOKENS`` tokens) in one message, as numpy
arrays (a message costs both sides more than a small window does); this process takes
each worker's run in turn, collates each micro-batch from its windows and hands them
out in order.

Workers start once and follow the rank's plan: a seek, a new step number, new skips or
a new split (``reshard``: fault tolerance's participants changed) publish a *request*
(the step, position, rank, schedule and skips to plan from) in memory the rank and its
workers share (``Requests``); a worker looks at its generation before each micro-batch it
makes, drops what it was making for an older one and plans from the new request, and
the rank drops the groups of older requests still on their way. A change costs the
micro-batches in flight, never a worker restart.

Never: decide which data comes next (order.py, windows.py), touch checkpoint files or
import the checkpoint package.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from torchtitan.data import state
from torchtitan.data.schedule import BatchSchedule
from torchtitan.data.spec import DataError
from torchtitan.data.windows import DocumentReader, Position, TokenStream, collate

logger = logging.getLogger(__name__)

# Tokens a worker sends per message at least (in whole micro-batches, at most MAX_GROUP):
# a message costs ~0.5 ms between pickling, queueing and polling, more than a batch of
# 8 x 128 tokens takes to make, and nothing next to one of 8 x 2048.
GROUP_TOKENS = 16_384
MAX_GROUP = 64
# Micro-batches a run holds at least: each worker's message carries its windows of the
# run (about 1 / W of them), so short runs would make messages of a window or two.
MIN_GROUP = 4


# Steps a process plans beyond the one it reads, fetching the blocks of its windows in
# them early (streaming.BlockPrefetch: remote parquet and text; elsewhere only planned).
PREFETCH_STEPS = 4


def window_owner(source: int, pieces: list, workers: int) -> int:
    """The loader worker that reads the window ``(source, pieces)``: by the unit it starts
    in, its place ``k`` in its pass's order (units are taken in that order, so the units
    open in the lanes at any moment alternate between workers). Every window of a unit is
    one worker's; only a window that runs on into its lane's next unit reads a document
    the next unit's worker reads too."""
    pass_, k = pieces[0][0], pieces[0][1]
    return (source + pass_ + k) % workers


def group_size(batch_size: int, seq_len: int, num_workers: int) -> int:
    """Micro-batches per worker message (each worker sends its windows of them): 1
    without workers."""
    if not num_workers:
        return 1
    return min(MAX_GROUP, max(MIN_GROUP, -(-GROUP_TOKENS // (batch_size * (seq_len + 1)))))


@dataclass
class StepPlan:
    """One step as this rank reads it: its micro-batches' windows ``(source, pieces)``,
    their loss weights, and the position after the whole step."""

    step: int
    global_batch: int
    micro: list[list[tuple[int, int]]]
    weights: list[float]
    after: Position
    skipped: list = field(default_factory=list)  # [first, steps, lo, hi] passed over before it
    windows_skipped: list = field(default_factory=list)  # [lo, hi] passed over in it


def _take(stream: TokenStream, position: Position, count: int, step: int, window_skips):
    """``count`` windows from ``position`` at ``step``'s weights, passing over the window
    ranges ``window_skips`` ((first, windows)) as the position reaches them; the windows,
    the position after, and the ranges passed over."""
    if not window_skips:
        windows, after = stream.advance(position, count, step)
        return windows, after, []
    taken, passed = [], []
    while count:
        # Passed over when the step's next window would be in it (a range reached at a
        # step's end is the next step's: the same whether the run resumed there or not).
        for lo, n in window_skips:  # sorted: a range may follow another at once
            if lo <= position.windows < lo + n:
                start = position.windows
                _, position = stream.advance(position, lo + n - start, step)
                passed.append([start, position.windows])
        ahead = [lo for lo, _ in window_skips if lo > position.windows]
        n = min([count, *(lo - position.windows for lo in ahead)])
        windows, position = stream.advance(position, n, step)
        taken += windows
        count -= n
    return taken, position, passed


def plan_steps(stream: TokenStream, schedule: BatchSchedule, rank: int, step: int,
               position: Position, skips=(), window_skips=()):  # fmt: skip
    """This rank's steps from ``position`` on, endlessly. Cost: O(global batch) per step
    of arithmetic, and the token counts of the units the step's windows lie in (measured
    just in time where no one has); no document is read.

    ``skips``: ``(first, steps)`` in training steps (1-based; the loader's step is
    0-based): before training step ``first``, the windows that ``steps`` steps from it
    would read are passed over, each of those steps at its own global batch and mix
    weights, as if they trained: exactly the windows a run that trained them read
    (their documents are dropped for this pass: never read, never tokenized). Cost: the
    same arithmetic per skipped window as per window trained, nothing read, once, in every
    process that plans (each rank and each loader worker): measured through
    ``next_step`` 0.019 ms a window (0.049 ms with a loader worker, which plans too) on
    the 2-core CPU at load 5, about half that on a quiet one, linear in the windows
    skipped, so a PaLM-sized skip of 500 steps of 2048 sequences (1 M windows) costs
    20-50 s once; it
    grows with the windows skipped, not with the corpus (the same at c4's 365 M documents
    as at FineWeb's 15 T tokens).

    ``window_skips``: ``(first window, windows)`` ranges of the global order passed over
    when the position reaches them, at the weights of the step that reaches them (a
    step then reads the next windows after the range, in two or more pieces)."""
    while True:
        skipped = []
        for first, count in skips:
            if first - 1 == step:
                lo = position.windows
                for j in range(step, step + count):
                    _, position = stream.advance(position, schedule.global_batch(j), j)
                skipped.append([first, count, lo, position.windows])
        size = schedule.global_batch(step)
        # grouped by unit (see there), each piece between window skips on its own
        windows, after, passed = _take(stream, position, size, step, window_skips)
        lo, hi = schedule.rank_slice(size, rank)
        sizes = schedule.micro_sizes(hi - lo, schedule.accumulation(size))
        micro, i = [], lo
        for n in sizes:
            micro.append(windows[i : i + n])
            i += n
        weights = [schedule.dp_world * n / size for n in sizes]
        yield StepPlan(step, size, micro, weights, after, skipped, passed)
        position, step = after, step + 1


@dataclass
class WorkerRequest:
    """What a loader's workers plan from: the rank's ``plan_steps`` arguments and the
    micro-batches per message."""

    step: int
    position: Position
    rank: int
    schedule: BatchSchedule
    skips: list
    window_skips: list
    group: int


# Bytes of the shared request at least: a position of a few lanes per source and a few
# skips take hundreds; a request that outgrows the buffer restarts the workers with one
# four times its size.
REQUEST_BYTES = 1 << 16


class Requests:
    """The request a loader's workers follow, in memory the rank and its workers share
    (made before they fork): a generation number, bumped by each request, and the
    request pickled (it crosses between the processes of one rank, never to disk). A
    worker reads the generation, one shared integer, before each micro-batch it makes.
    Cost: one pickle and copy of the request per change (a few hundred bytes: it grows
    with the sources' lanes and the skips, never with the corpus, the same at c4's 365 M
    documents as at FineWeb's 15 T tokens); nothing per batch but the integer's read."""

    def __init__(self, capacity: int):
        ctx = multiprocessing.get_context()
        self._lock = ctx.Lock()
        self._gen = ctx.RawValue(ctypes.c_int64, 0)
        self._size = ctx.RawValue(ctypes.c_int64, 0)
        self._buf = ctx.RawArray(ctypes.c_ubyte, capacity)

    def fits(self, payload: bytes) -> bool:
        return len(payload) <= len(self._buf)

    def publish(self, payload: bytes) -> int:
        """Make ``payload`` (a pickled ``WorkerRequest``) the workers'; its generation."""
        with self._lock:
            ctypes.memmove(self._buf, payload, len(payload))
            self._size.value = len(payload)
            self._gen.value += 1
            return self._gen.value

    @property
    def generation(self) -> int:
        return self._gen.value

    def read(self) -> tuple[int, WorkerRequest]:
        with self._lock:
            payload = bytes(memoryview(self._buf)[: self._size.value])
            return self._gen.value, pickle.loads(payload)


def fetching_ahead(plans, stream: TokenStream, depth: int, mine=lambda s, pieces: True):
    """``plans``, each handed out once the ``depth`` steps after it are planned (fewer for
    the first ``depth`` steps: step ``k`` plans ``k`` ahead) and the blocks this process
    will decode in them are asked of their sources
    (``StreamSource.fetch_ahead``), which fetch them while this step is read.
    ``mine(source, pieces)``: whether this process reads that window: a loader worker
    fetches only what it reads. What a step asked and left untaken is dropped
    once the step is read (the next plan is asked for).

    The plans are the same with or without it (only planned earlier): it changes when
    bytes are fetched, never what is read. Cost: ``depth`` plans held (O(depth x global
    batch) integers) and the units of this process's windows in them, and the counts of
    their units measured ``depth`` steps earlier; per rank, whatever the corpus (c4's
    365 M documents or FineWeb's 15 T tokens: a few hundred units named, the fetched blocks
    bound by streaming.PREFETCH_BLOCKS / PREFETCH_BYTES)."""
    if depth <= 0 or not any(src.prefetch for src in _fetching_sources(stream)):
        yield from plans
        return
    stream.planned_ahead = depth  # the measured tokens let go are those of steps read
    seen = [OrderedDict() for _ in stream.sources]  # units this process read, by source
    ahead: deque = deque()
    handed = 0
    for plan in plans:
        _ask_ahead(stream, plan, mine, seen)
        ahead.append(plan)
        # One plan more ahead each step up to ``depth``: the first step waits for its own
        # plan only (on a corpus's first pass planning measures, tokenizing units).
        if len(ahead) > min(depth, handed):
            handed += 1
            done = ahead.popleft()
            yield done
            for src in _fetching_sources(stream):  # the step was read whole
                src.prefetch.release(done.step)


def _fetching_sources(stream: TokenStream) -> list:
    return [src for src in stream.sources if getattr(src, "prefetch", None) is not None]


def _ask_ahead(stream: TokenStream, plan: StepPlan, mine, seen: list):
    """Ask the sources for the blocks of the units this process reads first in ``plan``'s
    windows (those ``mine`` says it reads; a unit it read before is kept read:
    windows.DocumentReader.KEEP_READS) whose text is read (no measured tokens serve them)."""
    first: list[list] = [[] for _ in stream.sources]
    for windows in plan.micro:
        for s, pieces in windows:
            if mine(s, pieces):
                for *_, hi, unit in pieces:
                    unit = tuple(int(x) for x in unit)
                    if unit in seen[s]:
                        seen[s].move_to_end(unit)
                        continue
                    seen[s][unit] = None
                    if len(seen[s]) > DocumentReader.KEEP_READS:
                        seen[s].popitem(last=False)
                    counts = stream.orders[s].counts.counts(unit, upto=hi)
                    if stream.readers[s].reads_text(unit, counts):
                        first[s].append(unit)
    for s, units in enumerate(first):
        fetch_ahead = getattr(stream.sources[s], "fetch_ahead", None)
        if units and fetch_ahead is not None:
            fetch_ahead(units, plan.step)


class WorkerBatches(IterableDataset):
    """What one loader worker yields: ``(generation, worker, windows)``, one message per
    run of ``group`` consecutive micro-batches of the plan the rank's latest request
    sets: this worker's windows of them (``window_owner``), each ``(micro-batch, index in
    it, tokens, spans)``, in order; a run with none of its windows is an empty message
    (every worker sends every run: the rank takes them in turn)."""

    def __init__(self, loader: ParallelDataLoader, requests: Requests):
        self.stream, self.requests = loader.stream, requests
        self.prefetch_steps = loader.prefetch_steps

    def __iter__(self):
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info else (1, 0)
        for order in self.stream.orders:  # a worker reads windows: it keeps what it measures
            _keep_measured_tokens(order.counts, True)
        while True:  # one plan per request, for the worker's life
            generation, request = self.requests.read()
            yield from self._follow(generation, request, workers, me)

    def _follow(self, generation: int, r: WorkerRequest, workers: int, me: int):
        """This worker's runs of request ``generation``'s plan, until a newer request."""
        m, out = 0, []
        plans = plan_steps(self.stream, r.schedule, r.rank, r.step, r.position, r.skips,
                           r.window_skips)  # fmt: skip
        # mutant worker-owns-every-window: `window_owner(s, pieces, workers) == me` -> `True`; test/data/test_loader.py::test_workers_give_the_batches_of_the_main_process
        mine = lambda s, pieces: window_owner(s, pieces, workers) == me  # noqa: E731
        for plan in fetching_ahead(plans, self.stream, self.prefetch_steps, mine):
            for windows in plan.micro:
                if self.requests.generation != generation:
                    for src in _fetching_sources(self.stream):  # fetched for that plan
                        src.prefetch.clear()
                    return  # what it was making is for a plan the rank left
                for j, (s, pieces) in enumerate(windows):
                    if not mine(s, pieces):
                        continue
                    try:
                        out.append((m, j, *self.stream.window(s, pieces)))
                    except DataError as e:  # crosses as a value: one line, not a traceback
                        while self.requests.generation == generation:  # until a new plan
                            yield generation, me, [{"data_error": str(e)}]
                        return
                m += 1
                if m % r.group == 0:
                    yield generation, me, out
                    out = []


# Signals that ask a job to stop (schedulers send SIGTERM or SIGUSR1 to the whole
# process group, workers included). The rank decides when to stop and shuts its
# workers down; a worker killed by one would instead break the rank's next batch and
# the save it was about to make.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
WORKER_STOP_S = 5.0  # how long a closing loader waits for its workers before killing them


def _leave_stop_signals_to_the_rank(rank_pid: int, stop_fd: int, worker_id: int):
    """A worker's start (it runs in the worker): stop signals are the rank's to act on,
    and the worker ends the moment its rank does, or its loader tells it to through
    ``stop_fd`` (``_exit_with``)."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _exit_with(rank_pid, stop_fd)


def _exit_with(rank_pid: int, stop_fd: int):
    """End this worker as soon as process ``rank_pid`` is gone, however it died, or as
    soon as ``stop_fd`` (the read end of its loader's pipe) is readable.

    Ignoring the stop signals, an orphaned worker would otherwise live on for good
    (torch's own check runs only while it waits for work, and its exit then waits on a
    pipe nobody reads), holding the rank's memory and the sockets it inherited at fork:
    the other ranks' collectives would not see the rank go. A daemon thread waits on a
    pidfd of the rank (readable when it exits; Linux 5.3+), else polls the parent pid
    twice a second. It exits with status 0: torch's SIGCHLD handler in the rank raises
    for a worker killed by a signal, not for one that exited. Cost: one idle thread per
    worker; no work per batch.
    """
    try:
        pidfd = os.pidfd_open(rank_pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        pidfd = None
    if os.getppid() != rank_pid:  # the rank died before the pidfd was opened
        os._exit(0)
    threading.Thread(target=_wait_for_exit, args=(rank_pid, pidfd, stop_fd), daemon=True,
                     name="exit-with-rank").start()  # fmt: skip


def _wait_for_exit(rank_pid: int, pidfd: int | None, stop_fd: int):
    waiter = select.poll()  # not select(): the fds may be above 1023
    waiter.register(stop_fd, select.POLLIN)
    if pidfd is not None:
        waiter.register(pidfd, select.POLLIN)
        waiter.poll()
    else:
        while os.getppid() == rank_pid and not waiter.poll(500):
            pass
    os._exit(0)  # not sys.exit: nothing of an orphan's exit may wait on the rank


def _keep_measured_tokens(counts, keep: bool):
    """Whether a process measures token counts and keeps the tokens it measures in memory
    (index.SourceCounts): one that reads windows does; a rank whose workers read leaves
    both to them (they plan the same steps ahead of it: it reads their counts)."""
    if hasattr(counts, "keeps_tokens"):
        counts.keeps_tokens = counts.measures = keep


def _as_is(group: list[dict]) -> list[dict]:
    return group


# Loaders whose workers run. Workers ignore SIGTERM (above), and at interpreter exit
# multiprocessing stops its daemon children with SIGTERM and then joins them: a loader
# still referenced then (a module global, a traceback) would hang the exit. So its
# workers are shut down first (atexit runs this before multiprocessing's own handler,
# registered earlier).
_RUNNING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_running_loaders():
    for loader in list(_RUNNING):
        loader.close()


class ParallelDataLoader:
    """Micro-batches for one data-parallel rank, with a checkpoint entry per rank (torch's
    ``Stateful`` protocol: ``state_dict``, ``load_state_dict``; its format, writer and
    data check are state.py's)."""

    def __init__(self, stream: TokenStream, schedule: BatchSchedule, *, dp_rank: int = 0,
                 num_workers: int = 0, document_layout: bool = False):  # fmt: skip
        self.stream, self.schedule = stream, schedule
        self.dp_rank, self.dp_world = dp_rank, schedule.dp_world
        self.num_workers = num_workers
        # Steps planned ahead of the one read, their blocks fetched early (0: none).
        self.prefetch_steps = PREFETCH_STEPS
        # Micro-batches are collated here, from windows read here or by the workers.
        self.collate = functools.partial(collate, document_layout=document_layout)
        self.group = group_size(schedule.micro, stream.seq_len, num_workers)
        for order in stream.orders:  # with workers, this process reads no window
            _keep_measured_tokens(order.counts, not num_workers)
        self.position = stream.start()  # after the last step handed out in full
        self.step = 0  # the step the next micro-batch belongs to
        self._plans = None
        self._plan: StepPlan | None = None
        self._i = 0  # micro-batches of self._plan handed out
        self._loader: DataLoader | None = None
        self._iter = None
        self._workers: list = []  # this loader's worker processes (multiprocessing's)
        self._stop_pipe: tuple[int, int] | None = None  # written to end stuck workers
        self._requests: Requests | None = None  # the plan the workers follow
        self._generation = 0  # the request the batches handed out must be of
        self._held: list[deque] = []  # per worker: its micro-batches received, in order
        self._m = 0
        self._epoch_starts: list[list] = []
        self.last_global_batch = 0  # sequences of the last step handed out in full
        # Data passed over (training.skip_steps, a rewind): (first step, steps), in order;
        # and the windows [lo, hi) of those already passed over, by (first, steps).
        self.skips: list[tuple[int, int]] = []
        self.window_skips: list[tuple[int, int]] = []  # (first window, windows)
        self.skipped_windows: dict[tuple[int, int], tuple[int, int]] = {}
        self._passed_over: list[list[int]] = []  # [first, steps, lo, hi] since the last call

    # ---- iteration ----------------------------------------------------------------------
    def _start(self):
        self._plans = plan_steps(self.stream, self.schedule, self.dp_rank, self.step,
                                 self.position, self.skips, self.window_skips)  # fmt: skip
        if not self.num_workers:  # with workers, each fetches ahead what it reads
            self._plans = fetching_ahead(self._plans, self.stream, self.prefetch_steps)
        self._plan, self._i, self._m = None, 0, 0
        if not self.num_workers:
            return
        request = pickle.dumps(WorkerRequest(self.step, self.position.copy(), self.dp_rank,
                                             self.schedule, list(self.skips),
                                             list(self.window_skips), self.group))  # fmt: skip
        if self._iter is not None and not self._requests.fits(request):
            self._stop_workers()
        if self._iter is None:
            self._requests = Requests(max(REQUEST_BYTES, 4 * len(request)))
            self._generation = self._requests.publish(request)
            self._start_workers()
        else:  # running workers follow the new plan: a seek, not a restart
            self._generation = self._requests.publish(request)
        self._held = [deque() for _ in range(self.num_workers)]

    def _start_workers(self):
        # The loader's own generator: the iterator draws a base seed when it starts, and
        # from the global RNG that draw would shift dropout masks after a resume.
        generator = torch.Generator().manual_seed(self.stream.seed + self.dp_rank)
        self._stop_pipe = os.pipe()
        self._loader = DataLoader(
            WorkerBatches(self, self._requests),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_as_is,
            prefetch_factor=2,  # runs of at least MIN_GROUP micro-batches each
            persistent_workers=True,
            worker_init_fn=functools.partial(
                _leave_stop_signals_to_the_rank, os.getpid(), self._stop_pipe[0]
            ),
            generator=generator,
        )
        self._iter = iter(self._loader)  # starts the workers
        self._workers = list(self._iter._workers)  # (another thread may start a loader's too)
        _RUNNING.add(self)

    def _replan(self):
        """Plan again from the state at the next batch (the workers, if any, go on)."""
        self._plans, self._plan, self._i = None, None, 0
        for src in _fetching_sources(self.stream):  # fetched for a position left behind
            src.prefetch.clear()

    def _stop_workers(self):
        self._loader = self._iter = None  # the iterator stops its workers
        self._end_workers()

    def _end_workers(self):
        """Make sure this loader's workers are gone. The iterator asks them to stop and
        joins them; those still alive after ``WORKER_STOP_S`` (busy in an endless loop, or
        their iterator kept alive by a traceback) are told to exit through the stop pipe,
        and killed if even that fails: they ignore SIGTERM, so multiprocessing's own stop
        at exit (SIGTERM, then a join without a timeout) would wait for them forever."""
        workers, self._workers = self._workers, []
        pipe, self._stop_pipe = self._stop_pipe, None
        deadline = time.monotonic() + WORKER_STOP_S
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [w for w in workers if w.is_alive()]
        if stuck:
            logger.warning("loader workers %s did not stop: ending them",
                           [w.pid for w in stuck])  # fmt: skip
            os.write(pipe[1], b"x")  # each one's exit-with-rank thread reads it: status 0
        for worker in stuck:
            worker.join(timeout=5.0)  # its thread takes the GIL from a busy main thread
            if worker.is_alive():  # it never did (stuck in C code): the last resort
                worker.kill()
                worker.join()
        for fd in pipe or ():
            os.close(fd)

    def close(self):
        """Stop the workers (if any run); a later batch starts them again."""
        _RUNNING.discard(self)
        self._replan()
        self._stop_workers()

    def worker_pids(self) -> list[int]:
        """The pids of this loader's running worker processes."""
        return [w.pid for w in self._workers if w.is_alive()]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._plans is None:
            self._start()
        if self._plan is None:
            self._plan, self._i = next(self._plans), 0
        plan, i = self._plan, self._i
        if self.num_workers:
            batch = self.collate(
                [self._received(j, s, p) for j, (s, p) in enumerate(plan.micro[i])]
            )
        else:
            batch = self.collate([self.stream.window(s, p) for s, p in plan.micro[i]])
        batch["loss_weight"] = plan.weights[i]
        self._m += 1
        self._i += 1
        if self._i == len(plan.micro):  # the step is handed out whole: it is the position
            for first, count, lo, hi in plan.skipped:
                self.skipped_windows[(first, count)] = (lo, hi)
                self._passed_over.append([first, count, lo, hi])
                logger.info("step %d: the data of steps %d-%d (windows %d-%d) is passed over",
                            first, first, first + count - 1, lo, hi - 1)  # fmt: skip
            for lo, hi in plan.windows_skipped:
                self._passed_over.append([-1, 0, lo, hi])
                logger.info("step %d: windows %d-%d are passed over", plan.step + 1, lo, hi - 1)
            self._epoch_starts += self.stream.epoch_starts(self.position, plan.after)
            self.position, self.step = plan.after, plan.step + 1
            self.last_global_batch = plan.global_batch
            self._plan = None
        return batch

    def _received(self, j: int, source: int, pieces: list) -> tuple:
        """Window ``j`` of the micro-batch being made, ``(tokens, spans)``, from the worker
        that reads it (its runs arrive in turn; another worker's are held meanwhile)."""
        held = self._held[window_owner(source, pieces, self.num_workers)]
        while not held:  # the DataLoader sends its workers' runs in turn
            generation, worker, run = next(self._iter)
            if generation == self._generation:  # a run of an earlier plan is dropped
                self._held[worker].extend(run)
        entry = held.popleft()
        if isinstance(entry, dict):
            raise DataError(entry["data_error"])
        m, k, tokens, spans = entry
        if (m, k) != (self._m, j):
            raise RuntimeError(f"loader worker sent window {m}:{k} where {self._m}:{j} was due")
        return tokens, spans

    def next_step(self) -> list[dict]:
        """The micro-batches of the next step (its global batch is the schedule's)."""
        batches = [next(self)]
        while self._plan is not None:
            batches.append(next(self))
        return batches

    def set_step(self, step: int):
        """The training step the next batch is for (the schedule is by training step: a
        data restart keeps the batch size the run has reached)."""
        if step != self.step:
            self.step = step
            self._replan()

    def add_skips(self, skips: list[tuple[int, int]]):
        """Pass over the data of these ``(first step, steps)`` too (kept in order, each
        once; a skip already in the list is not added twice). From the next step planned."""
        merged = sorted(set(self.skips) | {(int(a), int(n)) for a, n in skips})
        if merged != self.skips:
            self.skips = merged
            self._replan()

    def add_window_skips(self, ranges: list[tuple[int, int]]):
        """Pass over these ``(first window, windows)`` ranges of the global order too."""
        merged = sorted(set(self.window_skips) | {(int(a), int(n)) for a, n in ranges})
        if merged != self.window_skips:
            self.window_skips = merged
            self._replan()

    def windows_of_steps(self, first: int, count: int) -> int:
        """The windows ``count`` training steps from ``first`` read (the batch schedule's)."""
        return sum(self.schedule.global_batch(j) for j in range(first - 1, first - 1 + count))

    def reshard(self, dp_rank: int, schedule: BatchSchedule):
        """Read as data-parallel rank ``dp_rank`` of ``schedule`` from the next step on,
        at the same position (fault tolerance: a step's participants changed). O(1): running
        workers follow the new split from their next micro-batch (a request, ``Requests``),
        never restarted; the micro-batches they had made ahead for the old one are dropped."""
        self.dp_rank, self.dp_world, self.schedule = dp_rank, schedule.dp_world, schedule
        self.group = group_size(schedule.micro, self.stream.seq_len, self.num_workers)
        self._replan()

    def seek(self, position: Position | None = None):
        """Continue from ``position`` (the start when None): for validation, which reads
        the same first batches every time, a fault-tolerant step's rewind, and tools that
        need a far-along state. Running workers follow it (see ``reshard``)."""
        self.position = position.copy() if position else self.stream.start()
        self._replan()

    # ---- what the metrics read ---------------------------------------------------------
    def skipped_documents(self) -> int:
        """Documents dropped by the bad-data policy before the position (all ranks')."""
        return self.stream.skipped_before(self.position)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens read from each source since the data started (all ranks')."""
        return dict(zip(self.stream.names, self.position.tokens()))

    def mix_by_source(self) -> dict[str, float]:
        """Each source's weight (normalized) in the last step handed out in full."""
        weights = self.stream.mix.weights(max(self.step - 1, 0))
        total = sum(weights)
        return {name: w / total for name, w in zip(self.stream.names, weights)}

    def passes_by_source(self) -> dict[str, tuple[int, float]]:
        """Each source's pass in progress and the share of it read (by units). O(lanes)."""
        return {
            order.name: (cursor.pass_, order.pass_read(cursor))
            for order, cursor in zip(self.stream.orders, self.position.cursors)
        }

    def take_passed_over(self) -> list[list[int]]:
        """``[first step, steps, first window, end window]`` of every skip passed over
        since the last call."""
        out, self._passed_over = self._passed_over, []
        return out

    def take_epoch_starts(self) -> list[list]:
        """``[source, pass]`` of every pass begun since the last call."""
        out, self._epoch_starts = self._epoch_starts, []
        return out

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's entry (every rank's is the same), JSON in a uint8 tensor: a
        checkpoint holds data, never a pickle (state.py). Cost: O(sources)."""
        if self._plan is not None:
            raise RuntimeError("the loader state is taken between steps, not inside one")
        names = self.stream.names
        entry = {
            "version": state.STATE_VERSION,
            "windows": self.position.windows,
            "cursors": [cursor.to_list() for cursor in self.position.cursors],
            "sources": list(names),
            "retired": self.position.retired,
            "weights": dict(zip(names, self.stream.mix.weights(self.step))),
            "seq_len": self.stream.seq_len,
            # mutant loader-step-saved-early: `"step": self.step,` -> `"step": self.step - 1,`; test/data/test_loader.py::test_restore_at_every_step
            "step": self.step,
            # Data passed over, [first step, steps, first window, end window] (-1, -1 for
            # one still ahead): part of the order, kept by every later checkpoint.
            "skips": [[a, n, *self.skipped_windows.get((a, n), (-1, -1))] for a, n in self.skips],
            "skip_windows": [list(r) for r in self.window_skips],  # [first window, windows]
        }
        return {state.entry_key(self.dp_rank): state.to_tensor(entry)}

    def entry_to_load(self, saved: list[str]) -> str:
        """The one entry this rank reads (``state.entry_to_load``)."""
        return state.entry_to_load(saved, self.dp_rank)

    def checkpoint_state(self, dims, fingerprint: dict, accept_data_change: bool):
        """This loader as the checkpoint saves and loads it (``state.LoaderState``) on the
        rank ``dims`` describes, in the data ``fingerprint`` describes."""
        writes = state.writes_entry(dims)
        return state.LoaderState(self, writes, fingerprint, accept_data_change)

    def load_state_dict(self, state_dict: dict):
        """Seek to the saved position. Cost: decoding one entry's JSON; the documents are
        read when their windows are."""
        entry = state.saved_entry(state_dict)
        step = int(entry["step"])
        if entry["seq_len"] != self.stream.seq_len:
            logger.info(
                "sequence length %d -> %d: the stream continues where each lane stopped",
                entry["seq_len"], self.stream.seq_len,
            )  # fmt: skip
        # Sources by name: the mix may have changed since (the config wins, state.py).
        weights = list(self.stream.mix.weights(step))
        cursors, retired, changes = state.restore_cursors(entry, self.stream.names, weights)
        for line in changes:
            logger.info("step %d: %s", step, line)
        self.position = Position(int(entry["windows"]), cursors, retired)
        self.step = int(entry["step"])
        # The saved skips join those already here (the config's, a rewind's): a requeue
        # keeps them, and passing the same skip twice adds nothing.
        saved = entry.get("skips") or []
        for a, n, lo, hi in saved:
            if lo >= 0:
                self.skipped_windows[(a, n)] = (lo, hi)
        self.skips = sorted(set(self.skips) | {(int(a), int(n)) for a, n, *_ in saved})
        saved_windows = {(int(a), int(n)) for a, n in entry.get("skip_windows") or []}
        self.window_skips = sorted(set(self.window_skips) | saved_windows)
        late = [f"{a}-{a + n - 1}" for a, n in self.skips
                if a - 1 < step and (a, n) not in self.skipped_windows]  # fmt: skip
        if late:
            logger.warning(
                "training.skip_steps %s begin before the resumed step %d: not applied (they "
                "name steps this run's checkpoint has already trained)", ",".join(late), step + 1,
            )  # fmt: skip
        self._replan()
