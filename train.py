"""The training recipe: config -> build -> resume -> loop -> save.

Run as ``torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml
[--section.key value ...]`` or as one plain ``python train.py ...`` process.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time

import numpy as np
import torch

from torchtitan import parallel
from torchtitan.checkpoint import CheckpointError, CheckpointManager, TrainState
from torchtitan.config import ConfigError, JobConfig, attention_backend, load_config_or_exit
from torchtitan.data import DataError, build_dataloader, data_fingerprint
from torchtitan.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from torchtitan.initial_weights import load_initial_weights
from torchtitan.metrics import MetricLogger, ProvenanceWriter, memory_gib
from torchtitan.models import build_model, count_parameters, llama
from torchtitan.optim import build_lr_scheduler, build_optimizer
from torchtitan.preemption import Preemption
from torchtitan.step import BatchLoss, TrainStep, Validator, accumulation_steps, peak_tflops

logger = logging.getLogger("torchtitan")

# The project's own errors: the inputs are wrong. Reported as one line, not a traceback;
# anything else is a bug and keeps its traceback.
USER_ERRORS = (CheckpointError, ConfigError, DataError, TokenizerError)


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
    FSDP, with weights that do not depend on the number of ranks."""
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
    return parallel.parallelize(model, cfg, dims)


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
    manager = CheckpointManager(
        cfg,
        dims,
        model=model,
        optimizer=build_optimizer(model, cfg),
        lr_scheduler=None,
        dataloader=None,
        train_state=TrainState(),
        fingerprint={},
    )
    manager.save(0, model_only=True)
    manager.close()
    logger.info("wrote seed checkpoint %s/step-0", manager.folder)


def train(cfg: JobConfig, dims: parallel.ParallelDims):
    t = cfg.training
    seed_everything(t.seed, t.deterministic)
    tokenizer = build_tokenizer(cfg.model)
    if cfg.checkpoint.create_seed_checkpoint:
        return write_seed_checkpoint(cfg, dims, tokenizer)

    accumulation = accumulation_steps(cfg, dims.world_size)
    model = build_training_model(cfg, tokenizer.vocab_size, dims)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    dataloader = build_dataloader(cfg, tokenizer, dims.rank, dims.world_size, accumulation)
    train_state = TrainState()
    # Ranks draw different dropout masks; the checkpoint restores each rank's RNG.
    torch.manual_seed(t.seed + dims.rank)
    checkpoint = CheckpointManager(
        cfg,
        dims,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dataloader=dataloader,
        train_state=train_state,
        fingerprint=data_fingerprint(cfg, tokenizer),
    )
    # Handlers go up before the load: a signal from here on stops the job at a step boundary.
    preemption = Preemption(dims, cfg.checkpoint.save_on_signal if checkpoint.enabled else [])
    try:
        run(cfg, dims, model, optimizer, scheduler, dataloader, tokenizer, train_state,
            checkpoint, preemption, accumulation)  # fmt: skip
    finally:  # handlers go, even when a step fails
        preemption.close()


