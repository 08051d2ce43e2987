"""Preempt training with SIGTERM / SIGUSR1 at random moments, relaunch, compare to a clean run.

    python scripts/campaigns/preemption_campaign.py --trials 24 --seed 0

The SIGKILL campaign (fault_injection.py) covers kills; this one covers the signal a
scheduler sends before it kills, which the job must act on by itself:

1. One reference run per data-parallel mode (DDP, FSDP), worker count (0, 2: the
   batch order depends on it) and compile setting trains --steps steps.
2. Trial i runs layout i % 8 of {0, 2 loader workers} x {sync, async saves} x {DDP,
   FSDP} on 2 ranks, with validation every 4 steps, and signals it once: SIGTERM or
   SIGUSR1, to every rank or to one rank, at a moment drawn from: after a random step,
   while a checkpoint is being written, at the step before a validation (the signal
   lands in that step or its validation), or twice in a row. The first 8 trials take
   the moments in turn, shifted by the seed (so seeds pair layouts and moments
   differently); later ones draw a moment. (``--compile-trials``
   adds trials signalled during the first ``torch.compile``.)
3. Every trial must exit by itself through the preemption path: every rank says
   ``preempted at step N``, N at most 3 steps after the last step logged before the
   signal, and the newest complete checkpoint is step-N. The same command then runs to
   the end; its losses must equal the reference's bit for bit and its provenance must
   pass the exactly-once check.

Prints one line per trial and a summary with the worst signal-to-exit time; exits 1 on
any failure. Extra ``--section.key value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_injection import command, last_step, saving

from torchtitan import REPO_ROOT
from torchtitan.checkpoint import complete_steps
from torchtitan.records.runs import losses
from torchtitan.tools.check_provenance import main as check_provenance
from torchtitan.tools.launch import DEBUG_CONFIG, launcher_workers, run_env

LAYOUTS = [
    (workers, mode, parallel)
    for parallel in ("ddp", "fsdp")
    for mode in ("disabled", "async")
    for workers in (0, 2)
]
MOMENTS = ["step", "save", "validation", "twice"]
VALIDATION_FREQ = 4


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    """The job in a process group of its own, as a scheduler's job step is: SIGTERM to
    the group reaches torchrun, every rank and every loader worker."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=run_env(), stdout=open(log, "a"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def layout_args(workers: int, mode: str, parallel: str) -> list[str]:
    return ["--training.num_workers", str(workers), "--checkpoint.async_mode", mode,
            "--training.data_parallel", parallel, "--validation.enable",
            "--validation.freq", str(VALIDATION_FREQ), "--validation.steps", "2"]  # fmt: skip


def wait_for(proc, dump: Path, moment: str, at_step: int, timeout: float) -> bool:
    """Wait for the signal's moment; False if the job ended (or never got there)."""
    deadline, started = time.monotonic() + timeout, time.time()
    while proc.poll() is None and time.monotonic() < deadline:
        if moment == "save" and saving(dump, started) and last_step(dump) <= at_step:
            return True  # a save with steps left after it (not the last one)
        if moment == "compile" and "training steps" in (dump / "runs.log").read_text():
            return True
        if moment in ("step", "validation", "twice") and last_step(dump) >= at_step:
            return True
        time.sleep(0.002)
    return False


def send(proc, sig: int, target: str, rng: random.Random) -> list[int]:
    """Signal every rank (SIGTERM: the whole process group, as torchrun forwards it) or one."""
    ranks = launcher_workers(proc.pid)
    if target == "one":
        os.kill(rng.choice(ranks), sig)
    elif sig == signal.SIGTERM:
        os.killpg(proc.pid, sig)
    else:  # torchrun has no SIGUSR1 handler: the scheduler signals the ranks themselves
        for pid in ranks:
            os.kill(pid, sig)
    return ranks


def gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in pids if Path(f"/proc/{p}").exists()]:
            return True
        time.sleep(0.01)
    return False


