"""The spike guard's cost: the training step with the guard on and off.

    python scripts/benchmarks/bench_guard.py [--steps 40] [--rounds 6] [--smoke] [--json out.json]
    python scripts/benchmarks/bench_guard.py --flavor 125M --seq-len 2048 --batch 8   # a GPU

The product path: ``train.main`` as ``train.py`` runs it, one fresh process per run (one
thread on a CPU), the config's defaults for everything but the sizes; ``metrics.log_freq
1``, so every step's ``step_ms`` is in ``metrics.jsonl`` (on a GPU the step on the
device's timeline: ``records/metrics.StepClock``). *On*: the guard as every run has it
(the finiteness check, the z-score window, its device-side verdict and the optimizer's
``found_inf``). *Off*: the same process with the step built without it (``TrainStep``'s
``guard`` None: no check, every update applied), which no config allows. The arms
alternate within each round, the first arm alternating between rounds; a run's figure is
the median step after the fifth, a round's the ratio on / off, and the result the median
over rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from torchtitan import REPO_ROOT as REPO
from torchtitan.records.runs import read_records

WARMUP = 5  # steps left out of a run's median (allocation, the window's first fill)


def run_arm(guard: bool, argv: list[str]) -> int:
    """``train.main(argv)`` in this process, the step built without the guard unless
    ``guard``."""
    import train

    real = train.feed_and_step

    def without_guard(run, batch_loss):
        feed, step = real(run, batch_loss)
        step.guard = None
        return feed, step

    if not guard:
        train.feed_and_step = without_guard
    try:
        return train.main(argv)
    finally:
        train.feed_and_step = real


def one_run(guard: bool, train_args: list[str], folder: Path) -> float:
    """The median step ms of one run in a fresh process."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    arm = "on" if guard else "off"
    cmd = [sys.executable, __file__, "--arm", arm, "--", *train_args,
           "--job.dump_folder", str(folder)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the guard-{arm} run failed:\n{proc.stderr[-3000:]}")
    records = [r for r in read_records(folder / "metrics.jsonl") if r["step"] > WARMUP]
    return statistics.median(r["step_ms"] for r in records)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--arm"]:  # one run, in this process (one_run's child)
        return run_arm(argv[1] == "on", argv[3:])
    p = bench.Arguments(__doc__, smoke={"steps": 8, "rounds": 1}, rounds=6, work="")
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse(argv)
    train_args = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor",
                  args.flavor, "--training.seq_len", str(args.seq_len), "--training.batch_size",
                  str(args.batch), "--training.steps", str(args.steps), "--metrics.log_freq", "1"]  # fmt: skip
    ms = {True: [], False: []}
    ratios = []
    with bench.work_folder(args, "bench-guard-") as work:
        for r in range(args.rounds):
            arms = (True, False) if r % 2 == 0 else (False, True)
            got = {g: one_run(g, train_args, work / f"guard-{g}") for g in arms}
            for g in arms:
                ms[g].append(got[g])
            ratios.append(got[True] / got[False])
    on, off = statistics.median(ms[True]), statistics.median(ms[False])
    ratio = statistics.median(ratios)
    result = {
        **bench.about(argv, commit=True),
        "smoke": args.smoke,
        "flavor": args.flavor,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "rounds": args.rounds,
        "device": "cuda" if _cuda() else "cpu",
        "guard_on_ms": ms[True],
        "guard_off_ms": ms[False],
        "on_over_off": ratios,
        "median_on_ms": on,
        "median_off_ms": off,
        "median_on_over_off": ratio,
        "cost_pct": 100 * (ratio - 1),
    }
    bench.print_table(["step ms, guard on", "guard off", "on / off (median of rounds)", "cost"],
                      [[f"{on:.2f}", f"{off:.2f}", f"{ratio:.3f}", f"{100 * (ratio - 1):+.1f} %"]])  # fmt: skip
    print("rounds, on / off: " + json.dumps([round(x, 3) for x in ratios]))
    return bench.save(args, result)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
