"""Who writes the job's checkpoint when the group that writes it is gone (fast, in one
process): the real ``ReplicaGroup`` and ``LowestGroupSaves`` on harness/ft_quorum.py's
quorum, real loaders and real DCP checkpoints in ``<job>/replica_<i>/checkpoint``, and
train.py's own ``save_if_due`` and ``stop_with_checkpoint`` after each committed step.

- The lowest group (the saver) killed, or preempted, before the others are: the groups
  left stop at an agreed step, and the lowest of them writes it; the others write
  nothing and say so; a relaunch resumes from it, every step's windows once.
- The saver dies before its due save is durable (a kill -9 during an async save leaves
  ``step-N.partial``): the group that becomes the saver writes at once, instead of at
  the next due step. Each test names the one-line bug it catches."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
from test_ft_elastic import STEPS, Group, _cfg, _life

import train as train_script
from harness.ft_quorum import Quorum
from torchtitan.checkpoint import complete_steps
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.faults.fault_tolerance import FaultToleranceError, StoppedWaiting
from torchtitan.faults.preemption import Preemption

pytest.importorskip("torchft")

LEAST_2 = ["--fault_tolerance.min_replica_groups", "2"]
LEAST_3 = ["--fault_tolerance.min_replica_groups", "3"]


class Looped(Group):
    """A group rank stepped as train.py's loop steps it: after a committed step, the due
    save (``save_if_due``), then the agreed stop (``stop_with_checkpoint``: its save and
    its log line, recorded per group)."""

    def __init__(self, *a, said: dict, **k):
        super().__init__(*a, **k)
        self.said, self.stopped = said, None
        self.preemption = Preemption(self.dims, [])

    def try_step(self, dies: bool = False, asked: bool = False):
        threading.current_thread().name = f"group {self.gid}"  # whose log line
        self.replicas.asked_to_stop = lambda: asked
        try:
            batches = self.replicas.next_step()
        except StoppedWaiting:  # asked to stop, and no quorum came: train.py's stop alone
            train_script.stop_with_checkpoint(self.checkpoint, self.preemption,
                                              self.state.step, False, alone=True)  # fmt: skip
            self.stopped = self.state.step
            return
        if dies:  # killed before the all-reduce
            return
        self.model.zero_grad()
        (self.model.weight.sum() * float(len(batches))).backward()
        if not self.replicas.commit(self.model.weight.sum().detach()):
            return
        self.state.step += 1
        self.read[self.state.step] = [row.tolist() for b in batches for row in b["input"]]
        run = SimpleNamespace(checkpoint=self.checkpoint, cfg=self.cfg)
        saved = train_script.save_if_due(run, self.state.step, self.cfg.training.steps)
        if self.replicas.stop_agreed:
            train_script.stop_with_checkpoint(self.checkpoint, self.preemption,
                                              self.state.step, saved)  # fmt: skip
            self.stopped = self.state.step


class Said(logging.Handler):
    """The stop's log lines, by the group whose thread logged them."""

    def __init__(self):
        super().__init__()
        self.lines: dict[str, list[str]] = {}

    def emit(self, record):
        self.lines.setdefault(record.threadName, []).append(record.getMessage())


def _said():
    handler, logger = Said(), logging.getLogger("torchtitan")
    logger.addHandler(handler)
    return handler, logger


def _groups(job, count: int, extra: list):
    """``count`` looped groups of ``job`` on one in-process quorum, each resumed from the
    job's checkpoints: (tokenizer, quorum, {group: Looped}, what they said)."""
    tokenizer = build_tokenizer(_cfg(job, 0, count).model)
    quorum, said = Quorum(), {}
    groups = {g: Looped(quorum, job, g, count, tokenizer, extra=extra, said=said).resume()
              for g in range(count)}  # fmt: skip
    return tokenizer, quorum, groups, said


def _step(quorum, groups: dict, live: list[int], dies=(), asked=()):
    quorum.round(live, dies=dies)
    quorum.run({g: (lambda g=g: groups[g].try_step(g in dies, g in asked)) for g in live})


