"""Warmup-stable-decay schedules and cooldown branches (``checkpoint.branch_from``).

The shapes' values are checked at points whose exact values are known by hand (progress
at 1/4, 1/2, perfect squares for 1-sqrt, min_lr_ratio 1/4: every product exact in
binary). The branch is checked end to end, in this process, on the debug config: a
cooldown branched from step 4 of a stable run trains bit for bit as the run that had the
cooldown's schedule from step 0, and the stable run's folder and lease are untouched.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CONFIG, REPO, error_lines, losses, read_jsonl, train_here

from torchtitan.checkpoint import branch
from torchtitan.checkpoint.folder import CheckpointError
from torchtitan.checkpoint.lease import Lease
from torchtitan.config import ConfigError, parse_args
from torchtitan.hf import read_dcp_model
from torchtitan.optim import build_lr_scheduler, lr_factor

# ---- the shapes -------------------------------------------------------------------------

# warmup 2, 10 steps, the last 4 decaying (optimizer steps 6..9 = training steps 7..10)
W, T, N, MIN = 2, 10, 4, 0.25


@pytest.mark.parametrize(
    "shape, first, middle",  # values at decay progress 1/4 and 1/2
    [("linear", 0.8125, 0.625), ("cosine", None, 0.625), ("sqrt", 0.625, None)],
)
def test_wsd_warmup_stable_then_decay_to_the_minimum_at_the_last_step(shape, first, middle):
    """Warmup (k+1)/(W+1); the peak from the warmup's end to the step before the decay;
    the decay's first step already below the peak, its last exactly at min_lr_ratio."""
    f = [lr_factor(k, W, T, shape, MIN, N) for k in range(T)]
    assert f[:2] == [1 / 3, 2 / 3]  # warmup: its last step below the peak
    assert f[2:6] == [1.0] * 4  # stable, up to the step before the decay
    assert f[6] < 1.0 and f[9] == MIN
    if first is not None:  # linear 0.25 + 0.75 * 3/4; 1-sqrt(1/4) = 1/2
        assert f[6] == first
    if middle is not None:  # linear 1/2; cosine 0.5 * (1 + cos(pi/2)) = 1/2
        assert f[7] == middle
    assert all(a > b for a, b in zip(f[5:], f[6:]))  # strictly down through the decay


def test_one_minus_sqrt_at_perfect_squares():
    """1-sqrt over 16 steps: at progress j^2/16 the factor is MIN + (1 - MIN)(1 - j/4)."""
    total, n = 20, 16  # the decay is optimizer steps 4..19; step 4 + i - 1 has progress i/16
    got = [lr_factor(4 + j * j - 1, 2, total, "sqrt", MIN, n) for j in (1, 2, 3, 4)]
    assert got == [0.8125, 0.625, 0.4375, 0.25]
    assert lr_factor(3, 2, total, "sqrt", MIN, n) == 1.0  # the step before: the peak


def test_without_a_decay_length_the_curve_running_jobs_are_on_is_kept():
    """No decay_steps: the decay follows the warmup as before this change (its first step
    at the peak), so a job resumed on this version keeps its LRs bit for bit. Control:
    a WSD decay as long as the whole post-warmup span is one step ahead of it."""

    def before(step, warmup, total, kind, min_ratio):  # the formula released before WSD
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant" or total <= warmup:
            return 1.0
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        d = 0.5 * (1.0 + math.cos(math.pi * p)) if kind == "cosine" else 1.0 - p
        return min_ratio + (1.0 - min_ratio) * d

    for kind in ("linear", "cosine", "constant"):
        for k in range(14):
            assert lr_factor(k, 3, 12, kind, 0.1) == before(k, 3, 12, kind, 0.1), (kind, k)
    assert lr_factor(3, 3, 12, "linear", 0.1) == 1.0
    assert lr_factor(3, 3, 12, "linear", 0.1, 9) < 1.0


def lrs(*argv, steps=16) -> list[float]:
    """Every step's LR of the schedule a job builds from ``argv`` (a real optimizer)."""
    argv = [*CONFIG, "--training.steps", steps, "--lr_scheduler.min_lr_ratio", MIN, *argv]
    cfg = parse_args([str(a) for a in argv])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.step()
    return out


