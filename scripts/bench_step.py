"""Per-step cost of checkpointing and data loading in the training loop.

    python scripts/bench_step.py [--steps 300] [--rounds 2] [--smoke] [--json out.json]

Trains the debug model (one process, one thread) alternately with checkpointing off
and on (interval 100), --rounds times each, and compares the median step time of the
steady-state steps (the save steps themselves excluded: their cost is measured by
bench_checkpoint.py). Also reports data-wait time as a share of step time.
Targets: on/off within 2%; data wait <= 2% of the step.

Then a 2-rank torchrun job with checkpointing on (so save-on-signal is armed) reports
the preemption agreement the loop pays every step (``stop_check_ms`` in its metrics)
as a share of the step time. Target: <= 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torchtitan import REPO_ROOT as REPO
from torchtitan.runs import read_records, torchrun


def run(steps: int, checkpoint: bool, folder: Path, interval: int) -> tuple[list[dict], int]:
    """Per-step records of one training process, and how many checkpoints it wrote."""
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [sys.executable, "train.py", "--job.config_file", "train_configs/debug_model.toml",
           "--job.dump_folder", str(folder), "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--lr_scheduler.warmup_steps", "10"]  # fmt: skip
    if checkpoint:
        cmd += ["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(interval)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    saved = folder / "checkpoint"
    written = len([n for n in os.listdir(saved) if n.startswith("step-")]) if saved.is_dir() else 0
    return read_records(folder / "metrics.jsonl"), written


def agreement_share(steps: int, folder: Path) -> tuple[float, float]:
    """Median stop-agreement ms and median step ms of a 2-rank job (all steps after 2)."""
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.enable_checkpoint",
            "--checkpoint.interval", str(steps)]  # fmt: skip
    proc = torchrun(2, args)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    records = [r for r in read_records(folder / "metrics.jsonl") if r["step"] > 2]
    return (statistics.median(r["stop_check_ms"] for r in records),
            statistics.median(r["step_ms"] for r in records))  # fmt: skip


def steady(records: list[dict], interval: int, warmup: int) -> list[dict]:
    # Skip warm-up, and the steps right after a save (the save itself runs after
    # the step's metrics are taken, so it shows in neither).
    return [r for r in records if r["step"] > warmup and (r["step"] - 1) % interval != 0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    interval, warmup = 100, 10
    if args.smoke:
        args.steps, args.rounds, interval, warmup = 12, 1, 4, 2
    root = Path(tempfile.mkdtemp(prefix="bench_step_"))
    step_ms = {"off": [], "on": []}
    wait_share = []
    written = 0
    try:
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                records, saves = run(args.steps, mode == "on", root / mode, interval)
                written += saves
                records = steady(records, interval, warmup)
                step_ms[mode] += [r["step_ms"] for r in records]
                wait_share += [r["data_wait_ms"] / r["step_ms"] for r in records]
        check_ms, two_rank_step_ms = agreement_share(args.steps, root / "agreement")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in step_ms.items()}
    result = {
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "checkpoint_interval": interval,
        "checkpoints_written": written,
        "median_step_ms_checkpoint_off": med["off"],
        "median_step_ms_checkpoint_on": med["on"],
        "on_over_off": med["on"] / med["off"],
        "median_data_wait_share": statistics.median(wait_share),
        "p90_data_wait_share": statistics.quantiles(wait_share, n=10)[-1],
        "median_stop_check_ms_2ranks": check_ms,
        "median_step_ms_2ranks": two_rank_step_ms,
        "stop_check_share": check_ms / two_rank_step_ms,
    }
    print(f"median step, checkpointing off      {med['off']:8.2f} ms")
    print(f"median step, checkpointing on ({interval}) {med['on']:8.2f} ms")
    print(f"on / off                            {result['on_over_off']:8.3f}   (target <= 1.02)")
    print(
        f"data wait / step, median            {result['median_data_wait_share']:8.3%}   (target <= 2%)"
    )
    print(f"data wait / step, p90               {result['p90_data_wait_share']:8.3%}")
    print(f"stop agreement / step, 2 ranks      {result['stop_check_share']:8.3%}   "
          f"({check_ms:.3f} of {two_rank_step_ms:.1f} ms; target <= 1%)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