def run(cfg, dims, model, optimizer, scheduler, dataloader, tokenizer, train_state,
        checkpoint, preemption, accumulation):  # fmt: skip
    """Resume, then train to the last step (or the preemption), then close."""
    t = cfg.training
    train_state.step = checkpoint.load()
    if checkpoint.loaded_from is None:
        load_initial_weights(cfg, model, dims)
    batch_loss = BatchLoss(cfg, model, dims)
    step = TrainStep(cfg, model, optimizer, scheduler, batch_loss, checkpoint.wait_for_staging)
    validator = Validator(cfg, tokenizer, dims, batch_loss) if cfg.validation.enable else None

    metrics = MetricLogger(cfg, dims.rank, train_state.step)
    provenance = None
    if cfg.metrics.data_provenance:
        folder = os.path.join(cfg.job.dump_folder, "provenance")
        provenance = ProvenanceWriter(folder, dims.rank, train_state.step, dims.is_main)
    parallel.barrier(dims)  # rank 0 has trimmed the JSONL files of an interrupted run

    tokens_per_step = t.batch_size * accumulation * t.seq_len * dims.world_size
    flops_per_token = llama.flops_per_token(getattr(model, "module", model).args, t.seq_len)
    peak = peak_tflops(cfg, dims.device)
    logger.info(
        "training steps %d..%d, %d tokens per step (%d micro-batches of %d x %d per rank, world size %d)",
        train_state.step + 1, t.steps, tokens_per_step, accumulation, t.batch_size, t.seq_len,
        dims.world_size,
    )  # fmt: skip
    model.train()
    last_step = t.steps if t.stop_at_step < 0 else min(t.steps, t.stop_at_step)
    epoch_starts: list[list] = []  # [step, shard, source, epoch] since the last log line
    while train_state.step < last_step:
        step_start = time.perf_counter()
        batches, data_wait_s = [], 0.0
        for _ in range(accumulation):
            batches.append(next(dataloader))
            data_wait_s += dataloader.last_wait_s
        train_state.step += 1
        train_state.tokens_seen += tokens_per_step
        epoch_starts += [[train_state.step, *e] for b in batches for e in b["epoch_starts"]]
        loss, grad_norm, lr = step(batches)

        if provenance is not None:
            provenance.write(train_state.step, [s for b in batches for s in b["spans"]])
        step_s = time.perf_counter() - step_start  # throughput excludes validation
        validation = {}
        if validator is not None and validator.due(train_state.step, last_step):
            validation["validation_loss"] = validator.run(model)
        if validation or metrics.should_log(train_state.step, last_step):
            per_rank = tokens_per_step / dims.world_size / step_s
            mfu = {"mfu_pct": 100 * per_rank * flops_per_token / (peak * 1e12)} if peak else {}
            metrics.log(
                train_state.step,
                {
                    "loss": parallel.mean_over_ranks(loss),
                    "grad_norm": grad_norm.item(),
                    "lr": lr,
                    "tokens_per_s": per_rank,
                    **mfu,
                    "step_ms": 1000 * step_s,
                    "data_wait_ms": 1000 * data_wait_s,
                    # the previous step's stop agreement (save on preemption)
                    "stop_check_ms": 1000 * preemption.last_check_s,
                    "memory_gib": memory_gib(dims.device),
                    "tokens_seen": train_state.tokens_seen,
                    "skipped_documents": parallel.sum_over_ranks(dataloader.skipped_documents()),
                    **validation,
                },
                epoch_starts=sorted(parallel.gather_to_main(dims, epoch_starts)),
            )
            epoch_starts = []
        saved = checkpoint.should_save(train_state.step, stop_at=t.stop_at_step)
        if saved:
            checkpoint.save(train_state.step)
        # Asked after every step, save steps included: a signal that lands during a
        # save is acted on right after it, and that save is the preemption's.
        if preemption.requested():
            if not saved:
                checkpoint.save(train_state.step)
            checkpoint.close()
            logger.warning(
                "preempted at step %d: checkpoint step-%d written (%s)",
                train_state.step, train_state.step, preemption.received or "signal to another rank",
            )  # fmt: skip
            break
    checkpoint.close()
    metrics.close()
    if provenance is not None:
        provenance.close()
    logger.info("done: %d steps, %d tokens", train_state.step, train_state.tokens_seen)


def main(argv: list[str] | None = None) -> int:
    cfg = load_config_or_exit(argv)
    dims = parallel.init_distributed()
    setup_logging(dims.rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    try:
        train(cfg, dims)
    except USER_ERRORS as e:
        # Tell the other ranks first: this rank's exit is what breaks their collectives.
        parallel.report_failure(dims, str(e))
        return _one_line(dims, str(e))
    except Exception:
        peer = parallel.failed_peer(dims)
        if peer is None:
            raise  # a bug, or a failure of this rank's own: keep the traceback
        return _one_line(dims, f"stopped because rank {peer[0]} failed: {peer[1]}")
    finally:
        parallel.destroy_distributed()
    return 0


def _one_line(dims: parallel.ParallelDims, message: str) -> int:
    sys.stderr.write(f"[rank{dims.rank}] error: {message}\n")  # one write: lines stay whole
    sys.stderr.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main())
