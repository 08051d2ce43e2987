"""How long CheckpointManager makes the training loop wait, as train.py drives it.

    python scripts/benchmarks/bench_checkpoint.py [--flavor 125M] [--ranks 1,2,4] [--interval 6[,12]]
                                       [--saves 3] [--work DIR] [--smoke] [--json out.json]

For each rank count (a torchrun job of that many CPU ranks, gloo, FSDP2), builds the
model (125M with a 32,000-token vocab: 134 M parameters) and AdamW through the
project's own builders, then runs the training loop's calls exactly as train.py
makes them: forward/backward, ``wait_for_staging()`` before the optimizer step,
``save()`` every ``interval`` steps, ``close()`` at the end. Measured on rank 0:

  blocked     every moment the loop spends inside CheckpointManager calls: save()
              (including, in sync mode, the write, the checksums and finalization;
              in async mode the wait for an earlier save), wait_for_staging();
              close() is reported apart (the end of a job)
  integrity   each rank's CRC32 of its own files (the slowest rank)
  fsync       each rank's fsync of its own files (the slowest rank; durability, not integrity)
  save        a sync save, end to end

Reports per rank count and interval: sync blocked/save, async blocked/save, async/sync
(target <= 0.05 at >= 100 M parameters when the interval is longer than a save's write),
integrity/save (target <= 0.10, flat in ranks), and the interval's seconds against an
async save's write (call to finalized): when the interval is the shorter, each save
waits for the previous one and the job says so once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan import REPO_ROOT
from torchtitan.tools.launch import run_env, torchrun_command

VOCAB = {"debugmodel": 4096, "125M": 32000}


def rank_main(args) -> dict:
    """One rank of the measured job (run under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan import parallel
    from torchtitan.checkpoint import CheckpointManager, TrainState
    from torchtitan.checkpoint.stateful import training_components
    from torchtitan.config import parse_args
    from torchtitan.models import build_model, count_parameters
    from torchtitan.optim import build_lr_scheduler, build_optimizer

    dims = parallel.init_distributed()
    said = []  # the job's one line when a save waits for the previous one

    class Said(logging.Handler):
        def emit(self, record):
            if "shorter than a save's write" in record.getMessage():
                said.append(record.getMessage())

    logging.getLogger("torchtitan").addHandler(Said())
    torch.manual_seed(0)
    vocab = VOCAB[args.flavor]
    model = build_model(args.flavor, vocab, device="meta")
    params = count_parameters(model)
    model = parallel.parallelize(model, parse_args([]), dims)  # FSDP, as train.py does
    result = {"flavor": args.flavor, "parameters": params, "ranks": dims.world_size,
              "interval": args.interval}  # fmt: skip
    for mode in ("disabled", "async"):
        cfg = parse_args([
            "--job.dump_folder", os.path.join(args.root, f"{mode}-{dims.world_size}"),
            "--checkpoint.enable_checkpoint", "--checkpoint.async_mode", mode,
            "--checkpoint.interval", str(args.interval), "--checkpoint.keep_latest_k", "1",
            "--training.steps", str(args.interval * args.saves), "--lr_scheduler.warmup_steps", "1",
        ])  # fmt: skip
        optimizer = build_optimizer(model, cfg)
        scheduler = build_lr_scheduler(optimizer, cfg)
        state = TrainState()
        components = training_components(cfg, dims, model=model, optimizer=optimizer,
                                         lr_scheduler=scheduler, train_state=state,
                                         fingerprint={})  # fmt: skip
        manager = CheckpointManager(cfg, dims, components, fingerprint={})
        blocked, saves, integrity, fsync, step_s = 0.0, [], [], [], []
        tokens = torch.randint(
            0, vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
        )
        while state.step < cfg.training.steps:
            begin = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            t = time.perf_counter()
            manager.wait_for_staging()
            blocked += time.perf_counter() - t
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            step_s.append(time.perf_counter() - begin)
            if manager.should_save(state.step):
                t = time.perf_counter()
                manager.save(state.step)
                elapsed = time.perf_counter() - t
                blocked += elapsed
                saves.append(elapsed)
                if mode == "disabled":
                    integrity.append(manager.saver.last_checksum_s)
                    fsync.append(manager.saver.last_fsync_s)
        t = time.perf_counter()
        manager.close()
        close_s = time.perf_counter() - t
        worst = [(0.0, 0.0)]
        if mode == "disabled":  # the slowest rank's share
            mine = (statistics.median(integrity), statistics.median(fsync))
            worst = [None] * dims.world_size
            dist.all_gather_object(worst, mine, group=dims.cpu_group)
        key = "sync" if mode == "disabled" else "async"
        result[f"{key}_blocked_s"] = blocked
        result[f"{key}_save_calls_s"] = saves
        result[f"{key}_close_s"] = close_s
        result[f"{key}_median_step_s"] = statistics.median(step_s)
        if key == "async":
            result["async_write_s"] = manager.saver.last_write_s
            result["async_said"] = said[:]
        if key == "sync":
            result["sync_save_s"] = statistics.median(saves)
            result["integrity_s"] = max(w[0] for w in worst)
            result["fsync_s"] = max(w[1] for w in worst)
    checkpoint = Path(args.root) / f"disabled-{dims.world_size}" / "checkpoint"
    result["checkpoint_mb"] = (
        sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 2**20
    )
    result["async_blocked_over_sync"] = result["async_blocked_s"] / result["sync_blocked_s"]
    result["integrity_over_save"] = result["integrity_s"] / result["sync_save_s"]
    parallel.destroy_distributed()
    return result


def run_job(ranks: int, interval: int, args, root: str) -> dict:
    out = Path(root) / f"result-{ranks}-{interval}.json"
    root = os.path.join(root, f"interval-{interval}")
    argv = ["--rank-main", "--flavor", args.flavor, "--interval", str(interval),
            "--saves", str(args.saves), "--seq-len", str(args.seq_len), "--root", root, "--json", str(out)]  # fmt: skip
    env = {**run_env(), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    proc = subprocess.run(torchrun_command(ranks, argv, script="scripts/benchmarks/bench_checkpoint.py"),
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"flavor": "debugmodel", "ranks": "2", "saves": 2,
                                        "interval": "2"}, work="")  # fmt: skip
    p.add_argument("--flavor", default="125M", choices=sorted(VOCAB))
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--interval", default="6", help="steps between saves (a list: one job each)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    args = p.parse(argv)
    if args.rank_main:
        args.interval = int(args.interval)
        result = rank_main(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    with bench.work_folder(args, "bench_ckpt_") as root:
        rows = [run_job(int(r), int(i), args, str(root))
                for r in args.ranks.split(",") for i in args.interval.split(",")]  # fmt: skip
    header = ["flavor", "params", "ranks", "interval", "interval s", "async write s", "MB",
              "save s", "sync blocked s", "async blocked s", "async / sync", "crc s",
              "crc / save", "fsync s"]  # fmt: skip
    bench.print_table(header, [
        [r["flavor"], f"{r['parameters']:,}", r["ranks"], r["interval"],
         f"{r['interval'] * r['async_median_step_s']:.2f}", f"{r['async_write_s']:.2f}",
         f"{r['checkpoint_mb']:.0f}", f"{r['sync_save_s']:.2f}", f"{r['sync_blocked_s']:.2f}",
         f"{r['async_blocked_s']:.3f}", f"{r['async_blocked_over_sync']:.3f}",
         f"{r['integrity_s']:.3f}", f"{r['integrity_over_save']:.3f}", f"{r['fsync_s']:.3f}"]
        for r in rows])  # fmt: skip
    for r in rows:
        for line in r["async_said"]:
            print(f"interval {r['interval']}, async, the job said: {line}")
    print(
        "targets: async/sync <= 0.05 at >= 100 M parameters; integrity/save <= 0.10, flat in ranks"
    )
    return bench.save(args, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