def test_decay_ratio_is_decay_steps_of_the_rounded_share():
    """decay_ratio 0.25 of 16 steps is decay_steps 4; 0.07 of 100 (7.000000000000001 in
    floats) is 7. Control: 5 steps (0.3125) is another schedule."""
    four = lrs("--lr_scheduler.decay_steps", 4)
    assert lrs("--lr_scheduler.decay_ratio", 0.25) == four
    assert four[11] == 8e-4 and four[12] < 8e-4 and four[15] == 8e-4 * MIN
    assert lrs("--lr_scheduler.decay_ratio", 0.3125) != four
    seven = lrs("--lr_scheduler.decay_steps", 7, steps=100)
    assert lrs("--lr_scheduler.decay_ratio", 0.07, steps=100) == seven


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--lr_scheduler.decay_steps", 4, "--lr_scheduler.decay_ratio", 0.2],
         ["lr_scheduler.decay_ratio 0.2", "lr_scheduler.decay_steps 4", "only one"]),
        (["--lr_scheduler.decay_steps", 4, "--lr_scheduler.decay_type", "constant"],
         ["lr_scheduler.decay_steps 4", "'constant'", "linear, cosine or sqrt"]),
        (["--lr_scheduler.decay_ratio", 0.01],
         ["lr_scheduler.decay_ratio 0.01", "training.steps 16", "0 steps", "raise it"]),
        (["--lr_scheduler.decay_steps", 15],
         ["lr_scheduler.decay_steps 15", "overlaps the warmup", "leaves 14", "raise training.steps"]),
        (["--checkpoint.branch_from", "/x/step-4"],
         ["checkpoint.branch_from '/x/step-4'", "--checkpoint.enable_checkpoint"]),
        (["--checkpoint.enable_checkpoint", "--checkpoint.branch_from", "/x/step-4",
          "--checkpoint.initial_load_path", "/x/step-4"],
         ["checkpoint.branch_from", "checkpoint.initial_load_path", "only one"]),
        (["--checkpoint.enable_checkpoint", "--job.dump_folder", "/runs/a",
          "--checkpoint.branch_from", "/runs/a/checkpoint/step-4"],
         ["checkpoint.branch_from '/runs/a/checkpoint/step-4'", "own checkpoint folder",
          "--job.dump_folder"]),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_naming_the_key(argv, fragments):
    """Each broken rule is one ConfigError line with the key, the value and the fix.
    Control: the nearest valid setting parses."""
    with pytest.raises(ConfigError) as info:
        parse_args([*CONFIG, "--training.steps", "16", *map(str, argv)])
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


@pytest.mark.parametrize(
    "argv",
    [
        ["--lr_scheduler.decay_steps", 14],
        ["--lr_scheduler.decay_ratio", 0.05],
        ["--checkpoint.enable_checkpoint", "--job.dump_folder", "/runs/b",
         "--checkpoint.branch_from", "/runs/a/checkpoint/step-4"],
    ],
)  # fmt: skip
def test_the_nearest_valid_settings_parse(argv):
    parse_args([*CONFIG, "--training.steps", "16", *map(str, argv)])


# ---- a cooldown is a branch -------------------------------------------------------------

SMALL = ["--training.seq_len", 32, "--training.batch_size", 2, "--metrics.log_freq", 1,
         "--checkpoint.enable_checkpoint"]  # fmt: skip
# The cooldown: 8 steps, the last 4 (5..8) decaying; the stable run's horizon is far off.
COOLDOWN = ["--training.steps", 8, "--lr_scheduler.decay_steps", 4]
STABLE = ["--training.steps", 40, "--lr_scheduler.decay_steps", 8, "--training.stop_at_step", 8,
          "--checkpoint.interval", 4]  # fmt: skip


@pytest.fixture(scope="module")
def stable(tmp_path_factory) -> Path:
    """Run A: the stable run to step 8 (its decay at 33..40 never reached), step-4 and step-8."""
    dump = tmp_path_factory.mktemp("wsd") / "a"
    train_here(dump, *SMALL, *STABLE)
    return dump