def _expected(job, tokenizer, *extra) -> list[list]:
    plain = build_dataloader(_cfg(job, 0, 1, *extra), tokenizer, 0, 1)
    return [[row.tolist() for b in plain.next_step() for row in b["input"]]
            for _ in range(STEPS)]  # fmt: skip


@pytest.fixture(scope="module", params=["killed", "preempted"])
def saver_gone(request, tmp_path_factory):
    """4 groups, min_replica_groups 3, a save every 2 steps. Group 0, the saver, is
    killed during step 3 (``killed``: groups 1-3 try step 3 again) or signalled at step 2
    (``preempted``: it leaves after step 2, which it writes; 3 groups are left, enough to
    train on). Group 3 is signalled at step 5: 1 of 3 leaves, too few are left, so groups
    1-3 stop after step 5; group 1, now the lowest, writes it, and group 2, the next, a
    second copy. Then the whole job is launched again (3 groups, steps 6-8)."""
    job = tmp_path_factory.mktemp(f"saver_{request.param}") / "job"
    tokenizer, quorum, groups, said = _groups(job, 4, LEAST_3)
    handler, logger = _said()
    try:
        if request.param == "killed":
            _step(quorum, groups, [0, 1, 2, 3])
            _step(quorum, groups, [0, 1, 2, 3])
            _step(quorum, groups, [0, 1, 2, 3], dies=(0,))  # not committed
        else:
            _step(quorum, groups, [0, 1, 2, 3])
            _step(quorum, groups, [0, 1, 2, 3], asked=(0,))
        _step(quorum, groups, [1, 2, 3])  # step 3
        _step(quorum, groups, [1, 2, 3])  # step 4
        _step(quorum, groups, [1, 2, 3], asked=(3,))  # step 5: every group stops
    finally:
        logger.removeHandler(handler)
        for group in groups.values():
            group.checkpoint.close()
    again = _life(job, tokenizer, 3, [[0, 1, 2]] * 3, extra=LEAST_3)
    return {"job": job, "case": request.param, "groups": groups, "said": handler.lines,
            "again": again, "expected": _expected(job, tokenizer)}  # fmt: skip


def _stop_line(said: dict, gid: int) -> str:
    lines = [line for line in said.get(f"group {gid}", []) if line.startswith("preempted")]
    assert len(lines) == 1, said
    return lines[0]


def test_when_the_saver_is_gone_the_lowest_group_left_writes_the_agreed_stop(saver_gone):
    """Groups 1-3 stop after step 5; group 1 writes step-5 (complete, in its own folder)
    and group 2 a second copy, each saying so; group 3 writes nothing and says that.
    Negative control: the third participant has no checkpoint and no line claiming one.
    Catches: the saver pinned to group 0 (the lowest at the start: nobody writes
    step-5), no second copy, every group writing at the stop, and a stop line that
    claims a checkpoint nobody wrote."""
    job, groups, said = saver_gone["job"], saver_gone["groups"], saver_gone["said"]
    assert [groups[g].stopped for g in (1, 2, 3)] == [5, 5, 5]
    assert complete_steps(str(job / "replica_1" / "checkpoint"))[:2] == [4, 5]
    assert complete_steps(str(job / "replica_2" / "checkpoint"))[:1] == [5]
    for gid in (1, 2):
        assert "checkpoint step-5 written" in _stop_line(said, gid)
    assert not (job / "replica_3" / "checkpoint").exists() or not complete_steps(
        str(job / "replica_3" / "checkpoint")
    )
    line = _stop_line(said, 3)
    assert "written" not in line and "no checkpoint from this replica group" in line, line
    if saver_gone["case"] == "preempted":  # group 0 left after step 2: the lowest, it wrote it
        assert groups[0].stopped == 2 and "checkpoint step-2 written" in _stop_line(said, 0)
    before = [s for s in complete_steps(str(job / "replica_0" / "checkpoint")) if s <= 5]
    assert before == [2]  # (the relaunch's group 0 writes steps 6 and 8)


