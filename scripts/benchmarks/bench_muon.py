"""Muon against AdamW: the step time on the debug and MoE models, and the bytes a step
moves between 2 ranks.

    python scripts/benchmarks/bench_muon.py [--steps 40] [--rounds 2] [--smoke] [--json out.json]

The product path: ``train.py`` with ``--optimizer.name AdamW`` and ``Muon`` (everything
else the config's), interleaved ``--rounds`` times, the median ``step_ms`` of each run's
steps after the third (``metrics.log_freq 1``), then the median over rounds:

- one process, one thread: ``debugmodel`` and ``debug_moe``;
- 2 ranks (torchrun, gloo, FSDP 2, one thread each): the same two models. Muon's
  whole-matrix redistribution runs here (each rank holds half of every matrix).

The bytes a step moves: every byte the 2 ranks send each other goes over the loopback
interface, whose transmit counter (``/proc/net/dev``) is read before and after each
job. Two jobs of the same command, of ``--steps`` and of twice as many steps: their
difference, over the extra steps, is a steady step's bytes with the start-up (process
groups, the model's first all-gather, the data plan) cancelled. Gloo's own framing is
included; the machine must be otherwise quiet on loopback (``--require-quiet`` checks the
CPU, not the network). FSDP's all-gathers and reduce-scatters are in both optimizers'
figure; the difference is Muon's redistribution (torchtitan/muon.py states its bytes).
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

import _root  # noqa: F401 - the repository's root on the path: harness, this torchtitan

from harness import bench
from harness.jobs import torchrun
from torchtitan import REPO_ROOT as REPO
from torchtitan.records.runs import read_records

MODELS = {
    "debugmodel": "train_configs/debug_model.toml",
    "debug_moe": "train_configs/debug_moe.toml",
}
OPTIMIZERS = ("AdamW", "Muon")


def loopback_tx() -> int:
    """Bytes sent on the loopback interface since boot (Linux: /proc/net/dev)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise SystemExit("error: no loopback interface in /proc/net/dev: run on Linux")


def steady_ms(folder: Path) -> float:
    return statistics.median(
        r["step_ms"] for r in read_records(folder / "metrics.jsonl") if r["step"] > 3
    )


def job(model: str, optimizer: str, ranks: int, steps: int, folder: Path) -> tuple[float, int]:
    """(median step ms, loopback bytes sent during the whole job) of one run."""
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--job.config_file", MODELS[model], "--job.dump_folder", str(folder),
            "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--optimizer.name", optimizer]  # fmt: skip
    before = loopback_tx()
    if ranks == 1:
        import os
        import subprocess

        proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)  # fmt: skip
    else:
        proc = torchrun(ranks, args)
    sent = loopback_tx() - before
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return steady_ms(folder), sent


def main(argv=None) -> int:
    p = bench.Arguments(__doc__, smoke={"steps": 6, "rounds": 1}, rounds=2, work="")
    p.add_argument("--steps", type=int, default=40, help="steps per run (the bytes: and 2x)")
    args = p.parse(argv)
    ms = {(m, o, r): [] for m in MODELS for o in OPTIMIZERS for r in (1, 2)}
    per_step = {(m, o): [] for m in MODELS for o in OPTIMIZERS}
    jobs_kb = []  # each 2-rank job's whole loopback bytes (its own traffic at least)
    with bench.work_folder(args, "bench-muon-") as work:
        for _ in range(args.rounds):
            for model in MODELS:
                for opt in OPTIMIZERS:
                    ms[model, opt, 1].append(job(model, opt, 1, args.steps, work / "one")[0])
                    short, sent_short = job(model, opt, 2, args.steps, work / "two")
                    _, sent_long = job(model, opt, 2, 2 * args.steps, work / "two")
                    ms[model, opt, 2].append(short)
                    per_step[model, opt].append((sent_long - sent_short) / args.steps)
                    jobs_kb += [sent_short / 1e3, sent_long / 1e3]
    med = {k: statistics.median(v) for k, v in ms.items()}
    kb = {k: statistics.median(v) / 1e3 for k, v in per_step.items()}
    result = {
        **bench.about(argv, commit=True),
        "smoke": args.smoke,
        "steps": args.steps,
        "rounds": args.rounds,
        "step_ms": {f"{m}/{o}/{r}rank": v for (m, o, r), v in med.items()},
        "muon_over_adamw": {
            f"{m}/{r}rank": med[m, "Muon", r] / med[m, "AdamW", r] for m in MODELS for r in (1, 2)
        },  # fmt: skip
        "kb_per_step_2ranks": {f"{m}/{o}": v for (m, o), v in kb.items()},
        "kb_per_job_2ranks": jobs_kb,
    }
    rows = []
    for m in MODELS:
        for r in (1, 2):
            a, u = med[m, "AdamW", r], med[m, "Muon", r]
            rows.append([f"{m}, {'1 process' if r == 1 else '2 ranks (FSDP 2)'}", f"{a:.1f}",
                         f"{u:.1f}", f"{u / a:.2f}"])  # fmt: skip
    bench.print_table(["model", "AdamW step ms", "Muon step ms", "Muon / AdamW"], rows)
    bench.print_table(["model, 2 ranks", "AdamW KB/step", "Muon KB/step", "Muon - AdamW"],
                      [[m, f"{kb[m, 'AdamW']:.0f}", f"{kb[m, 'Muon']:.0f}",
                        f"{kb[m, 'Muon'] - kb[m, 'AdamW']:+.0f}"] for m in MODELS])  # fmt: skip
    return bench.save(args, result)


if __name__ == "__main__":
    sys.exit(main())
