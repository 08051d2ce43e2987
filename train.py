"""The training recipe: config -> build -> resume -> loop -> save.

Run as ``torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml
[--section.key value ...]`` or as one plain ``python train.py ...`` process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from torchtitan import parallel
from torchtitan.checkpoint import CheckpointError, CheckpointManager, TrainState, rewinds
from torchtitan.checkpoint.stateful import training_components
from torchtitan.config import ConfigError, JobConfig, load_config_or_exit
from torchtitan.data import (
    DataError,
    ParallelDataLoader,
    build_dataloader,
    build_validation_loader,
)
from torchtitan.data.plan import resolve_plan
from torchtitan.data.schedule import parse_skip_steps
from torchtitan.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from torchtitan.faults import fault_tolerance
from torchtitan.faults.launcher import watch_launcher
from torchtitan.faults.preemption import Preemption
from torchtitan.initial_weights import load_initial_weights
from torchtitan.io import storage
from torchtitan.loss import BatchLoss
from torchtitan.models import build_model, count_parameters, llama
from torchtitan.models.attention import attention_backend
from torchtitan.optim import build_lr_scheduler, build_optimizer
from torchtitan.parallel import pipeline, tensor_parallel
from torchtitan.records.metrics import StepClock, StepMetrics
from torchtitan.records.profiling import Profiler
from torchtitan.spikes import SpikeGuard, TrainingError
from torchtitan.step import SYNC_DEBUG_ENV, PipelineStep, TrainStep
from torchtitan.validate import Validator

logger = logging.getLogger("torchtitan")

# The project's own errors: the inputs are wrong. Reported as one line, not a traceback;
# anything else is a bug and keeps its traceback.
USER_ERRORS = (CheckpointError, ConfigError, DataError, TokenizerError, TrainingError,
               fault_tolerance.FaultToleranceError)  # fmt: skip


def setup_logging(rank: int):
    import datasets

    # The project's own logger, with a handler made anew on each call: main() may run
    # several times in one process (tests), and stderr may have been replaced meanwhile.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    # Progress bars from every rank would bury the training log.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_warning()


def seed_everything(seed: int, deterministic: bool):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build_training_model(cfg: JobConfig, vocab_size: int, dims: parallel.ParallelDims):
    """Build on the meta device, apply parallelism, then let each rank materialize and
    initialize only what it holds: O(own shard) memory and init time per rank under
    FSDP, TP and PP, with weights that do not depend on the layout. Returns the model
    (a pipeline rank's part of it) and the pipeline (None without one)."""
    args = replace(llama.llama_configs[cfg.model.flavor], vocab_size=vocab_size)
    p = cfg.parallelism
    tensor_parallel.check_fits(
        args, dims.tp, cfg.training.seq_len, p.sequence_parallel, cfg.model.flavor
    )
    backend = attention_backend(cfg, dims.device.type)
    model = build_model(
        cfg.model.flavor, vocab_size, dropout=cfg.model.dropout, device="meta",
        attention_backend=backend,
    )  # fmt: skip
    if cfg.training.seq_len > model.args.max_seq_len:
        raise ConfigError(
            f"training.seq_len {cfg.training.seq_len} exceeds the max_seq_len "
            f"{model.args.max_seq_len} of model flavor {cfg.model.flavor!r}; lower --training.seq_len"
        )
    logger.info(
        "model %s %s: %.2fM parameters, %s attention with %s",
        cfg.model.name,
        cfg.model.flavor,
        count_parameters(model) / 1e6,
        cfg.model.attention_mask,
        backend,
    )
    if dims.pp > 1:
        return pipeline.build_pipeline(
            model, cfg, dims, lambda part, stages: parallel.parallelize(part, cfg, dims, stages)
        )
    return parallel.parallelize(model, cfg, dims), None


def write_seed_checkpoint(cfg: JobConfig, dims: parallel.ParallelDims, tokenizer: Tokenizer):
    if dims.world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint runs in one process: launch it without torchrun"
        )
    model = build_model(
        cfg.model.flavor,
        tokenizer.vocab_size,
        dropout=cfg.model.dropout,
        device=dims.device,
        seed=cfg.training.seed,
    )
    components = training_components(cfg, dims, model=model, optimizer=build_optimizer(model, cfg),
                                     train_state=TrainState(), fingerprint={})  # fmt: skip
    manager = CheckpointManager(cfg, dims, components, fingerprint={})
    try:
        manager.save(0, model_only=True)
    finally:
        manager.close()
    logger.info("wrote seed checkpoint %s/step-0", manager.folder)


