"""Kill training with SIGKILL at random moments, relaunch until it finishes, compare to a clean run.

    python scripts/campaigns/fault_injection.py --trials 5 --kills 3 --seed 0

1. A reference run trains --steps steps with a checkpoint every --interval.
2. Each trial trains the same job in a fresh folder and SIGKILLs it up to --kills
   times: all ranks or a single rank (torchrun then stops the rest), either after a
   random step or the moment a checkpoint is being written (a ``step-N.partial``
   folder exists). After each kill the same command is launched again; the job
   resumes from its latest complete checkpoint.
3. The trial's final per-step losses (``metrics.jsonl``, which a resume trims to the
   resumed step) must equal the reference's exactly, and its data provenance must pass
   the checker: every token once, nothing skipped (``torchtitan/tools/check_provenance.py``).

Prints trials, kills, kills during a save, resumes and mismatches; exits 1 on any
mismatch or failed launch. Extra ``--section.key value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan import REPO_ROOT as REPO
from torchtitan.records.runs import losses
from torchtitan.tools.check_provenance import main as check_provenance
from torchtitan.tools.launch import DEBUG_CONFIG, launcher_workers, run_env


@dataclass
class Tally:
    trials: int = 0
    kills: int = 0
    kills_during_save: int = 0
    resumes: int = 0
    mismatches: int = 0
    provenance_failures: int = 0


def command(args, dump: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        str(REPO / "train.py"), "--job.config_file", args.config, "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps), "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", str(args.interval), "--metrics.log_freq", "1",
        "--metrics.data_provenance", *extra,
    ]  # fmt: skip


def last_step(dump: Path) -> int:
    try:
        lines = (dump / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0  # absent, or a line mid-write


def saving(dump: Path, since: float = 0.0) -> bool:
    """A checkpoint is being written: a .partial folder made after ``since``.

    (A stale one left by the previous kill does not count; the trainer removes it.)
    """
    folder = dump / "checkpoint"
    try:
        return any(
            e.name.endswith(".partial") and e.stat().st_mtime > since for e in os.scandir(folder)
        )
    except OSError:
        return False


def run_until(proc: subprocess.Popen, dump: Path, kind: str, at_step: int, timeout: float) -> bool:
    """Wait for the kill moment; True if it came before the job ended."""
    deadline, started = time.monotonic() + timeout, time.time()
    while proc.poll() is None and time.monotonic() < deadline:
        if (kind == "save" and saving(dump, started)) or (
            kind == "step" and last_step(dump) >= at_step
        ):
            return True
        time.sleep(0.003)
    return False


def kill(proc: subprocess.Popen, target: str, rng: random.Random):
    ranks = launcher_workers(proc.pid)
    if target == "one" and ranks:
        os.kill(rng.choice(ranks), signal.SIGKILL)
    else:
        for pid in [*ranks, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
    return subprocess.Popen(
        cmd, cwd=REPO, env=run_env(), stdout=open(log, "a"), stderr=subprocess.STDOUT
    )


def trial(
    args, index: int, dump: Path, extra: list[str], rng: random.Random, tally: Tally
) -> dict[int, float]:
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    log = dump / "runs.log"
    for k in range(args.kills + 1):
        proc = launch(command(args, dump, extra), log)
        if k < args.kills:
            # The very first kill lands in a save, so every campaign covers that case.
            kind = "save" if index == 0 and k == 0 else rng.choice(["step", "save"])
            target = rng.choice(["all", "one"])
            at_step = rng.randint(last_step(dump) + 1, args.steps)
            if run_until(proc, dump, kind, at_step, args.timeout):
                during_save = saving(dump)
                kill(proc, target, rng)
                tally.kills += 1
                tally.kills_during_save += during_save
                print(
                    f"  trial {index}: killed {target} rank(s) {'during a save' if during_save else 'in a step'} at step {last_step(dump)}"
                )
                continue
        if proc.wait(timeout=args.timeout) != 0:
            raise SystemExit(f"trial {index}: training failed; see {log}")
        break
    tally.resumes += log.read_text().count("loaded checkpoint")
    return losses(dump)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kills", type=int, default=3, help="kills per trial")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--config", default=DEBUG_CONFIG)
    p.add_argument("--dump-folder", default="outputs/fault_injection")
    p.add_argument("--timeout", type=float, default=300)
    args, extra = p.parse_known_args(argv)
    root = Path(args.dump_folder).resolve()
    rng = random.Random(args.seed)
    tally = Tally()

    reference_dump = root / "reference"
    shutil.rmtree(reference_dump, ignore_errors=True)
    reference_dump.mkdir(parents=True)
    if launch(command(args, reference_dump, extra), reference_dump / "runs.log").wait() != 0:
        raise SystemExit(f"reference run failed; see {reference_dump / 'runs.log'}")
    reference = losses(reference_dump)

    for i in range(args.trials):
        got = trial(args, i, root / f"trial-{i}", extra, rng, tally)
        tally.trials += 1
        bad = [s for s in reference if got.get(s) != reference[s]] + [
            s for s in got if s not in reference
        ]
        tally.mismatches += len(bad)
        print(f"  trial {i}: {'exact' if not bad else f'MISMATCH at steps {bad}'}")
        config = ["--job.config_file", args.config, *extra]
        if check_provenance([str(root / f"trial-{i}" / "provenance"), *config]) != 0:
            tally.provenance_failures += 1

    print(f"\ntrials {tally.trials}  kills {tally.kills}  kills during a save {tally.kills_during_save}  "
          f"resumes {tally.resumes}  mismatched steps {tally.mismatches}  "
          f"provenance failures {tally.provenance_failures}")  # fmt: skip
    ok = tally.mismatches == 0 and tally.provenance_failures == 0
    print("PASS: every trial matches the reference bit for bit" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
