"""Broken steps and loss spikes (torchtitan/spikes.py and the loop's rewind): a broken
step is never applied, repeated ones stop the job in one line, spikes are detected
alike after a resume, and a rewind that skips data trains as a run started with the
same skip list, bit for bit. Faults come from the test-only hook (spikes.FAULT_ENV).

Every run is the debug model in this process (train.main) for a few steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
from helpers import CONFIG, REPO, error_lines, rank_context, read_jsonl, train, train_here

import train as train_script
from torchtitan import parallel
from torchtitan.checkpoint import TrainState
from torchtitan.config import ConfigError, parse_args
from torchtitan.data.state import from_tensor
from torchtitan.records.provenance import read_provenance, read_skips, sequences_by_step
from torchtitan.records.runs import losses
from torchtitan.spikes import FAULT_ENV, SpikeGuard, TrainingError
from torchtitan.tools.check_provenance import main as check_provenance
from torchtitan.tools.launch import run_env, torchrun_command
from torchtitan.tools.plot_spikes import plot_spikes, spike_series

SMALL = ["--training.seq_len", 32, "--training.batch_size", 2, "--metrics.log_freq", 1]


@pytest.fixture
def snapshots(monkeypatch) -> list:
    """The weights and Adam's moments after every step call of the next run, in order."""
    taken = []
    real = train_script.feed_and_step

    def feed_and_step(run, batch_loss):
        feed, step = real(run, batch_loss)

        def stepped(batches):
            out = step(batches)
            local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                     for p in run.model.parameters()]  # fmt: skip
            moments = [
                s["exp_avg"].to_local() if hasattr(s["exp_avg"], "to_local") else s["exp_avg"]
                for s in run.optimizer.state.values()
            ]
            taken.append(([t.clone() for t in local], [m.clone() for m in moments]))
            return out

        return feed, stepped

    monkeypatch.setattr(train_script, "feed_and_step", feed_and_step)
    return taken


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def records(dump) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(dump / "metrics.jsonl")}


# ---- a broken step is never applied ---------------------------------------------------


@pytest.mark.parametrize("kind", ["nan", "inf", "nan_value", "nan_grad"])
def test_a_broken_step_is_never_applied_and_the_norm_carries_it(tmp_path, monkeypatch, snapshots,
                                                                kind):  # fmt: skip
    """A NaN or inf loss, a NaN loss value whose gradient is finite (the rank that saw it
    must reach the others: its gradient is poisoned, so the norm every rank computes is
    NaN), or a NaN gradient with a finite loss (a peer's NaN after the reduction): the
    weights and moments after step 3 equal those after step 2; step 4 trains again.
    Negative control: with the verdict ignored, step 3 changes the weights."""
    monkeypatch.setenv(FAULT_ENV, f"3:{kind}")
    _, log = train_here(tmp_path / "a", "--training.steps", 4, *SMALL)
    assert same(snapshots[2][0], snapshots[1][0]) and same(snapshots[2][1], snapshots[1][1])
    assert not same(snapshots[3][0], snapshots[2][0])
    assert all(torch.isfinite(t).all() for t in snapshots[3][0])
    steps = records(tmp_path / "a")
    assert math.isnan(steps[3]["grad_norm"])  # the reduced norm: what every rank decides on
    assert steps[3]["bad_steps"] == 1 and steps[4]["bad_steps"] == 1
    said = [line for line in log.splitlines() if "step 3: loss" in line]
    assert len(said) == 1 and "dropped on every rank" in said[0] and "bundled:" in said[0]
    snapshots.clear()
    monkeypatch.setattr(SpikeGuard, "decide", lambda self, *a: True)
    train_here(tmp_path / "b", "--training.steps", 3, *SMALL)
    assert not same(snapshots[2][0], snapshots[1][0])