@dataclass
class Run:
    """The parts of one training run, built once (``build_run``) and driven by ``train_loop``."""

    cfg: JobConfig
    dims: parallel.ParallelDims
    tokenizer: Tokenizer
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: ParallelDataLoader
    train_state: TrainState
    checkpoint: CheckpointManager
    pipeline: pipeline.Pipeline | None = None
    held_out: ParallelDataLoader | None = None  # validation's loader (validation.enable)
    replicas: fault_tolerance.ReplicaGroup | None = None  # fault_tolerance.enable
    guard: SpikeGuard | None = None  # broken steps and spikes (spikes.py)

    @property
    def last_step(self) -> int:
        return last_step(self.cfg.training)


def last_step(t) -> int:
    """The step a job stops after: training.steps, or training.stop_at_step before it (the
    one place it is derived)."""
    return t.steps if t.stop_at_step < 0 else min(t.steps, t.stop_at_step)


def build_run(cfg: JobConfig, dims: parallel.ParallelDims, tokenizer: Tokenizer) -> Run:
    model, stages = build_training_model(cfg, tokenizer.vocab_size, dims)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    ranks = parallel.JobRanks(dims)
    plan = resolve_plan(cfg.training, tokenizer, ranks)
    # TP peers train on the same batches: the loader is the data-parallel rank's.
    dataloader = build_dataloader(cfg, tokenizer, dims.dp_rank, dims.dp_world, plan)
    dataloader.add_skips(parse_skip_steps(cfg.training.skip_steps))
    dataloader.add_window_skips(parse_skip_steps(cfg.training.skip_windows, first_index=0))
    held_out = None
    if cfg.validation.enable:  # its own plan, resolved once for the job as the training data's
        held_out = build_validation_loader(cfg, tokenizer, dims.dp_rank, dims.dp_world, ranks)
    if stages is not None:
        pipeline.check_batches(dataloader.schedule, stages, dims.dp_world)
    train_state = TrainState()
    guard = SpikeGuard(cfg, dims, train_state)
    # Dropout streams differ between data-parallel ranks and pipeline stages and are
    # shared by TP peers, which hold the same activations (tensor_parallel.py); the
    # checkpoint restores them.
    torch.manual_seed(cfg.training.seed + dims.dp_rank + dims.pp_rank * dims.dp_world)
    components = training_components(
        cfg, dims, model=model, optimizer=optimizer, lr_scheduler=scheduler,
        dataloader=dataloader, train_state=train_state, fingerprint=plan.fingerprint, guard=guard,
    )  # fmt: skip
    checkpoint = CheckpointManager(cfg, dims, components, plan.fingerprint)
    replicas = None
    if cfg.fault_tolerance.enable:  # replica groups: the outer data-parallel dimension
        try:
            replicas = fault_tolerance.ReplicaGroup(cfg, dims, dataloader, components, model,
                                                    train_state)  # fmt: skip
        except BaseException:  # no lighthouse (its one line): the folder's lease goes too
            checkpoint.release_lease()
            raise
        checkpoint = fault_tolerance.LowestGroupSaves(checkpoint, replicas, last_step(cfg.training))
    return Run(cfg, dims, tokenizer, model, optimizer, scheduler, dataloader, train_state,
               checkpoint, stages, held_out, replicas, guard)  # fmt: skip


def train(cfg: JobConfig, dims: parallel.ParallelDims):
    dims = parallel.apply_layout(dims, cfg)
    if fault_tolerance.job_finished(cfg, dims, last_step(cfg.training)):
        return  # a group restarted after its peers finished: nothing to train, said once
    seed_everything(cfg.training.seed, cfg.training.deterministic)
    tokenizer = build_tokenizer(cfg.model)
    if cfg.checkpoint.create_seed_checkpoint:
        return write_seed_checkpoint(cfg, dims, tokenizer)
    run = build_run(cfg, dims, tokenizer)
    try:
        # Handlers go up before the load: a signal from here on stops the job at a step boundary.
        stop = cfg.checkpoint.save_on_signal if run.checkpoint.enabled else []
        preemption = Preemption(dims, stop)
        if run.replicas is not None:  # the stop is agreed across the groups, not in one
            preemption.agree_across(run.replicas)
        try:
            resume(run)
            train_loop(run, preemption)
        finally:  # handlers go, even when a step fails
            preemption.close()
    finally:  # the folder's lease goes with the job, however it ends (close() released it too)
        run.checkpoint.release_lease()
        if run.replicas is not None:
            run.replicas.close()