def test_the_relaunch_resumes_from_the_stop_and_reads_every_step_once(saver_gone):
    """Catches: the stop's checkpoint missing (the relaunch from step-4 or step-2 reads
    steps again) or torn."""
    job, again = saver_gone["job"], saver_gone["again"]
    copies = {str(job / f"replica_{g}" / "checkpoint" / "step-5") for g in (1, 2)}
    for group, (step, _, source) in again["loaded"].items():
        assert step == 5 and source in copies, (group, source)
    committed: dict[int, list] = {}
    for life in (saver_gone["groups"], again["groups"]):
        for step in sorted({s for g in life.values() for s in g.read}):
            assert step not in committed, f"step {step} committed twice"
            committed[step] = [w for _, g in sorted(life.items()) if step in g.read
                               for w in g.read[step]]  # fmt: skip
    assert sorted(committed) == list(range(1, STEPS + 1))
    for step, windows in committed.items():
        assert windows == saver_gone["expected"][step - 1], f"step {step}"


# ---- the saver dies before its due save is durable ------------------------------------------

EVERY_4 = ["--checkpoint.interval", "4", "--training.steps", "10"]


@pytest.fixture(scope="module", params=["torn", "durable"])
def taken_over(request, tmp_path_factory):
    """2 groups, a save every 4 steps, 10 steps. Group 0 writes step-4 and step-8, then
    dies; with ``torn``, its step-8 is left as a kill -9 during the async save leaves it
    (``step-8.partial``, no manifest). Group 1 trains steps 9 and 10 alone."""
    job = tmp_path_factory.mktemp(f"takeover_{request.param}") / "job"
    tokenizer = build_tokenizer(_cfg(job, 0, 2).model)
    quorum = Quorum()
    groups = {g: Looped(quorum, job, g, 2, tokenizer, extra=EVERY_4, said={}).resume()
              for g in range(2)}  # fmt: skip
    handler, logger = _said()
    try:
        for _ in range(8):
            _step(quorum, groups, [0, 1])
        groups[0].checkpoint.close()
        if request.param == "torn":
            folder = job / "replica_0" / "checkpoint"
            os.rename(folder / "step-8", folder / "step-8.partial")
            os.remove(folder / "step-8.partial" / "manifest.json")
        for _ in range(2):
            _step(quorum, groups, [1])
    finally:
        logger.removeHandler(handler)
        groups[1].checkpoint.close()
    return {"job": job, "case": request.param, "said": handler.lines.get("group 1", [])}


def test_a_new_saver_writes_at_once_where_the_last_due_save_is_not_durable(taken_over):
    """torn: group 1, the saver from step 9, finds no complete step-8 in any group's
    folder and writes step-9 at once (and says why), then step-10 (the last). Negative
    control, durable: step-8 complete in group 0's folder, group 1 writes step-10 only.
    Catches: the new saver waiting for the next due step (a whole-job restart before it
    would lose steps 5-9), and a take-over that ignores the other groups' folders (it
    would write step-9 in the durable case too)."""
    folder = str(taken_over["job"] / "replica_1" / "checkpoint")
    took = [line for line in taken_over["said"] if "now writes the job's checkpoints" in line]
    if taken_over["case"] == "torn":
        assert complete_steps(folder) == [9, 10]
        assert len(took) == 1 and "step-4, older than the due step-8" in took[0], took
    else:
        assert complete_steps(folder) == [10] and not took


# ---- a group left alone below min_replica_groups, then signalled -----------------------------