def snapshot(folder: Path) -> dict:
    """Every file and folder under ``folder``: its mtime (ns), and a file's SHA-256; the
    lease file's bytes alone (its mtime is its holder's heartbeat)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        data = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        mtime = None if path.name == "lease.json" else os.stat(path).st_mtime_ns
        out[str(path.relative_to(folder))] = (mtime, data)
    return out


def weights(step_dir: Path) -> dict:
    return read_dcp_model(str(step_dir))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_cooldown_branch_equals_the_run_that_had_its_schedule_from_step_0(stable, tmp_path):
    """B branches from A's step-4 (weights, moments, data position, RNG, step, guard) with
    a decay over steps 5..8, saves step-6, is requeued and finishes; C has the same
    schedule from step 0. B's losses and LRs at 5..8 are C's, B's final weights
    torch.equal C's, and A and C coincide up to step 4. While B runs, A's lease is held
    (as by A still training): B takes nothing there, and A's folder (every file's bytes
    and mtime) is unchanged. The requeue resumes B's own step-6, not A's step-4.
    Control: a run from A's step-4 weights alone (initial_load_path) differs from C."""
    source = stable / "checkpoint" / "step-4"
    lease = Lease(str(stable / "checkpoint"), timeout_s=600, wait_s=0)
    lease.acquire()
    try:
        before = snapshot(stable)
        common = [*SMALL, *COOLDOWN, "--checkpoint.interval", 2, "--checkpoint.branch_from",
                  source, "--checkpoint.lease_wait_seconds", 0]  # fmt: skip
        _, log = train_here(tmp_path / "b", *common, "--training.stop_at_step", 6)
        assert f"branching from {source}" in log
        _, log = train_here(tmp_path / "b", *common)  # the requeue
        assert f"loaded checkpoint {tmp_path / 'b' / 'checkpoint' / 'step-6'} (" in log
        assert "branching" not in log
        assert snapshot(stable) == before
        lease.check()  # still A's: nobody took it over
    finally:
        lease.release()
    train_here(tmp_path / "c", *SMALL, *COOLDOWN, "--checkpoint.interval", 8)
    a, b, c = (losses(stable), losses(tmp_path / "b"), losses(tmp_path / "c"))
    assert [a[s] for s in range(1, 5)] == [c[s] for s in range(1, 5)]
    assert sorted(b) == [5, 6, 7, 8] and [b[s] for s in b] == [c[s] for s in b]
    lr = {name: {r["step"]: r["lr"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")}
          for name in ("b", "c")}  # fmt: skip
    assert [lr["b"][s] for s in range(5, 9)] == [lr["c"][s] for s in range(5, 9)]
    assert lr["c"][4] == 8e-4 > lr["c"][5]  # the decay begins at step 5
    final = weights(tmp_path / "c" / "checkpoint" / "step-8")
    assert same_weights(weights(tmp_path / "b" / "checkpoint" / "step-8"), final)

    train_here(tmp_path / "d", *SMALL, "--training.steps", 4, "--lr_scheduler.decay_steps", 4,
               "--lr_scheduler.warmup_steps", 0, "--checkpoint.initial_load_path", source)  # fmt: skip
    d = losses(tmp_path / "d")
    assert all(d[s] != c[s + 4] for s in range(1, 5))
    assert not same_weights(weights(tmp_path / "d" / "checkpoint" / "step-4"), final)


def test_a_source_that_cannot_be_branched_from_is_one_line(stable, tmp_path):
    """Missing, unfinished (no manifest: a save in flight or killed), weights-only (a seed
    checkpoint) and damaged (a flipped byte, found by the verification) sources are each
    refused in one line naming checkpoint.branch_from, the path and the fix. Control: A's
    step-4 passes the check."""
    good = stable / "checkpoint" / "step-4"
    branch.check_source(str(good))
    unfinished = tmp_path / "step-4.partial"
    shutil.copytree(good, unfinished)
    (unfinished / "manifest.json").unlink()
    train_here(tmp_path / "seed", *SMALL, "--checkpoint.create_seed_checkpoint")
    for path, fragment in [
        (tmp_path / "absent", "no such folder"),
        (unfinished, "not a finished checkpoint"),
        (tmp_path / "seed" / "checkpoint" / "step-0", "--checkpoint.initial_load_path"),
    ]:
        with pytest.raises(CheckpointError) as info:
            branch.check_source(str(path))
        message = str(info.value)
        assert "\n" not in message and f"checkpoint.branch_from {path}" in message, message
        assert fragment in message, message
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    data = next(damaged.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    status, log = train_here(tmp_path / "e", *SMALL, *COOLDOWN, "--checkpoint.branch_from",
                             damaged, expect_ok=False)  # fmt: skip
    (line,) = error_lines(log)
    assert status == 1 and f"checkpoint.branch_from {damaged} is damaged" in line, log[-2000:]
    assert "another step" in line and "Traceback" not in log


@pytest.mark.slow
def test_two_cooldowns_branched_while_their_source_trains(tmp_path):
    """scripts/wsd_branches.py --smoke: A trains 60 steps while B1 (from its step-20) and
    B2 (from its step-40) run, each in its own folder. A == A run alone, every step's loss
    and LR (the source undisturbed by two branches at once); each branch == its schedule
    from step 0 (C1, C2), losses, LRs and final weights; A trained while each branch ran
    (the overlap the script records, else it fails). The checks' failure paths: the
    script exits 1 naming the run that differs."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "wsd_branches.py"), "--smoke",
                           "--out", str(tmp_path / "out"), "--picture", str(tmp_path / "p.png")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["problems"] == [] and summary["branch_steps"] == [20, 40]
    assert all(last > first for first, last in summary["overlap"].values()), summary
    assert "A while two branches ran == A alone" in proc.stdout and ": yes" in proc.stdout
    assert (tmp_path / "p.png").stat().st_size > 0