def resume(run: Run):
    """The timeline's checkpoint, loaded into every component, or this run's initial weights."""
    run.checkpoint.load()  # the train state holds step 0 unless it was loaded
    if run.checkpoint.enabled:  # skips a rewind decided, whichever checkpoint was loaded
        done = parallel.on_main(run.dims, rewinds.read, run.checkpoint.folder)
        if done:  # none under fault tolerance (its groups never rewind)
            run.dataloader.add_skips([r["skip"] for r in done])
            run.guard.count_rewinds([r["counts"] for r in done])
    run.dataloader.set_step(run.train_state.step)  # the batch-size schedule is by training step
    if run.checkpoint.loaded_from is None:
        load_initial_weights(run.cfg, run.model, run.dims)
    run.train_state.branch()  # this start's branch of the timeline (its records' tag)


def train_loop(run: Run, preemption: Preemption):
    """Train to the last step (or the preemption), then close."""
    cfg, dims, state, last_step = run.cfg, run.dims, run.train_state, run.last_step
    batch_loss = BatchLoss(cfg, run.model, dims)
    feed, step = feed_and_step(run, batch_loss)
    validator = (
        None if run.held_out is None else Validator(cfg.validation, run.held_out, batch_loss)
    )
    # A replica group's records are trimmed at its first commit (a heal may come first), to
    # the state it then trains from: it may heal past its start (ReplicaGroup._trim_records).
    metrics = StepMetrics(cfg, dims, run.model, preemption, feed, state.step, last_step,
                          run.guard, state, trim_later=run.replicas is not None)  # fmt: skip
    if run.replicas is not None:
        run.replicas.on_timeline = metrics.trim
    parallel.barrier(dims)  # rank 0 has trimmed the JSONL files of an interrupted run
    run.model.train()
    first_step = state.step + 1
    clock = StepClock(dims.device)
    with Profiler(cfg, dims.rank, dims.world_size) as profiler:
        while state.step < last_step:
            begin = time.perf_counter()
            clock.start(metrics.logs(state.step + 1))
            try:
                batches, data_wait_s = next_batches(feed)
            except fault_tolerance.StoppedWaiting:  # asked to stop; no quorum can come
                stop_with_checkpoint(run.checkpoint, preemption, state.step, False, alone=True)
                break
            except fault_tolerance.JobFinished:  # while this group started: said once
                break
            with sync_debug(run, metrics, first_step):
                loss, grad_norm, lr = step(batches)
            clock.stop()
            if loss is None:  # fault tolerance: not committed; retried with the same windows
                continue
            state.step += 1
            step_tokens = feed.last_global_batch * cfg.training.seq_len
            state.tokens_seen += step_tokens
            step_s = time.perf_counter() - begin  # throughput excludes validation
            if state.step == first_step:  # start-up and the first compile are behind
                parallel.set_timeout(dims, cfg.comm.train_timeout_seconds)
            validation_loss = None
            if validator is not None and validator.due(state.step, last_step):
                validation_loss = validator.run(run.model)
            metrics.report(state.step, state.tokens_seen, step_tokens, batches, step_s,
                           data_wait_s, loss, grad_norm, lr, validation_loss, clock)  # fmt: skip
            run.checkpoint.check_lease()  # a lapsed lease stops every rank here, unsaved
            if heed_guard(run, metrics, state.step, now=save_due(run, state.step, last_step)):
                continue  # rewound: the spike's data and the steps since go
            saved = save_if_due(run, state.step, last_step)
            # Asked after every step, save steps included: a signal that lands during a
            # save is acted on right after it, and that save is the preemption's.
            if preemption.requested():
                if heed_guard(run, metrics, state.step, now=True):  # before the stop's save
                    continue
                stop_with_checkpoint(run.checkpoint, preemption, state.step, saved)
                break
            profiler.step(state.step)
    run.checkpoint.close()
    if run.replicas is not None:  # the job's last step: a group started later stops at once
        run.replicas.finish(state.step, last_step)
    metrics.close()
    logger.info("done: %d steps, %d tokens", state.step, state.tokens_seen)