def _left_alone(tmp_path, *, asked: bool, patience: float, stall: float, release_after=None,
                interval: int = 4):  # fmt: skip
    """2 groups, min_replica_groups 2, a save every 4 steps. Steps 1-3 by both; group 0
    dies during step 4; group 1's next quorum stalls (too few live groups), ``asked``
    to stop or not, its patience ``fault_tolerance.timeout_seconds``; the quorum comes
    after ``release_after`` seconds, or never (it fails after ``stall``)."""
    job = tmp_path / "job"
    extra = [*LEAST_2, *EVERY_4, "--checkpoint.interval", interval,
             "--fault_tolerance.timeout_seconds", patience]  # fmt: skip
    tokenizer, quorum, groups, said = _groups(job, 2, extra)
    handler, logger = _said()
    error, took = None, None
    try:
        for _ in range(3):
            _step(quorum, groups, [0, 1])
        _step(quorum, groups, [0, 1], dies=(0,))  # step 4: group 0 killed
        groups[0].checkpoint.close()
        quorum.round([1], stall=stall)
        if release_after is not None:
            threading.Timer(release_after, quorum.release).start()
        begin = time.monotonic()
        try:
            quorum.run({1: lambda: groups[1].try_step(asked=asked)})
        except FaultToleranceError as e:
            error = str(e)
        took = time.monotonic() - begin
    finally:
        quorum.release()  # a quorum thread still waiting ends
        logger.removeHandler(handler)
        groups[1].checkpoint.close()
    return {"job": job, "group": groups[1], "said": handler.lines.get("group 1", []),
            "error": error, "took": took}  # fmt: skip


def test_a_signalled_group_left_below_min_groups_writes_its_last_step_and_stops(tmp_path):
    """Group 1, signalled while it waits for a quorum that cannot come (group 0 died,
    min_replica_groups 2), gives up after fault_tolerance.timeout_seconds (0.3 s), not
    the quorum's own timeout (5 s): it stops after step 3, its last committed step, and
    writes step-3 in its own folder (no quorum says who writes), and says so; a
    relaunch resumes from it. Catches: the wait that never looks at the flag (it fails
    after 5 s, without a save), a stop alone that writes nothing, or one that claims a
    checkpoint it did not write."""
    got = _left_alone(tmp_path, asked=True, patience=0.3, stall=5.0)
    assert got["error"] is None and got["group"].stopped == 3 and got["took"] < 2, got
    assert complete_steps(str(got["job"] / "replica_1" / "checkpoint")) == [3]
    assert any("stops after step 3" in line for line in got["said"]), got["said"]
    assert "checkpoint step-3 written" in _stop_line({"group 1": got["said"]}, 1)
    again = _life(got["job"], build_tokenizer(_cfg(got["job"], 0, 2).model), 2, [[0, 1]],
                  extra=[*LEAST_2, *EVERY_4])  # fmt: skip
    step_3 = str(got["job"] / "replica_1" / "checkpoint" / "step-3")
    assert [(step, source) for step, _, source in again["loaded"].values()] == [(3, step_3)] * 2


def test_a_lone_stop_whose_step_the_job_holds_writes_none_and_says_so(tmp_path):
    """As above with a save every 3 steps: group 0, the saver, wrote step-3 before it
    died, so group 1's lone stop after step 3 writes nothing and does not claim a
    checkpoint (its line says this group wrote none). Catches: a stop alone that says
    "written" for the peer's save, or writes the step a second time."""
    got = _left_alone(tmp_path, asked=True, patience=0.3, stall=5.0, interval=3)
    assert got["error"] is None and got["group"].stopped == 3, got
    assert complete_steps(str(got["job"] / "replica_0" / "checkpoint")) == [3]
    assert complete_steps(str(got["job"] / "replica_1" / "checkpoint")) == []
    line = _stop_line({"group 1": got["said"]}, 1)
    assert "written" not in line and "no checkpoint from this replica group" in line, line


def test_a_group_left_alone_without_a_signal_fails_on_the_quorum_timeout(tmp_path):
    """Negative control: the same stalled quorum without a signal ends as before, with
    the quorum's one-line error after its timeout (1 s), and no checkpoint."""
    got = _left_alone(tmp_path, asked=False, patience=0.3, stall=1.0)
    assert got["error"] and "no quorum" in got["error"] and got["took"] >= 1, got
    assert got["group"].stopped is None
    assert not complete_steps(str(got["job"] / "replica_1" / "checkpoint"))