def test_the_step_after_a_dropped_one_moves_the_schedule_on(tmp_path, monkeypatch):
    """A dropped step counts: the LR schedule and the data move on. The run with step 3
    dropped logs the same LR at step 4 as a clean run, and reads the same batches."""
    monkeypatch.setenv(FAULT_ENV, "3:nan")
    common = ["--training.steps", 4, "--metrics.data_provenance", *SMALL]
    train_here(tmp_path / "a", *common)
    monkeypatch.delenv(FAULT_ENV)
    train_here(tmp_path / "b", *common)
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [a[s]["lr"] for s in a] == [b[s]["lr"] for s in b]
    pa = sequences_by_step(read_provenance(tmp_path / "a" / "provenance"))
    pb = sequences_by_step(read_provenance(tmp_path / "b" / "provenance"))
    assert pa == pb
    assert a[4]["loss"] != b[4]["loss"]  # control: step 4 trains on step 2's weights


def test_a_diverged_run_stops_with_one_line(tmp_path, monkeypatch):
    """The issue's repro: --optimizer.lr 1e12 goes NaN from step 2; max_bad_steps (3) in a
    row stop it with one error line naming them. Negative control: broken steps that are
    not in a row (2, 3, 5) do not stop a run."""
    status, log = train_here(tmp_path / "a", "--training.steps", 8, "--optimizer.lr", 1e12,
                             *SMALL, expect_ok=False)  # fmt: skip
    assert status == 1
    (line,) = error_lines(log)
    assert "steps 2-4 had a non-finite loss" in line and "max_bad_steps 3" in line
    assert "Traceback" not in log
    monkeypatch.setenv(FAULT_ENV, "2:nan,3:nan,5:inf")
    train_here(tmp_path / "b", "--training.steps", 6, *SMALL)
    assert records(tmp_path / "b")[6]["bad_steps"] == 3


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--training.on_spike", "rewind"], "checkpoint.enable_checkpoint is false"),
        (["--training.on_spike", "skip_step", "--training.spike_window", 0], "no spike check"),
        (["--training.on_spike", "rewind", "--checkpoint.enable_checkpoint",
          "--fault_tolerance.enable", "--fault_tolerance.lighthouse", "http://h:1",
          "--job.dump_folder", "outputs/replica_0"],
         "not available with fault_tolerance.enable"),
        (["--training.skip_steps", "8-6"], "training.skip_steps '8-6'"),
        (["--training.skip_steps", "a-b"], "write it as first-last"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_are_one_line(argv, fragment):
    """Each impossible setting is one ConfigError line naming it. Negative control: the
    same policies with what they need are accepted."""
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        parse_args(list(map(str, argv)))
    assert "\n" not in str(info.value)
    parse_args(["--training.on_spike", "rewind", "--checkpoint.enable_checkpoint",
                "--training.skip_steps", "3,6-8"])  # fmt: skip


# ---- spike detection ------------------------------------------------------------------


def guard(*argv) -> SpikeGuard:
    cfg = parse_args(list(map(str, ["--training.spike_window", 8, *argv])))
    dims = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
    return SpikeGuard(cfg, dims, TrainState())


def feed(g: SpikeGuard, values: list[tuple[float, float]]) -> list[str]:
    """Each step decided on the device and learned by the host at once (a log step's way)."""
    verdicts = []
    for loss, norm in values:
        g.decide(torch.tensor(loss), torch.tensor(norm), [])
        g.learn(g.next_step, now=True)
        verdicts.append(g.verdict if g.last_event is None else g.last_event["action"] + "!")
        g.train_state.step += 1
    return verdicts


NOISE = [(3.0 + 0.01 * math.sin(i), 1.0 + 0.02 * math.cos(i)) for i in range(8)]


@pytest.mark.parametrize("policy,verdict", [("log", "apply!"), ("skip_step", "skip!")])
def test_a_spike_is_seen_after_the_window_fills(policy, verdict):
    """Nothing is checked while the window fills; then a loss or a norm far above it is a
    spike, and the policy says what it does. Negative controls: the same jump inside the
    warm-up, and a value inside the noise, are not spikes."""
    g = guard("--training.on_spike", policy)
    assert feed(g, [(30.0, 1.0)] + NOISE[1:]) == ["apply"] * 8  # warm-up: not checked
    g = guard("--training.on_spike", policy)  # nor after a first value (the window's rest unfilled)
    assert feed(g, [NOISE[0], (30.0, 1.0)] + NOISE[2:]) == ["apply"] * 8
    g = guard("--training.on_spike", policy)
    assert feed(g, NOISE) == ["apply"] * 8
    assert feed(g, [(3.005, 1.0), (3.5, 1.0), (3.0, 9.0)]) == ["apply", verdict, verdict]
    assert g.counts["spikes"] == 2
    g = guard("--training.spike_max_loss", 10)
    assert feed(g, [(3.0, 1.0), (11.0, 1.0)]) == ["apply", "apply!"]  # a bound from step 1


def test_spikes_skipped_for_ever_stop_the_job():
    """A loss that moved for good is a spike at every step under skip_step (it never
    enters the window): max_bad_steps of them in a row stop the job in one line, as
    broken steps do. Negative control: under log the run trains on."""
    for policy, stops in (("skip_step", True), ("log", False)):
        g = guard("--training.on_spike", policy)
        feed(g, NOISE + [(9.0, 1.0)] * 3)
        if stops:
            with pytest.raises(TrainingError, match="steps 9-11 were dropped, broken or spikes"):
                g.check_bad_steps()
        else:
            g.check_bad_steps()


# Two ranks' losses around 3 and 5 (their mean around 4), then two steps: rank 1 alone
# jumps (the mean is a spike, rank 0's own loss is not), and the ranks move apart
# evenly (the mean stays, rank 0's own loss looks like a spike).
APART = [[(3.0 + 0.01 * math.sin(i), 1.0), (5.0 - 0.01 * math.sin(i), 1.0)] for i in range(8)]
APART += [[(3.0, 1.0), (6.0, 1.0)], [(3.5, 1.0), (4.5, 1.0)]]


def _spike_rank(rank: int, store: str, out) -> None:
    """One of 2 forked ranks on a gloo group: a skip_step guard fed this rank's losses
    of ``APART``; reports its verdicts."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = parse_args(["--training.spike_window", "8", "--training.on_spike", "skip_step"])
        dims = parallel.ParallelDims(rank, 2, rank, torch.device("cpu"), "gloo",
                                     control_group=dist.new_group(backend="gloo"))  # fmt: skip
        g = SpikeGuard(cfg, dims, TrainState())
        out.put((rank, (feed(g, [s[rank] for s in APART]), g.losses)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_whose_losses_differ_reach_one_verdict(tmp_path):
    """Two forked ranks (gloo) whose losses differ: the spike check reads the loss
    averaged over the ranks, so both drop the step where the mean jumps (rank 1 alone
    spiked) and both apply the one where the ranks move apart evenly; a rank that
    applied an update its peer dropped would leave the replicas different for ever.
    Negative control: each rank's own losses, checked alone (what a guard reading its
    own loss decides), give the ranks different verdicts at both steps."""
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_spike_rank, args=(r, str(tmp_path / "store"), out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (verdicts, windows) = zip(*(got[r] for r in range(2)))
    assert verdicts[0] == verdicts[1] == ["apply"] * 8 + ["skip!", "apply"]
    # The window holds the ranks' mean of each applied step, bit for bit (float32 losses
    # summed in float64 and halved: exact), the same on both ranks; not their sum.
    applied = [s for i, s in enumerate(APART) if i != 8][-8:]
    mean = [(float(torch.tensor(a)) + float(torch.tensor(b))) / 2 for (a, _), (b, _) in applied]
    assert windows[0] == windows[1] == mean
    alone = [feed(guard("--training.on_spike", "skip_step"), [s[r] for s in APART])[8:]
             for r in range(2)]  # fmt: skip
    assert alone == [["apply", "skip!"], ["skip!", "apply"]]


def test_the_guards_state_resumes_its_checks_exactly():
    """A guard loaded from another's state decides as the other does on what follows
    (the window, the counters). Negative control: a fresh guard misses the spike."""
    a = guard("--training.on_spike", "skip_step")
    feed(a, NOISE + [(3.4, 1.0)])
    b = guard("--training.on_spike", "skip_step")
    b.load_state_dict(a.state_dict())
    b.train_state.step = a.train_state.step
    after = [(3.0, 1.0), (3.3, 1.0)]
    assert feed(b, list(after)) == feed(a, list(after)) == ["apply", "skip!"]
    assert b.counts == a.counts and b.losses == a.losses
    assert feed(guard("--training.on_spike", "skip_step"), list(after)) == ["apply", "apply"]


def test_a_guard_loaded_in_a_run_of_dropped_steps_stops_when_the_uninterrupted_one_does():
    """Two broken steps in a row (max_bad_steps 3), saved and loaded into a fresh guard:
    the loaded guard's state is the saved one, bit for bit (its save reads the device's
    counters), and the third broken step stops it, as it stops the uninterrupted guard:
    a job resumed in a run of dropped steps stops at max_bad_steps, not steps later.
    Negative control: a fresh guard (no load) drops that step and trains on."""
    nan = [(float("nan"), 1.0)]
    a = guard("--training.max_bad_steps", 3, "--training.on_spike", "skip_step")
    feed(a, NOISE + nan * 2)
    b = guard("--training.max_bad_steps", 3, "--training.on_spike", "skip_step")
    b.load_state_dict(a.state_dict())
    b.train_state.step = a.train_state.step
    assert torch.equal(b.state_dict()["state"], a.state_dict()["state"])
    for g in (a, b):
        feed(g, nan)
        with pytest.raises(TrainingError, match="steps 9-11 had a non-finite loss"):
            g.check_bad_steps()
    fresh = guard("--training.max_bad_steps", 3, "--training.on_spike", "skip_step")
    fresh.train_state.step = a.train_state.step - 1
    feed(fresh, nan)
    fresh.check_bad_steps()


def test_the_rewinds_records_raise_the_loaded_counters_and_never_lower_them():
    """A start takes each counter as the larger of the loaded checkpoint's and the
    rewinds' records' (the counters only grow): a record ahead of the checkpoint (a
    requeue between a rewind and the next save) raises it, and a record older than the
    checkpoint (the checkpoint written after later spikes) lowers nothing."""
    g = guard()
    g.counts = {"bad_steps": 4, "spikes": 6, "rewinds": 2}
    g.count_rewinds([{"bad_steps": 1, "spikes": 3, "rewinds": 1}])  # older than the checkpoint
    assert g.counts == {"bad_steps": 4, "spikes": 6, "rewinds": 2}
    g.count_rewinds([{"bad_steps": 5, "spikes": 6, "rewinds": 3}])  # ahead of it
    assert g.counts == {"bad_steps": 5, "spikes": 6, "rewinds": 3}
    assert from_tensor(g.state_dict()["state"])["counts"] == g.counts  # and a save holds them


def test_a_resumed_run_detects_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """The guard's state is in the checkpoint: a run stopped at step 4 and resumed detects
    the spike at step 6 (a window of 3, full before the stop) as the uninterrupted run
    does. Negative control: the guard left out of the load misses it."""
    monkeypatch.setenv(FAULT_ENV, "6:x1000")
    common = ["--training.steps", 7, "--training.spike_window", 3, "--checkpoint.enable_checkpoint",
              "--checkpoint.interval", 4, "--training.on_spike", "skip_step", *SMALL]  # fmt: skip
    train_here(tmp_path / "ref", *common)
    train_here(tmp_path / "a", *common, "--training.stop_at_step", 4)
    train_here(tmp_path / "a", *common)
    ref, a = records(tmp_path / "ref"), records(tmp_path / "a")
    assert ref[6]["spikes"] == 1 and [a[s]["loss"] for s in a] == [ref[s]["loss"] for s in ref]
    assert a[7]["spikes"] == 1
    train_here(tmp_path / "b", *common, "--training.stop_at_step", 4)
    train_here(tmp_path / "b", *common, "--checkpoint.exclude_from_loading", "spikes")
    assert records(tmp_path / "b")[7]["spikes"] == 0


# ---- rewind and skip ------------------------------------------------------------------

REWIND = ["--training.steps", 9, "--checkpoint.enable_checkpoint", "--checkpoint.interval", 1,
          "--training.spike_window", 0, "--training.spike_max_loss", 100,
          "--training.on_spike", "rewind",
          "--training.rewind_steps", 2, "--training.skip_after", 1,
          "--model.dropout", 0.1, "--metrics.data_provenance", *SMALL]  # fmt: skip
# Runs that never rewind save only where they stop (a save changes nothing they train).
FEW_SAVES = ["--checkpoint.interval", 100]


def test_a_rewind_trains_as_the_same_skip_list_from_the_start(tmp_path, monkeypatch, snapshots,
                                                              capsys):  # fmt: skip
    """A spike at step 7 rewinds to step-5 (the newest at least rewind_steps 2 before it,
    not step-6) and skips the data of steps 6-8 (to the spike, plus skip_after 1). A
    run started with --training.skip_steps 6-8 logs the same losses (==) and reads the
    same documents from step 6 on, and ends on the same weights (torch.equal).
    Negative control: the skip list one step off (6-7) differs from step 6 on."""
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    ahead = ["--training.skip_steps", 30]  # a skip not reached yet bounds no rewind
    _, log = train_here(tmp_path / "rewound", *REWIND, *ahead)
    rewound = [t.clone() for t in snapshots[-1][0]]
    assert "rewound to checkpoint step-5" in log and "--training.skip_steps 6-8" in log
    monkeypatch.delenv(FAULT_ENV)
    snapshots.clear()
    train_here(tmp_path / "listed", *REWIND, *FEW_SAVES, "--training.skip_steps", "6-8,30")
    assert same(snapshots[-1][0], rewound)
    r, s = records(tmp_path / "rewound"), records(tmp_path / "listed")
    assert sorted(r) == list(range(1, 10)) and r[9]["rewinds"] == 1
    assert [r[k]["loss"] for k in r] == [s[k]["loss"] for k in s]
    pr = sequences_by_step(read_provenance(tmp_path / "rewound" / "provenance"))
    ps = sequences_by_step(read_provenance(tmp_path / "listed" / "provenance"))
    assert pr == ps
    undone = read_jsonl(tmp_path / "rewound" / "provenance" / "rewound_rank0.jsonl")
    assert [u["step"] for u in undone] == [6, 7] and {u["rewind"] for u in undone} == {1}
    assert check_provenance([str(tmp_path / "rewound" / "provenance"), "--steps", "7-7"]) == 0
    listed = capsys.readouterr().out.splitlines()
    spans = [s for seq in undone[1]["sequences"] for s in seq]
    assert [x for x in listed if "rewound #1" in x] == [
        f"step      7  {s[0]}:{s[1]}  tokens {s[2]}-{s[3]}  (rewound #1)" for s in spans
    ]
    assert any("rewound" not in x for x in listed)  # step 7 as the run kept it, too
    assert listed[0].startswith("skipped: the data of steps 6-8 (windows ")
    skips = read_skips(tmp_path / "rewound" / "provenance")
    assert [k["skip_steps"] for k in skips] == [[6, 3]] and skips[0]["step"] == 6
    assert skips == read_skips(tmp_path / "listed" / "provenance")
    entry = json.loads((tmp_path / "rewound" / "spikes.jsonl").read_text().splitlines()[-1])
    assert entry["kind"] == "rewind" and entry["skip_steps"] == [6, 3]
    series = spike_series(tmp_path / "rewound")
    assert series["skipped"] == [[6, 8]] and series["spikes"] == [7]
    assert series["undone"][1][0] == [6, 7] and series["kept"][0] == list(range(1, 10))
    assert plot_spikes(tmp_path / "rewound").stat().st_size > 0
    train_here(tmp_path / "off", *REWIND, *FEW_SAVES, "--training.skip_steps", "6-7")
    off = records(tmp_path / "off")
    assert off[5]["loss"] == s[5]["loss"] and off[6]["loss"] != s[6]["loss"]


def test_a_requeue_after_a_rewind_keeps_its_skip(tmp_path, monkeypatch):
    """The rewound run stopped at step 8 (its checkpoint holds the skip) and resumed
    trains as the uninterrupted one, from its checkpoint's loader entry alone (the
    rewind's record removed: test_a_kill_right_after_a_rewind... covers the record).
    Negative control: a resume from step-5 (before the skip) without the fault hook
    (nothing to detect), the record or the list trains other data."""
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    train_here(tmp_path / "ref", *REWIND)
    train_here(tmp_path / "a", *REWIND, "--training.stop_at_step", 8)
    monkeypatch.delenv(FAULT_ENV)
    shutil.rmtree(tmp_path / "a" / "checkpoint" / "rewinds")
    train_here(tmp_path / "a", *REWIND)
    ref, a = records(tmp_path / "ref"), records(tmp_path / "a")
    assert [a[k]["loss"] for k in a] == [ref[k]["loss"] for k in ref]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in (6, 7, 8, 9):
        shutil.rmtree(tmp_path / "b" / "checkpoint" / f"step-{step}")
    train_here(tmp_path / "b", *REWIND)
    assert records(tmp_path / "b")[6]["loss"] != ref[6]["loss"]


class _Killed(BaseException):
    """A kill -9 just after the rewind: nothing of the loop runs after it (no save)."""


def test_a_kill_right_after_a_rewind_relaunches_into_the_same_skip(tmp_path, monkeypatch):
    """The spike at step 7 rewinds to step-5 and skips steps 6-8; the job dies at once
    after the rewind (before any later checkpoint) and is relaunched WITHOUT the fault
    hook (the spike's cause was transient): it loads step-5, whose loader entry predates
    the skip, reads the rewind's record and trains as the uninterrupted rewound run,
    losses ==, the rewind counted. Negative control: the record removed before the
    relaunch (the skip held in memory only, as before the record existed) trains the
    skipped data: step 6's loss differs."""
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    train_here(tmp_path / "ref", *REWIND)
    real = train_script.rewind

    def rewind_then_die(*args):
        real(*args)
        raise _Killed

    monkeypatch.setattr(train_script, "rewind", rewind_then_die)
    for dump in ("a", "b"):
        with pytest.raises(_Killed):
            train_here(tmp_path / dump, *REWIND)
    monkeypatch.setattr(train_script, "rewind", real)
    monkeypatch.delenv(FAULT_ENV)
    assert sorted(os.listdir(tmp_path / "a" / "checkpoint" / "rewinds")) == ["rewind-1.json"]
    train_here(tmp_path / "a", *REWIND)
    ref, a = records(tmp_path / "ref"), records(tmp_path / "a")
    assert [a[k]["loss"] for k in range(6, 10)] == [ref[k]["loss"] for k in range(6, 10)]
    assert a[9]["rewinds"] == ref[9]["rewinds"] == 1
    shutil.rmtree(tmp_path / "b" / "checkpoint" / "rewinds")
    train_here(tmp_path / "b", *REWIND)
    assert records(tmp_path / "b")[6]["loss"] != ref[6]["loss"]


def test_a_job_that_lost_its_lease_at_a_rewind_writes_no_record(tmp_path, monkeypatch):
    """The lease lapses while the rewind loads its checkpoint (its store stopped
    answering the heartbeat): the rewind's record is not written (storage's write guard,
    which every writer asks, not a check the recipe remembers to make), and the job stops
    in one line naming the lease. Negative control: the same rewind with the lease held
    writes its record."""
    from torchtitan.checkpoint.manager import CheckpointManager

    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    real = CheckpointManager.rewind

    def rewind_as_the_lease_lapses(self, *args):
        to = real(self, *args)
        self.lease._valid_until = 0.0  # the deadline passed: the renewals got no answer
        return to

    monkeypatch.setattr(CheckpointManager, "rewind", rewind_as_the_lease_lapses)
    status, log = train_here(tmp_path / "lost", *REWIND, expect_ok=False)
    (line,) = error_lines(log)
    assert status == 1 and "lost the lease on checkpoint folder" in line
    assert not (tmp_path / "lost" / "checkpoint" / "rewinds").exists()
    monkeypatch.setattr(CheckpointManager, "rewind", real)
    train_here(tmp_path / "held", *REWIND, "--training.stop_at_step", 7)
    assert os.listdir(tmp_path / "held" / "checkpoint" / "rewinds") == ["rewind-1.json"]


def test_a_damaged_rewind_record_stops_the_start_in_one_line(tmp_path, monkeypatch):
    """A rewind record that does not parse (damaged by something else: it is published
    whole) stops the start with one line naming it, rather than guess the skip.
    Negative control: the record whole, the same start trains."""
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    train_here(tmp_path / "a", *REWIND, "--training.stop_at_step", 8)
    monkeypatch.delenv(FAULT_ENV)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    record = tmp_path / "a" / "checkpoint" / "rewinds" / "rewind-1.json"
    record.write_text(record.read_text()[:20])
    status, log = train_here(tmp_path / "a", *REWIND, expect_ok=False)
    assert status == 1
    (line,) = error_lines(log)
    assert "rewind record" in line and "rewind-1.json" in line and "skip_steps" in line
    train_here(tmp_path / "b", *REWIND)


def test_repeated_spikes_stop_after_max_rewinds(tmp_path, monkeypatch):
    """A spike that follows every rewind (the hook fires at 7 and at 8, past the skip)
    stops the job at max_rewinds (1) with one line. Negative control: max_rewinds 2
    rewinds twice and finishes."""
    monkeypatch.setenv(FAULT_ENV, "7:x1000,8:x1000")
    status, log = train_here(tmp_path / "a", *REWIND, "--training.max_rewinds", 1,
                             expect_ok=False)  # fmt: skip
    assert status == 1
    (line,) = error_lines(log)
    assert "after 1 rewinds (training.max_rewinds 1)" in line
    train_here(tmp_path / "b", *REWIND, "--training.max_rewinds", 2)
    assert records(tmp_path / "b")[9]["rewinds"] == 2


def test_the_checkpoint_keeps_a_skip_list_the_resume_does_not_repeat(tmp_path):
    """--training.skip_steps 6-8 given at the start only: a run stopped at step 4 and
    resumed without it still skips them (the loader entry holds the list, first step
    included) and trains as the run that kept the flag. Negative control: the skip
    list of a run that never had it (resumed from a plain step-4) differs from step 6."""
    listed = [*REWIND, *FEW_SAVES, "--training.skip_steps", "6-8"]
    train_here(tmp_path / "ref", *listed)
    train_here(tmp_path / "a", *listed, "--training.stop_at_step", 4)
    train_here(tmp_path / "a", *REWIND, *FEW_SAVES)
    ref, a = records(tmp_path / "ref"), records(tmp_path / "a")
    assert [a[k]["loss"] for k in a] == [ref[k]["loss"] for k in ref]
    train_here(tmp_path / "b", *REWIND, *FEW_SAVES, "--training.stop_at_step", 4)
    train_here(tmp_path / "b", *REWIND, *FEW_SAVES)
    assert records(tmp_path / "b")[6]["loss"] != ref[6]["loss"]


# ---- two ranks, a loader worker each, killed after the rewind (slow tier) ---------------


@pytest.mark.slow
def test_two_ranks_rewind_is_exact_and_survives_a_kill_after_it(tmp_path, monkeypatch):
    """2 ranks x 1 loader worker: a NaN on rank 1 alone at step 3 is dropped on both (one
    line each); a spike on rank 0 alone at step 7 (seen through the mean loss) rewinds
    both to step-5. The run equals one started with --training.skip_steps 6-8 (losses
    ==, provenance ==); a run killed (SIGKILL to the whole job) just after its rewind
    and relaunched without the fault hook (the spike does not recur) finishes on the
    same losses: the skip held, from the rewind's record (checkpoint/rewinds.py).
    Negative control: the list one step off differs."""
    args = [*REWIND, "--training.num_workers", 1]
    monkeypatch.setenv(FAULT_ENV, "3:nan@1,7:x1000@0")
    out = train(tmp_path / "ref", *args).stderr
    assert sum("step 3: loss nan" in line for line in out.splitlines()) == 2
    monkeypatch.setenv(FAULT_ENV, "3:nan@1")
    train(tmp_path / "listed", *args, "--training.skip_steps", "6-8")
    ref, listed = losses(tmp_path / "ref"), losses(tmp_path / "listed")
    assert ref == listed and sorted(ref) == list(range(1, 10))
    assert sequences_by_step(read_provenance(tmp_path / "ref" / "provenance")) == (
        sequences_by_step(read_provenance(tmp_path / "listed" / "provenance"))
    )
    monkeypatch.setenv(FAULT_ENV, "3:nan@1,7:x1000@0")
    dump = tmp_path / "killed"
    proc = subprocess.Popen(torchrun_command(2, [*CONFIG, "--job.dump_folder", dump, *args]),
                            cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            if '"kind": "rewind"' in (dump / "spikes.jsonl").read_text():
                break
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    monkeypatch.delenv(FAULT_ENV)  # the spike's cause was transient: the relaunch meets none
    train(dump, *args)
    assert losses(dump) == ref
    monkeypatch.setenv(FAULT_ENV, "3:nan@1")
    train(tmp_path / "off", *args, "--training.skip_steps", "6-7")
    assert losses(tmp_path / "off")[6] != ref[6]


def test_a_rewind_takes_the_local_tiers_checkpoint(tmp_path, monkeypatch):
    """With the main folder every 4 steps and the local tier every step, the spike at 7
    rewinds to the local tier's step-5 (the main folder has only step-4 that early) and
    trains as the skip list 6-8 from the start; the local tier's step-6 is set aside.
    Negative control: without the local tier it rewinds to step-4 (skipping 5-8)."""
    tiers = ["--checkpoint.interval", 4, "--checkpoint.local_interval", 1]
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    _, log = train_here(tmp_path / "rewound", *REWIND, *tiers)
    assert "rewound to checkpoint step-5 (" in log and "checkpoint_local/step-5;" in log
    assert (tmp_path / "rewound" / "checkpoint_local" / "step-6.abandoned").is_dir()
    monkeypatch.delenv(FAULT_ENV)
    train_here(tmp_path / "listed", *REWIND, *FEW_SAVES, "--training.skip_steps", "6-8")
    assert losses(tmp_path / "rewound") == losses(tmp_path / "listed")
    monkeypatch.setenv(FAULT_ENV, "7:x1000")
    _, log = train_here(tmp_path / "main", *REWIND, "--checkpoint.interval", 4)
    assert "rewound to checkpoint step-4" in log and "--training.skip_steps 5-8" in log


def test_a_window_range_skips_as_the_steps_that_read_it(tmp_path):
    """Without a mix schedule, --training.skip_windows 10-15 (the windows steps 6-8 read,
    2 a step) trains as --training.skip_steps 6-8 (losses ==), also when given only at
    the start of a run stopped at step 4 and resumed without it (the loader entry keeps
    it). Negative control: 10-14 (one window short) differs from step 6."""
    common = [*REWIND, *FEW_SAVES, "--training.steps", 8]
    train_here(tmp_path / "steps", *common, "--training.skip_steps", "6-8")
    train_here(tmp_path / "windows", *common, "--training.skip_windows", "10-15",
               "--training.stop_at_step", 4)  # fmt: skip
    train_here(tmp_path / "windows", *common)
    ref, got = records(tmp_path / "steps"), records(tmp_path / "windows")
    assert [got[k]["loss"] for k in got] == [ref[k]["loss"] for k in ref]
    assert read_skips(tmp_path / "windows" / "provenance") == [{"step": 6, "windows": [10, 16]}]
    train_here(tmp_path / "short", *common, "--training.skip_windows", "10-14")
    assert records(tmp_path / "short")[6]["loss"] != ref[6]["loss"]