@contextlib.contextmanager
def sync_debug(run: Run, metrics: StepMetrics, first_step: int):
    """``SYNC_DEBUG_ENV`` ("warn" or "error"): torch.cuda.set_sync_debug_mode inside every
    steady step's call (a GPU only): one that neither logs nor saves, from this life's
    third step on (the first two allocate, compile and learn the first verdict). A step
    that syncs then warns or raises where it does (scripts/gpu_check.sh runs its steady
    steps under "error")."""
    mode = os.environ.get(SYNC_DEBUG_ENV, "")
    step = run.train_state.step + 1
    steady = (mode and run.dims.device.type == "cuda" and step >= first_step + 2
              and not metrics.logs(step) and not save_due(run, step, run.last_step))  # fmt: skip
    if not steady:
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def heed_guard(run: Run, metrics: StepMetrics, step: int, now: bool) -> bool:
    """Act on the guard's verdicts the host learns at ``step`` (spikes.py): the previous
    step's, copied to the host a step ago, and with ``now`` (a save or a stop is next)
    or on a log line (metrics read it) ``step``'s own. Writes their events; a spike
    under on_spike rewind rewinds (True: the loop goes on from the checkpoint, the steps
    trained since the spike undone with it); max_bad_steps in a row stop the job."""
    guard = run.guard
    guard.learn(step, now)
    for event in guard.take_events():
        if run.dims.is_main:
            metrics.event(event)
    spike, guard.rewind_at = guard.rewind_at, None
    if spike is not None:
        rewind(run, metrics, spike)
        return True
    guard.check_bad_steps()
    return False


def rewind(run: Run, metrics: StepMetrics, spike: int):
    """A spike at step ``spike`` under ``training.on_spike rewind``: reload, in this
    process, the newest checkpoint at least ``rewind_steps`` before it (and not before
    the last skip's first step, whose data it would bring back), and pass over the data
    of the steps from there to the spike plus ``skip_after``: a run started with the
    same ``training.skip_steps`` trains the same from there, bit for bit. The skip list
    and the guard's counters outlive the load; ``max_rewinds`` of them stop the job."""
    t, guard, loader = run.cfg.training, run.guard, run.dataloader
    if guard.counts["rewinds"] >= t.max_rewinds:
        raise TrainingError(
            f"step {spike}: a loss spike after {guard.counts['rewinds']} rewinds "
            f"(training.max_rewinds {t.max_rewinds}); the data is not the cause or the skips "
            "are too short: resume from an earlier checkpoint with a lower --optimizer.lr, or "
            "raise --training.skip_after"
        )
    skips, counts = list(loader.skips), dict(guard.counts)
    earliest = max([a - 1 for a, _ in skips if a <= spike], default=0)  # skips passed over
    to = run.checkpoint.rewind(spike - t.rewind_steps, earliest)
    if to is None:
        raise TrainingError(
            f"step {spike}: a loss spike, and no checkpoint of a step in {earliest}.."
            f"{spike - t.rewind_steps} to rewind to (training.rewind_steps {t.rewind_steps}); "
            "save more often (--checkpoint.interval or --checkpoint.local_interval)"
        )
    guard.counts = {**counts, "rewinds": counts["rewinds"] + 1}
    run.train_state.branch()  # the steps after the checkpoint are trained again: a new branch
    skip = (to + 1, spike + t.skip_after - to)
    # Durable before the next step trains: a requeue from here loads step-{to}, whose
    # loader entry was written before the spike and does not hold the skip. Written only
    # while the lease holds (storage's write guard asks it: a job that lost the folder
    # stops here in one line).
    folder = run.checkpoint.folder
    parallel.on_main(run.dims, lambda: rewinds.record(folder, spike, to, skip, guard.counts))
    lo = loader.position.windows
    loader.add_skips([*skips, skip])
    loader.set_step(run.train_state.step)
    metrics.rewind(to, guard.counts["rewinds"])
    if run.dims.is_main:
        hi = lo + loader.windows_of_steps(*skip)
        metrics.event({"step": spike, "kind": "rewind", "to": to, "skip_steps": list(skip),
                       "windows": [lo, hi], "rewind": guard.counts["rewinds"]})  # fmt: skip
        logger.warning(
            "step %d: rewound to checkpoint step-%d (%s; rewind %d of at most %d); the data of "
            "steps %d-%d (windows %d-%d) is skipped: the same as --training.skip_steps %d-%d",
            spike, to, run.checkpoint.loaded_from, guard.counts["rewinds"], t.max_rewinds,
            skip[0], skip[0] + skip[1] - 1, lo, hi - 1, skip[0], skip[0] + skip[1] - 1,
        )  # fmt: skip