def test_a_signalled_group_waits_for_a_quorum_that_comes(tmp_path):
    """Negative control: a signalled group whose quorum comes within its patience (the
    peers were slower, not gone) trains the step and stops after it as agreed, the
    lowest writing it (step-4). Catches: giving up at once on a signal (a group would
    leave a quorum that its live peers are about to complete)."""
    got = _left_alone(tmp_path, asked=True, patience=3.0, stall=5.0, release_after=0.3)
    assert got["error"] is None and got["group"].stopped == 4, got
    assert complete_steps(str(got["job"] / "replica_1" / "checkpoint")) == [4]
    assert not any("stops after step" in line for line in got["said"]), got["said"]


def _refused(tmp_path, *, asked: bool, lone: bool) -> dict:
    """2 groups, min_replica_groups 2, a lighthouse whose --min_replicas is 1: steps 1-3
    by both; then (``lone``) group 0 dies and group 1 gets quorums of itself alone whose
    commits torchft refuses, or (not ``lone``) both take part and a vote fails; group 1
    ``asked`` to stop or not; three more rounds."""
    job = tmp_path / "job"
    extra = [*LEAST_2, *EVERY_4]
    tokenizer, quorum, groups, said = _groups(job, 2, extra)
    handler, logger = _said()
    try:
        for _ in range(3):
            _step(quorum, groups, [0, 1])
        live = [1] if lone else [0, 1]
        if lone:
            _step(quorum, groups, [0, 1], dies=(0,))  # step 4: group 0 killed
        quorum.round(live, fails=True)  # a vote that says no
        quorum.run({g: (lambda g=g: groups[g].try_step(asked=asked and g == 1)) for g in live})
        for _ in range(2):
            if not groups[1].stopped:
                quorum.round(live, fails=lone)  # alone: torchft refuses every commit
                quorum.run({g: (lambda g=g: groups[g].try_step(asked=asked and g == 1))
                            for g in live})  # fmt: skip
    finally:
        logger.removeHandler(handler)
        for group in groups.values():
            group.checkpoint.close()
    return {"job": job, "groups": groups, "said": handler.lines.get("group 1", [])}


def test_a_signalled_group_whose_lone_commits_are_refused_writes_its_last_step(tmp_path):
    """The lighthouse gives group 1 quorums of itself alone (its --min_replicas 1 below
    min_replica_groups 2) and torchft refuses each commit: signalled, group 1 stops after
    step 3, its last committed step, writes it and says so, instead of trying step 4 for
    ever with its stop vote never read. Catches: the stop read only from committed steps
    (a lone group never stops)."""
    got = _refused(tmp_path, asked=True, lone=True)
    assert got["groups"][1].stopped == 3
    assert complete_steps(str(got["job"] / "replica_1" / "checkpoint")) == [3]
    assert any("cannot be committed with 1 of" in line for line in got["said"]), got["said"]
    assert "checkpoint step-3 written" in _stop_line({"group 1": got["said"]}, 1)


def test_a_lone_group_not_signalled_keeps_trying(tmp_path):
    """Negative control: not signalled, the lone group keeps trying step 4 (it waits for
    its peers as torchft does): no stop, no checkpoint."""
    quiet = _refused(tmp_path, asked=False, lone=True)
    assert quiet["groups"][1].stopped is None and quiet["groups"][1].state.step == 3
    assert not complete_steps(str(quiet["job"] / "replica_1" / "checkpoint"))


def test_a_failed_vote_with_enough_groups_is_retried_not_a_stop_alone(tmp_path):
    """Negative control: signalled while both groups take part and one vote fails, the
    step is tried again and the stop agreed after it (group 0, the lowest, writes step-4,
    group 1 its second copy). Catches: a stop alone on any failed vote (a transient failure would scatter the
    groups' stops)."""
    both = _refused(tmp_path, asked=True, lone=False)
    assert (both["groups"][0].stopped, both["groups"][1].stopped) == (4, 4)
    assert complete_steps(str(both["job"] / "replica_0" / "checkpoint")) == [4]
    assert complete_steps(str(both["job"] / "replica_1" / "checkpoint")) == [4]
