"""Two cooldowns branched from a stable run while it trains on, checked and drawn.

    python scripts/wsd_branches.py [--out outputs/wsd_branches] [--picture FILE.png] [--smoke]

Run A trains the debug model under warmup-stable-decay (its own decay far off at the
end). While A trains, two branches start from A's checkpoints (``checkpoint.branch_from``),
each in its own dump folder, with a short decay of their own (``lr_scheduler.decay_steps``
and ``training.steps``): B1 from an early checkpoint, B2 from a later one, B1 and B2
overlapping A and, where they can, each other. Then, with nothing else running:

- A': A's command again, alone. A's loss and LR at every step ``==`` A''s: the branches
  did not disturb the run they read (no lease taken, nothing written into its folder);
- C1, C2: each branch's schedule from step 0. Each branch's losses and LRs ``==`` its
  C's from the branch step on, and its final weights ``torch.equal`` C's.

One line per check, and exit 1 at the first failed one; with ``--picture``, A's and the
branches' LR and loss on two panels. Every run is one process (``python train.py``) on
the bundled corpus, so the three at once fit a 2-core machine.

Cost: five runs of the debug model (A and A' of ``--steps`` steps; the branches and
their C's of their branch step plus the cooldown): about 2 minutes on 2 cores in full,
30 s with ``--smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

COMMON = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "64",
          "--training.batch_size", "4", "--metrics.log_freq", "1",
          "--checkpoint.enable_checkpoint", "--lr_scheduler.warmup_steps", "10"]  # fmt: skip


def run_env() -> dict:
    from torchtitan.tools.launch import run_env as env

    return env()


def command(dump: Path, steps: int, decay: int, extra=()) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *COMMON, "--job.dump_folder", str(dump),
            "--training.steps", str(steps), "--lr_scheduler.decay_steps", str(decay),
            *map(str, extra)]  # fmt: skip


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=out, stderr=subprocess.STDOUT)


def records(dump: Path) -> dict[int, dict]:
    """Step -> its metrics.jsonl record (the last one of a step written twice)."""
    path = dump / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "loss" in r:
            out[r["step"]] = r
    return out


def wait_for(check, proc: subprocess.Popen, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise SystemExit(f"error: {what}: the run ended first (exit {proc.returncode})")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {what}: not within {timeout:g}s")
        time.sleep(0.05)


def finish(proc: subprocess.Popen, log: Path, name: str):
    if proc.wait(timeout=900) != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"error: run {name} exited {proc.returncode}: {' | '.join(tail)}")


def same(a: dict[int, dict], b: dict[int, dict], steps, key: str) -> list[int]:
    """The steps where ``key`` differs (or is missing on either side)."""
    return [s for s in steps if s not in a or s not in b or a[s][key] != b[s][key]]


def final_weights_equal(x: Path, y: Path, step: int) -> bool:
    import torch

    from torchtitan.hf import read_dcp_model

    a = read_dcp_model(str(x / "checkpoint" / f"step-{step}"))
    b = read_dcp_model(str(y / "checkpoint" / f"step-{step}"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plot(out: Path, runs: dict[str, dict[int, dict]], branch_steps: dict[str, int]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    colors = {"A": "tab:gray", "B1": "tab:blue", "B2": "tab:orange"}
    averaged = {}  # A's EMA by step: a branch's begins from A's at its branch step
    for name, recs in runs.items():
        steps = sorted(recs)
        top.plot(steps, [recs[s]["lr"] for s in steps], color=colors[name], label=name)
        losses = [recs[s]["loss"] for s in steps]
        smooth, ema = [], averaged.get(branch_steps.get(name))
        for step, v in zip(steps, losses):  # a step's loss is noisy: an EMA (0.9) over it
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
            if name == "A":
                averaged[step] = ema
        bottom.plot(steps, losses, color=colors[name], alpha=0.2, linewidth=0.8)
        bottom.plot(steps, smooth, color=colors[name], label=name)
    for name, step in branch_steps.items():
        for ax in (top, bottom):
            ax.axvline(step, color=colors[name], linestyle=":", linewidth=0.8)
    top.set_ylabel("learning rate")
    bottom.legend(title="run (B: a cooldown branched from A)", loc="upper right")
    bottom.set_ylabel("training loss (EMA 0.9; faint: each step's)")
    bottom.set_xlabel("step")
    top.set_title("A stable WSD run and two cooldowns branched from it while it trained")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="outputs/wsd_branches")
    p.add_argument("--picture", default="", help="write the LR and loss picture here")
    p.add_argument("--smoke", action="store_true", help="a short run of the same checks")
    args = p.parse_args(argv)
    # A's horizon and its own decay; the branch steps (A's checkpoints) and their cooldown
    steps, decay, interval, at, cool = (60, 12, 10, (20, 40), 10) if args.smoke else \
        (400, 80, 50, (100, 250), 50)  # fmt: skip
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    names = ["B1", "B2"]
    a_cmd = command(out / "A", steps, decay, ["--checkpoint.interval", interval])
    a = start(a_cmd, out / "A.log")
    branches, overlap = {}, {}
    for name, step in zip(names, at):
        source = out / "A" / "checkpoint" / f"step-{step}"
        wait_for(lambda s=source: (s / "manifest.json").exists(), a, f"A's step-{step}")
        b_cmd = command(out / name, step + cool, cool,
                        ["--checkpoint.interval", cool, "--checkpoint.branch_from", source,
                         "--checkpoint.lease_wait_seconds", 0])  # fmt: skip
        branches[name] = (start(b_cmd, out / f"{name}.log"), b_cmd, step)
        overlap[name] = [max(records(out / "A"), default=0)]
    for name, (proc, _, _) in branches.items():
        finish(proc, out / f"{name}.log", name)
        overlap[name].append(max(records(out / "A"), default=0))
    finish(a, out / "A.log", "A")
    for name, (first, last) in overlap.items():
        print(f"{name} started at A's step {first}; A's step when {name} ended: {last}")
        if last <= first:
            print(f"error: A did not train while {name} ran: nothing shows the source undisturbed")
            return 1

    # Alone now: A again, and each branch's schedule from step 0.
    finish(start([*a_cmd[:a_cmd.index("--job.dump_folder") + 1], str(out / "A_alone"),
                  *a_cmd[a_cmd.index("--job.dump_folder") + 2:]], out / "A_alone.log"),
           out / "A_alone.log", "A'")  # fmt: skip
    runs = {"A": records(out / "A")}
    problems = []
    off = same(runs["A"], records(out / "A_alone"), range(1, steps + 1), "loss")
    off += same(runs["A"], records(out / "A_alone"), range(1, steps + 1), "lr")
    print(f"A while two branches ran == A alone, loss and LR at steps 1..{steps}: "
          f"{'yes' if not off else 'NO, steps ' + str(sorted(set(off))[:8])}")  # fmt: skip
    if off:
        problems.append("A differs from A alone")
    for name, (_, _, step) in branches.items():
        c = out / f"C{name[1:]}"
        finish(start(command(c, step + cool, cool, ["--checkpoint.interval", step + cool]),
                     out / f"C{name[1:]}.log"), out / f"C{name[1:]}.log", c.name)  # fmt: skip
        b, ref = records(out / name), records(c)
        window = range(step + 1, step + cool + 1)
        off = same(b, ref, window, "loss") + same(b, ref, window, "lr")
        weights = final_weights_equal(out / name, c, step + cool)
        print(f"{name} (from A's step-{step}) == {c.name} (its schedule from step 0), loss and "
              f"LR at steps {step + 1}..{step + cool}: {'yes' if not off else 'NO'}; final "
              f"weights torch.equal: {'yes' if weights else 'NO'}")  # fmt: skip
        if off or not weights:
            problems.append(f"{name} differs from {c.name}")
        runs[name] = b
    if args.picture:
        plot(Path(args.picture), runs, dict(zip(names, at)))
        print(f"wrote {args.picture}")
    summary = {"steps": steps, "branch_steps": list(at), "cooldown": cool, "overlap": overlap,
               "problems": problems}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    if problems:
        print("error: " + "; ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS") is None:
        os.environ["OMP_NUM_THREADS"] = "1"
    sys.exit(main())