def stop_with_checkpoint(checkpoint, preemption: Preemption, step: int, saved: bool,
                         alone: bool = False):  # fmt: skip
    """The preemption's stop after ``step``: its checkpoint (unless this step's save
    already wrote it), the manager closed, and a log line that says whether this
    process's group wrote it (fault tolerance: only the lowest live group does; a group
    that stopped waiting for a quorum, ``alone``, writes its own)."""
    save = checkpoint.save_alone if alone else checkpoint.save
    written = saved or save(step) is not False
    checkpoint.close()
    preemption.said_stop(step, written)


def save_due(run: Run, step: int, last_step: int) -> bool:
    return run.checkpoint.should_save(step) or (run.checkpoint.enabled and step == last_step)


def save_if_due(run: Run, step: int, last_step: int) -> bool:
    """Save ``step`` every checkpoint.interval steps and where the job stops (weights
    only at the training's last step under checkpoint.model_weights_only); whether it
    saved (fault tolerance: False in a group that does not write the job's)."""
    if save_due(run, step, last_step):  # LowestGroupSaves.save: False where it skipped
        return run.checkpoint.save(step, final=step == run.cfg.training.steps) is not False
    return False


def feed_and_step(run: Run, batch_loss: BatchLoss):
    """Where a step's batches come from, and the step that trains on them: the loader
    and ``TrainStep``; under a pipeline, ``PipelineStep``, fed by the loader on the first
    stage and by the schedule's step sizes alone on the others (they read no data)."""
    wait = run.checkpoint.wait_for_staging
    if run.pipeline is None:
        feed = run.replicas or run.dataloader  # fault tolerance: a quorum before each step
        commit = run.replicas.commit if run.replicas else None
        return feed, TrainStep(run.cfg, run.model, run.optimizer, run.scheduler, batch_loss,
                               wait, commit, run.guard)  # fmt: skip
    feed = run.dataloader if run.pipeline.first else pipeline.StageFeed(run.dataloader)
    return feed, PipelineStep(run.cfg, run.model, run.optimizer, run.scheduler, batch_loss,
                              wait, run.pipeline, run.dims, feed, run.guard)  # fmt: skip


def next_batches(dataloader) -> tuple[list[dict], float]:
    """The next optimizer step's micro-batches, and the time spent waiting for them."""
    start = time.perf_counter()
    batches = dataloader.next_step()
    return batches, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    cfg = load_config_or_exit(argv)
    restarted = parallel.torchrun_restart_problem()
    if restarted:  # before the process groups, which is where it would fail
        return _one_line(int(os.environ.get("RANK", "0")), restarted)
    launcher = watch_launcher()  # a rank whose torchrun died stops as on SIGTERM
    # ``kill -USR2 <rank pid>`` prints every thread's stack to stderr: a job that hangs
    # says where (the fault campaign asks it so before it kills one that did not exit).
    if sys.__stderr__ is not None:  # the process's own stderr (a test may replace sys's)
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    dims = parallel.init_distributed(cfg.comm.init_timeout_seconds)
    setup_logging(dims.rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    try:
        train(cfg, dims)
    except Exception as e:
        # A broken collective (a peer failed, died or stopped answering) is said in one
        # line naming the peer; a save it broke is the peer's failure, not a full disk.
        broke = parallel.collective_broke(e)
        fault = None if isinstance(e, USER_ERRORS) else storage.store_fault(e)
        if fault is not None:  # the object store: one line naming it and the fix
            parallel.report_failure(dims, fault)
            return _one_line(dims.rank, fault)
        if broke or not isinstance(e, USER_ERRORS):
            cause = parallel.why_collective_broke(dims, e) if broke else parallel.failed_peer(dims)
            if cause is not None:
                return _one_line(dims.rank, f"stopped because {cause}")
        # Tell the other ranks first: this rank's exit is what breaks their collectives.
        parallel.report_failure(dims, str(e) if isinstance(e, USER_ERRORS) else _first_line(e))
        if isinstance(e, USER_ERRORS):
            return _one_line(dims.rank, str(e))
        raise  # a bug, or a failure of this rank's own: keep the traceback
    finally:
        parallel.destroy_distributed()
        if launcher is not None:
            launcher.close()
    return 0


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _one_line(rank: int, message: str) -> int:
    sys.stderr.write(f"[rank{rank}] error: {message}\n")  # one write: lines stay whole
    sys.stderr.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main())