def trial(args, i: int, root: Path, extra: list[str], rng: random.Random, moment: str):
    """One preemption and the relaunch; returns (problems, layout, signal-to-exit seconds)."""
    workers, mode, parallel = LAYOUTS[i % len(LAYOUTS)]
    dump = root / f"trial-{i}"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    run = [*layout_args(workers, mode, parallel), *extra]
    if moment == "compile":
        run += ["--training.compile"]
    sig = rng.choice([signal.SIGTERM, signal.SIGUSR1])
    target = rng.choice(["all", "one"])
    at_step = {
        "save": args.steps - 4,
        "step": rng.randint(2, args.steps - 4),
        "twice": rng.randint(2, args.steps - 4),
        "validation": VALIDATION_FREQ * rng.randint(1, (args.steps - 4) // VALIDATION_FREQ) - 1,
    }.get(moment, 0)
    proc = launch(command(args, dump, run), dump / "runs.log")
    label = f"layout {workers}w/{mode}/{parallel}, {signal.Signals(sig).name} to {target}, {moment}"
    if not wait_for(proc, dump, moment, at_step, args.timeout):
        proc.kill()
        return [f"never reached its moment ({label})"], label, 0.0
    before = last_step(dump)
    begin = time.monotonic()
    try:
        ranks = send(proc, sig, target, rng)
        if moment == "twice":
            time.sleep(0.02)
            send(proc, sig, target, rng)
    except ProcessLookupError:
        proc.wait()
        return [f"the job ended before the signal ({label})"], label, 0.0
    proc.wait(timeout=args.timeout)
    gone(ranks, args.timeout)
    exit_s = time.monotonic() - begin
    log = (dump / "runs.log").read_text()
    lines = [line for line in log.splitlines() if "preempted at step" in line]
    problems = []
    steps = {int(line.split("preempted at step ")[1].split(":")[0]) for line in lines}
    if len(lines) != args.nproc or len(steps) != 1:
        return (
            [f"did not stop through the preemption path ({len(lines)} ranks said so)"],
            label,
            exit_s,
        )
    stopped = steps.pop()
    if stopped - before > 3:
        problems.append(f"stopped at step {stopped}, {stopped - before} steps after the signal")
    newest = (complete_steps(str(dump / "checkpoint")) or [None])[-1]
    if newest != stopped:
        problems.append(f"newest checkpoint step-{newest}, stopped at {stopped}")
    if launch(command(args, dump, run), dump / "runs.log").wait(timeout=args.timeout) != 0:
        return [*problems, f"the relaunch failed; see {dump / 'runs.log'}"], label, exit_s
    key = (parallel, workers, moment == "compile")
    if key not in args.references:
        args.references[key] = reference_run(args, root, *key, extra)
    reference = args.references[key]
    got = losses(dump)
    bad = sorted(s for s in set(reference) | set(got) if got.get(s) != reference.get(s))
    if bad:
        problems.append(f"losses differ from the reference at steps {bad}")
    config = ["--job.config_file", args.config, *run]
    if check_provenance([str(dump / "provenance"), *config]) != 0:
        problems.append("provenance check failed")
    return problems, f"{label}, stopped at step {stopped} (signal after {before})", exit_s


def reference_run(args, root, parallel: str, workers: int, compile_: bool, extra: list) -> dict:
    """An uninterrupted run; the batch order depends on the workers per rank, so one each."""
    dump = root / f"reference-{parallel}-{workers}w{'-compile' if compile_ else ''}"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    run = [*layout_args(workers, "disabled", parallel), *extra]
    run += ["--training.compile"] if compile_ else []
    if launch(command(args, dump, run), dump / "runs.log").wait(timeout=args.timeout) != 0:
        raise SystemExit(f"reference run failed; see {dump / 'runs.log'}")
    return losses(dump)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--compile-trials", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--config", default=DEBUG_CONFIG)
    p.add_argument("--dump-folder", default="outputs/preemption_campaign")
    p.add_argument("--timeout", type=float, default=300)
    args, extra = p.parse_known_args(argv)
    root = Path(args.dump_folder).resolve()
    rng = random.Random(args.seed)
    args.references = {}  # an uninterrupted run per layout that affects the losses, on demand
    failures, worst = 0, 0.0
    # Every moment before any repeats; the seed turns which layout meets which moment
    # (trial i runs layout i % 8), so that daily seeds pair each layout with each moment.
    plan = [MOMENTS[(i + args.seed) % len(MOMENTS)] if i < len(LAYOUTS) else rng.choice(MOMENTS)
            for i in range(args.trials)] + ["compile"] * args.compile_trials  # fmt: skip
    for i, moment in enumerate(plan):
        problems, label, exit_s = trial(args, i, root, extra, rng, moment)
        worst = max(worst, exit_s)
        failures += bool(problems)
        verdict = "exact" if not problems else "FAIL: " + "; ".join(problems)
        print(f"  trial {i}: {label}; exited {exit_s:.2f}s after the signal; {verdict}", flush=True)
    print(f"\ntrials {len(plan)}  failed {failures}  worst signal-to-exit {worst:.2f}s")
    print("PASS: every trial stopped by itself and resumed bit for bit" if not failures else "FAIL")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
