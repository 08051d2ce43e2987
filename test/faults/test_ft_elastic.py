"""A whole-job relaunch under fault tolerance with another count of replica groups, and a
group started after the job finished (fast, in one process): the real ``ReplicaGroup``
on harness/ft_quorum.py's quorum, real loaders, and real DCP checkpoints that
``LowestGroupSaves`` writes into ``<job>/replica_<i>/checkpoint``.

Three lives of one job: 3 groups (group 2 alone writes step-4), then 2 groups (the
removed group 2's folder holds the newest; group 0 writes step-6), then 3 groups again
(group 1's folder is empty, group 2's holds an older step-4). Every group of a relaunch
resumes from the job's newest checkpoint wherever it is, and every step's windows over
the three lives are an uninterrupted run's, each once. Then three lives whose groups
change size (2 groups x 1 rank, x 2 ranks in two forked gloo processes, x 1 rank
again): every rank resumes from the newest checkpoint, whichever size wrote it, and
every step's windows are read once. Each test names the one-line bug it catches."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import CONFIG, error_lines, rank_context, run_main

import train as train_script
from harness.ft_quorum import Quorum
from torchtitan.checkpoint import CheckpointManager, TrainState, complete_steps
from torchtitan.checkpoint.stateful import training_components
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.faults import fault_tolerance
from torchtitan.faults.fault_tolerance import LowestGroupSaves, ReplicaGroup
from torchtitan.parallel import init_distributed

pytest.importorskip("torchft")

STEPS = 8
# Global batch 4, 8 from step 3, 6 from step 6, whatever the groups: comparable steps.
ARGS = [*CONFIG, "--training.seq_len", "15", "--training.batch_size", "2",
        "--training.batch_size_schedule", "0:4,3:8,6:6", "--training.steps", STEPS,
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", "2",
        "--fault_tolerance.enable", "--fault_tolerance.lighthouse", "http://127.0.0.1:1"]  # fmt: skip


def _cfg(job, gid: int, groups: int, *extra):
    return parse_args([*map(str, ARGS), "--fault_tolerance.replica_id", str(gid),
                       "--fault_tolerance.replica_groups", str(groups), "--job.dump_folder",
                       str(job / f"replica_{gid}"), *map(str, extra)])  # fmt: skip


class Group:
    """One replica group's rank (of one rank, unless ``dims`` says otherwise) in one life:
    a real loader and checkpoint manager
    (``LowestGroupSaves``), the real ``ReplicaGroup`` on the in-process quorum, resumed
    by train.py's own ``resume``."""

    def __init__(self, quorum: Quorum, job, gid: int, groups: int, tokenizer, dims=None,
                 extra=()):  # fmt: skip
        self.gid, self.dims = gid, dims or init_distributed()
        self.cfg = _cfg(job, gid, groups, *extra)
        self.loader = build_dataloader(self.cfg, tokenizer, self.dims.dp_rank, self.dims.dp_world)
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.state = TrainState()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        components = training_components(self.cfg, self.dims, model=self.model,
                                         optimizer=optimizer, dataloader=self.loader,
                                         train_state=self.state, fingerprint={})  # fmt: skip
        self.manager = quorum.manager(gid)
        self.replicas = ReplicaGroup(self.cfg, self.dims, self.loader, components, self.model,
                                     self.state, manager=self.manager)  # fmt: skip
        self.manager.replica = self.replicas
        self.checkpoint = LowestGroupSaves(
            CheckpointManager(self.cfg, self.dims, components, {}), self.replicas
        )
        self.read: dict[int, list] = {}

    def resume(self):
        run = SimpleNamespace(cfg=self.cfg, dims=self.dims, model=self.model,
                              checkpoint=self.checkpoint, dataloader=self.loader,
                              train_state=self.state)  # fmt: skip
        train_script.resume(run)
        self.manager.step = self.state.step  # the step its first quorum request carries
        return self

    def try_step(self):
        batches = self.replicas.next_step()
        self.model.zero_grad()
        (self.model.weight.sum() * float(len(batches))).backward()
        if self.replicas.commit(torch.tensor(1.0)):
            self.state.step += 1
            self.committed(batches)
            if self.checkpoint.should_save(self.state.step):
                self.checkpoint.save(self.state.step)

    def committed(self, batches: list[dict]):
        """What the group keeps of a step it committed (``self.state.step``)."""
        self.read[self.state.step] = [row.tolist() for b in batches for row in b["input"]]


def _life(job, tokenizer, groups: int, rounds: list[list[int]], dims=None,
          extra=()) -> dict[int, Group]:  # fmt: skip
    """A launch of ``groups`` groups, each resumed (one after the other); ``rounds``: the
    participants of each step (a group absent from the rest died); every manager closed
    at the end. ``dims``: each group's (this process is one rank of each), else one rank;
    ``extra``: more command-line arguments."""
    quorum = Quorum()
    live = {g: Group(quorum, job, g, groups, tokenizer, dims and dims[g], extra).resume()
            for g in range(groups)}  # fmt: skip
    loaded = {g: (x.state.step, x.loader.position.windows, x.checkpoint.loaded_from)
              for g, x in live.items()}  # fmt: skip
    for participants in rounds:
        quorum.round(participants)
        quorum.run({g: live[g].try_step for g in participants})
    for group in live.values():
        group.checkpoint.close()
    return {"groups": live, "loaded": loaded}


@pytest.fixture(scope="module")
def lives(tmp_path_factory):
    job = tmp_path_factory.mktemp("job")
    cfg = _cfg(job, 0, 3)
    tokenizer = build_tokenizer(cfg.model)
    plain = build_dataloader(cfg, tokenizer, 0, 1)
    expected = [[row.tolist() for b in plain.next_step() for row in b["input"]]
                for _ in range(STEPS)]  # fmt: skip
    first = _life(job, tokenizer, 3, [[0, 1, 2], [0, 1, 2], [2], [2]])  # group 2 writes step-4
    second = _life(job, tokenizer, 2, [[0, 1], [0, 1]])  # group 0 writes step-6
    third = _life(job, tokenizer, 3, [[0, 1, 2], [0, 1, 2]])
    for group in third["groups"].values():  # the job's last step: the lowest group marks it
        group.replicas.finish(group.state.step, STEPS)
    return {"job": job, "lives": [first, second, third], "expected": expected,
            "tokenizer": tokenizer}  # fmt: skip


def test_a_relaunch_resumes_every_group_from_the_jobs_newest_checkpoint(lives):
    """2 groups after 3 (the removed group 2's folder holds step-4, the newest), then 3
    after 2 (group 0's step-6 is the newest; group 2's own folder holds an older step-4,
    group 1's nothing): every group starts at the newest step, at its loader position.
    Catches: each group loading its own folder's newest (group 1 from step 0, group 2
    from step-4), the highest group's folder taken instead of the newest step (step-4),
    and only groups below replica_groups looked at (the 3 -> 2 relaunch from step-2)."""
    job = lives["job"]
    first, second, third = lives["lives"]
    at_end = {g: (x.state.step, x.loader.position.windows) for g, x in first["groups"].items()}
    for group, (step, windows, source) in second["loaded"].items():
        assert (step, windows) == at_end[2], group
        assert source == str(job / "replica_2" / "checkpoint" / "step-4"), source
    g0 = second["groups"][0]
    for group, (step, windows, source) in third["loaded"].items():
        assert (step, windows) == (6, g0.loader.position.windows), group
        assert source == str(job / "replica_0" / "checkpoint" / "step-6"), source


def test_every_step_over_three_lives_reads_the_uninterrupted_runs_windows_once(lives):
    """Each committed step's windows, over its participants in order, are the
    uninterrupted run's, and no step is committed in two lives. Catches: a new group
    starting from step 0 (it reads step 1's windows again), a resume from an older step
    (steps read twice)."""
    committed: dict[int, list] = {}
    for life in lives["lives"]:
        steps = sorted({s for g in life["groups"].values() for s in g.read})
        for step in steps:
            assert step not in committed, f"step {step} committed twice"
            readers = sorted((g for g in life["groups"].values() if step in g.read),
                             key=lambda g: g.gid)  # fmt: skip
            committed[step] = [w for g in readers for w in g.read[step]]
    assert sorted(committed) == list(range(1, STEPS + 1))
    for step, windows in committed.items():
        assert windows == lives["expected"][step - 1], f"step {step}"


def test_a_group_with_its_own_folder_only_would_resume_behind(lives):
    """Negative control for the two tests above: the same folders read the way a group
    read them before (its own only) give group 1 nothing and group 2 its older step-4."""
    job = lives["job"]
    found = []
    for gid in (1, 2):
        cfg = _cfg(job, gid, 3)
        components = {"train_state": TrainState()}
        manager = CheckpointManager(cfg, init_distributed(), components, {})
        try:
            manager.load()
        finally:
            manager.close()
        found.append(components["train_state"].step)
    assert found == [0, 4]


def test_a_group_left_out_of_a_branch_does_not_bring_its_abandoned_steps_back(tmp_path):
    """Group 2 alone writes step-4 and step-6 (marked as of generation 1, as if an earlier
    branch had gone on in group 2 alone: group 0's folder holds generation 0 only); the
    job is rewound to step-2 (``--checkpoint.load_step 2``) with groups 0 and 1 only, and
    group 0 writes the branch's step-4. A plain relaunch of all three resumes from the
    branch's step-4, not from group 2's step-6 of the abandoned timeline: the newest by
    (generation, step), the branch's generation above every folder's the rewind read.
    Negative control: group 2's step-6 marked as of the branch's generation is taken.
    Catches peers ranked by step alone (timeline.resume_order), and a branch numbered
    from its own folder's generations alone (it would tie with group 2's)."""
    tokenizer = build_tokenizer(_cfg(tmp_path, 0, 3).model)
    _life(tmp_path, tokenizer, 3, [[0, 1, 2], [0, 1, 2], [2], [2], [2], [2]])
    abandoned = tmp_path / "replica_2" / "checkpoint"
    assert complete_steps(str(abandoned))[-2:] == [4, 6]
    for step in (4, 6):
        manifest = abandoned / f"step-{step}" / "manifest.json"
        earlier = {"generation": 1, "origin": {"load_step": 1, "exclude_from_loading": []}}
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "timeline": earlier}))
    branch = _life(tmp_path, tokenizer, 2, [[0, 1], [0, 1]],
                   extra=["--checkpoint.load_step", "2"])  # fmt: skip
    assert {g: loaded[0] for g, loaded in branch["loaded"].items()} == {0: 2, 1: 2}
    branch_step = tmp_path / "replica_0" / "checkpoint" / "step-4"
    assert branch_step.is_dir()
    relaunch = _life(tmp_path, tokenizer, 3, [])
    for group, (step, _, source) in relaunch["loaded"].items():
        assert (step, source) == (4, str(branch_step)), group
    # Control: the same step-6 of the branch's generation is the job's newest.
    generation = json.loads((branch_step / "manifest.json").read_text())["timeline"]
    manifest = abandoned / "step-6" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "timeline": generation}))
    control = _life(tmp_path, tokenizer, 3, [])
    assert {loaded[0] for loaded in control["loaded"].values()} == {6}


def test_only_the_lowest_group_marks_the_job_finished(lives):
    """After the last step the lowest group publishes the marker; the others write none.
    Catches: a marker from every group (one whose final save was not its to make)."""
    job = lives["job"]
    marked = [g for g in range(3) if (job / f"replica_{g}" / fault_tolerance.FINISHED).exists()]
    assert marked == [0]
    assert json.loads((job / "replica_0" / fault_tolerance.FINISHED).read_text()) == {"step": STEPS}


def test_a_group_started_after_the_job_finished_stops_with_one_line(lives, tmp_path):
    """Group 1 started again after its peers finished: ``train.main`` exits 0 at once
    with one line naming the marker, without reaching for the lighthouse (none listens
    at the address it is given) or training from step 0. Negative controls: a longer
    run (training.steps 10) is not finished, a branch from an older checkpoint
    (checkpoint.load_step) trains, and a marker never published whole (a kill -9 during
    its write leaves only the temporary file) is none."""
    job = lives["job"]
    status, log = run_main([*map(str, ARGS), "--fault_tolerance.replica_id", "1",
                            "--fault_tolerance.replica_groups", "3",
                            "--fault_tolerance.quorum_timeout_seconds", "0.5",
                            "--job.dump_folder", str(job / "replica_1")])  # fmt: skip
    said = [line for line in log.splitlines() if "the job already finished" in line]
    assert status == 0 and len(said) == 1 and not error_lines(log), log[-2000:]
    assert str(job / "replica_0" / fault_tolerance.FINISHED) in said[0]
    assert not (job / "replica_1" / "metrics.jsonl").exists()  # nothing trained

    dims = init_distributed()
    assert fault_tolerance.job_finished(_cfg(job, 1, 3), dims, STEPS)
    assert not fault_tolerance.job_finished(_cfg(job, 1, 3), dims, 10)
    branch = _cfg(job, 1, 3, "--checkpoint.load_step", 4)  # a new timeline from step-4
    assert not fault_tolerance.job_finished(branch, dims, STEPS)
    torn = tmp_path / "torn"
    os.makedirs(torn / "replica_0")
    (torn / "replica_0" / ".tmp1234.json").write_text('{"st')  # publish killed mid-write
    assert not fault_tolerance.job_finished(_cfg(torn, 1, 3), dims, STEPS)


def test_a_group_that_saves_must_live_in_a_replica_folder(tmp_path):
    """Catches: a group whose folder its peers cannot find (its checkpoints would be
    missed by a relaunch) accepted; the folder ft_launch.py makes is (control)."""
    status, log = run_main([*map(str, ARGS), "--job.dump_folder", str(tmp_path / "run0")])
    lines = error_lines(log)
    assert status != 0 and len(lines) == 1 and "name it <job folder>/replica_0" in lines[0], log
    parse_args([*map(str, ARGS), "--job.dump_folder", str(tmp_path / "replica_0")])


# ---- another group size: 2 groups x 1 rank -> x 2 ranks -> x 1 rank -----------------------


def _group_rank(rank: int, store: str, job: str, out) -> None:
    """Group rank ``rank`` of 2 in every group of the job's second life: one forked
    process per group rank, both groups' ranks in it (threads), as torchft pairs the same
    group rank of every group; each group's own gloo groups over the two processes carry
    its collectives (its checkpoint's load and save, its stop vote). Reports each
    group's load and the windows it read at each committed step."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from torchtitan.parallel import ParallelDims

    timeout = timedelta(seconds=20)  # a peer that failed ends this one soon after
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timeout)  # fmt: skip
    try:
        torch.set_num_threads(1)
        dims = {}
        for g in (0, 1):  # the same order in both processes
            cpu = dist.new_group(backend="gloo", timeout=timeout)
            control = dist.new_group(backend="gloo", timeout=timeout)
            dims[g] = ParallelDims(rank, 2, rank, torch.device("cpu"), "gloo", cpu_group=cpu,
                                   control_group=control)  # fmt: skip
        tokenizer = build_tokenizer(_cfg(Path(job), 0, 2).model)
        life = _life(Path(job), tokenizer, 2, [[0, 1], [1]], dims=dims)
        alone = _stops_alone(Path(job).parent / "alone", tokenizer, dims[1], rank)
        out.put((rank, {"loaded": life["loaded"], "alone": alone,
                        "read": {g: x.read for g, x in life["groups"].items()}}))  # fmt: skip
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _stops_alone(job, tokenizer, dims, rank: int) -> dict:
    """Group 1 of 2 ranks alone in another job (its peer gone): one committed step, then a
    quorum that stalls while the signal reaches group rank 1 only; fault_tolerance.
    timeout_seconds 0.5. What this rank did: the step it stopped after (None: it did not
    give up), whether the stop's checkpoint was written, how long the wait took."""
    import time

    from torchtitan.faults.fault_tolerance import StoppedWaiting

    quorum = Quorum()
    group = Group(quorum, job, 1, 2, tokenizer, dims,
                  extra=["--fault_tolerance.timeout_seconds", "0.5"]).resume()  # fmt: skip
    stopped = written = None
    try:
        quorum.round([1])
        quorum.run({1: group.try_step})
        quorum.round([1], stall=10.0)  # too few groups: no quorum comes
        group.replicas.asked_to_stop = lambda: rank == 1
        begin = time.monotonic()
        try:
            group.replicas.next_step()
        except StoppedWaiting as e:
            stopped, written = e.step, group.checkpoint.save_alone(e.step)
        took = time.monotonic() - begin
    finally:
        quorum.release()
        group.checkpoint.close()
    return {"stopped": stopped, "written": written, "took": took}


def _two_rank_life(job, tmp) -> dict:
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_group_rank, args=(r, str(tmp / "store"), str(job), out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    failed = [f"group rank {r}: {v}" for r, v in sorted(got.items()) if isinstance(v, str)]
    assert not failed, "\n".join(failed)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """Three lives of one job whose groups change size: 2 groups x 1 rank (group 0 writes
    step-4), then 2 groups x 2 ranks (forked, ``_group_rank``: both load step-4, step 5
    by both, step 6 by group 1 alone, which writes step-6 from its 2 ranks into its own
    folder), then 2 groups x 1 rank again (both load group 1's step-6)."""
    tmp = tmp_path_factory.mktemp("sizes")
    job = tmp / "job"
    cfg = _cfg(job, 0, 2)
    tokenizer = build_tokenizer(cfg.model)
    plain = build_dataloader(cfg, tokenizer, 0, 1)
    expected = [[row.tolist() for b in plain.next_step() for row in b["input"]]
                for _ in range(STEPS)]  # fmt: skip
    first = _life(job, tokenizer, 2, [[0, 1]] * 4)
    second = _two_rank_life(job, tmp)
    third = _life(job, tokenizer, 2, [[0, 1]] * 2)
    return {"job": job, "first": first, "second": second, "third": third,
            "expected": expected}  # fmt: skip


def _step_windows(sizes) -> dict[int, list]:
    """Each committed step's windows over the three lives: its participants in quorum
    order, each group's ranks in rank order; a step committed twice fails."""
    committed: dict[int, list] = {}

    def add(step, windows):
        assert step not in committed or committed[step] is None, f"step {step} committed twice"
        committed[step] = windows

    for life in (sizes["first"], sizes["third"]):
        for step in sorted({s for g in life["groups"].values() for s in g.read}):
            add(step, [w for _, g in sorted(life["groups"].items()) if step in g.read
                       for w in g.read[step]])  # fmt: skip
    second = sizes["second"]
    for step in sorted({s for r in second.values() for g in r["read"].values() for s in g}):
        add(step, [w for g in (0, 1) for r in (0, 1) for w in second[r]["read"][g].get(step, [])])
    return committed


def test_a_relaunch_with_another_group_size_resumes_from_the_newest_checkpoint(sizes):
    """Groups of 2 ranks after groups of 1: both ranks of both groups load group 0's
    step-4 (written by one rank: rank 1 reads the first loader entry) at its position;
    groups of 1 rank after groups of 2: both load group 1's step-6 (written by two ranks,
    in group 1's folder). Catches: a rank of the larger group finding no loader entry of
    its own and starting the data over, and the newest checkpoint missed where a group of
    another size wrote it."""
    job, first, third = sizes["job"], sizes["first"], sizes["third"]
    at_four = first["groups"][0].loader.position.windows
    for rank, got in sizes["second"].items():
        for group, (step, windows, source) in got["loaded"].items():
            assert (step, windows) == (4, at_four), (rank, group)
            assert source == str(job / "replica_0" / "checkpoint" / "step-4"), source
    for group, (step, _, source) in third["loaded"].items():
        assert step == 6 and source == str(job / "replica_1" / "checkpoint" / "step-6"), group
    assert len({w for _, w, _ in third["loaded"].values()}) == 1


def test_every_step_across_group_sizes_reads_the_uninterrupted_runs_windows_once(sizes):
    """1 rank, then 2 ranks a group (step 6 by group 1's two ranks alone), then 1 again:
    each committed step's windows are the uninterrupted run's, each step once. Catches:
    a group's ranks reading as if the group had one rank (both read the same slice), a
    split of the step over the groups but not over a group's ranks, and a resume at the
    wrong position or step after a change of size."""
    committed = _step_windows(sizes)
    assert sorted(committed) == list(range(1, STEPS + 1))
    for step, windows in committed.items():
        assert windows == sizes["expected"][step - 1], f"step {step}"


def test_a_larger_group_that_did_not_load_the_position_would_read_other_windows(sizes):
    """Negative control for the two tests above: the 2-rank group's step 5 read by loaders
    of that layout that never loaded step-4's position (the schedule's step set alone)
    is step 1's windows, not step 5's."""
    cfg = _cfg(sizes["job"], 1, 2)
    tokenizer = build_tokenizer(cfg.model)
    got = []
    for rank in (0, 1):
        loader = build_dataloader(cfg, tokenizer, rank, 2)
        loader.set_step(4)
        got += [row.tolist() for b in loader.next_step() for row in b["input"]]
    assert got != sizes["expected"][4] and got[0] == sizes["expected"][0][0]


def test_a_two_rank_group_left_alone_stops_together_on_one_ranks_signal(sizes):
    """Group 1 of 2 ranks, alone (its peer gone), its quorum stalled, the signal at its
    rank 1 only: both ranks give up the wait at the same look (fault_tolerance.
    timeout_seconds 0.5, not the stall's 10 s), stop after step 1 and write step-1
    together (a DCP save over the group's two processes). Catches: the give-up decided
    per rank (rank 0, not signalled, waits on; rank 1's save then breaks), the flags of
    the look not agreed inside the group."""
    alone = [sizes["second"][r]["alone"] for r in (0, 1)]
    assert [(a["stopped"], a["written"]) for a in alone] == [(1, True)] * 2, alone
    assert all(a["took"] < 3 for a in alone), alone
    folder = sizes["job"].parent / "alone" / "replica_1" / "checkpoint"
    assert complete_steps(str(folder)) == [1]


# ---- records of a group that heals past its start -----------------------------------------


class RecordedGroup(Group):
    """A group whose committed steps are on record as train.py keeps them: a provenance
    line per step tagged with its branch (records.metrics.ProvenanceWriter, made after
    the resume as the loop makes it, trimmed where the loop has it trimmed: at the first
    quorum and after a heal, ``ReplicaGroup.on_timeline``), and its tries."""

    def __init__(self, quorum: Quorum, job, gid: int, tokenizer, groups: int = 2):
        super().__init__(quorum, job, gid, groups, tokenizer,
                         extra=["--metrics.data_provenance"])  # fmt: skip

    def resume(self):
        from torchtitan.records.metrics import ProvenanceWriter

        super().resume()  # train.py's resume: its branch begun
        folder = os.path.join(self.cfg.job.dump_folder, "provenance")
        self.writer = ProvenanceWriter(folder, 0, self.state.step, True, self.state.lineage,
                                       writers=1)  # fmt: skip
        self.replicas.on_timeline = self.writer.trim_own
        return self

    def committed(self, batches: list[dict]):
        super().committed(batches)
        spans = [s for b in batches for s in b["spans"]]
        self.writer.write(self.state.step, spans, self.state.current_branch)

    def close(self):
        self.checkpoint.close()
        self.writer.close()
        self.replicas.close()


def _uninterrupted(job, groups: int, steps: int):
    """The tokenizer, and each step's sequences (sorted) of an uninterrupted run of
    ``steps`` steps with the same global batch."""
    tokenizer = build_tokenizer(_cfg(job, 0, groups).model)
    plain = build_dataloader(_cfg(job / "plain", 0, groups), tokenizer, 0, 1)
    return tokenizer, {s: sorted(map(json.dumps, (x for b in plain.next_step() for x in b["spans"])))
                       for s in range(1, steps + 1)}  # fmt: skip


def _rounds(quorum: Quorum, groups: dict, rounds: list[list[int]]):
    for participants in rounds:
        quorum.round(participants)
        quorum.run({g: groups[g].try_step for g in participants})


def test_a_group_that_heals_past_its_start_keeps_the_records_of_steps_it_committed(tmp_path):
    """Groups 0 and 1 commit steps 1-3 (group 0 writes step-2). Group 1 dies and starts
    again: it loads step-2, and its first quorum heals it to step 3 from group 0 (the
    step it committed in its first life); both commit step 4 (step-4 written) and 5. The
    whole job is relaunched: group 0 loads step-4 and commits step 5 again alone (a new
    branch); group 1, up later, loads step-4 and heals to step 5 from it; both commit 6.
    Group 1's records hold steps 1-4 and 6: its first life's lines of the steps the final
    timeline kept (3 included), not its line of the step 5 that group 0 trained again; and
    every step's sequences over both groups' records are the uninterrupted run's, each
    once. Catches the records trimmed at a group's start rather than at its first
    commit (trial 950007: group 1's share of step 3 gone), no trim at all and a trim by
    step alone (its line of the abandoned step 5 kept: read twice)."""
    tokenizer, expected = _uninterrupted(tmp_path, 2, 6)
    quorum = Quorum()
    groups = {g: RecordedGroup(quorum, tmp_path, g, tokenizer).resume() for g in (0, 1)}
    _rounds(quorum, groups, [[0, 1]] * 3)
    groups[1].close()  # dies after step 3: the newest checkpoint is step-2
    groups[1] = RecordedGroup(quorum, tmp_path, 1, tokenizer).resume()
    assert groups[1].state.step == 2
    _rounds(quorum, groups, [[0, 1]] * 2)
    assert groups[1].replicas.healed_at == 3
    for group in groups.values():  # the whole job killed after step 5
        group.close()
    quorum = Quorum()
    groups = {0: RecordedGroup(quorum, tmp_path, 0, tokenizer).resume()}
    _rounds(quorum, groups, [[0]])  # step 5 again, group 0 alone
    groups[1] = RecordedGroup(quorum, tmp_path, 1, tokenizer).resume()
    assert groups[1].state.step == 4
    _rounds(quorum, groups, [[0, 1]])
    assert groups[1].replicas.healed_at == 5
    for group in groups.values():
        group.close()

    def steps(gid, name="rank0.jsonl"):
        path = tmp_path / f"replica_{gid}" / "provenance" / name
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    assert steps(1) == [1, 2, 3, 4, 6], steps(1)
    assert steps(1, "tried_rank0.jsonl") == [1, 2, 3, 4, 6], steps(1, "tried_rank0.jsonl")
    assert steps(0) == [1, 2, 3, 4, 5, 6], steps(0)
    assert _job_sequences(tmp_path, (0, 1)) == expected


def _job_sequences(job, gids) -> dict[int, list]:
    """Each step's sequences over the groups' records (tries included), sorted."""
    from torchtitan.records.provenance import read_job_provenance

    merged: dict[int, list] = {}
    for by_step in read_job_provenance([str(job / f"replica_{g}") for g in gids]).values():
        for step, sequences in by_step.items():
            merged.setdefault(step, []).extend(map(json.dumps, sequences))
    return {s: sorted(v) for s, v in merged.items()}


def test_a_group_healed_into_a_second_start_from_one_state_drops_its_lines_of_the_first(tmp_path):
    """Three groups commit steps 1-3 (group 0 writes step-2); the whole job is killed, and
    step-2 never became durable (removed). Groups 0 and 1 start again from step 0 and
    commit steps 1-3 (step-2 written again); group 2, up later, loads that step-2 and
    heals to step 3, then all three commit step 4. Group 2's records hold step 4 alone:
    the second life trained 1-3 again from the same state (step 0), and its first
    life's lines of them go. Every step's sequences over the groups' records are the
    uninterrupted run's, each once. Catches a branch named by the state it starts from
    alone, the same in both lives (trial 920008: group 2 kept its lines of 2-3, read
    twice), where ``TrainState.name_branch`` names it by the quorum too."""
    import shutil

    tokenizer, expected = _uninterrupted(tmp_path, 3, 4)
    quorum = Quorum()
    groups = {g: RecordedGroup(quorum, tmp_path, g, tokenizer, 3).resume() for g in range(3)}
    _rounds(quorum, groups, [[0, 1, 2]] * 3)
    for group in groups.values():
        group.close()
    shutil.rmtree(tmp_path / "replica_0" / "checkpoint" / "step-2")
    quorum = Quorum()
    groups = {g: RecordedGroup(quorum, tmp_path, g, tokenizer, 3).resume() for g in (0, 1)}
    assert groups[0].state.step == 0
    _rounds(quorum, groups, [[0, 1]] * 3)
    groups[2] = RecordedGroup(quorum, tmp_path, 2, tokenizer, 3).resume()
    assert groups[2].state.step == 2
    _rounds(quorum, groups, [[0, 1, 2]])
    assert groups[2].replicas.healed_at == 3
    for group in groups.values():
        group.close()
    for name in ("rank0.jsonl", "tried_rank0.jsonl"):
        path = tmp_path / "replica_2" / "provenance" / name
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [4], name
    assert _job_sequences(tmp_path, range(3)) == expected


def test_a_group_whose_job_moved_on_since_its_start_commits_nothing_until_it_heals(tmp_path):
    """Group 0 starts (nothing to load yet: step 0); group 1, alone in the quorums,
    trains on (its step-2.. in its folder). Then group 0's first quorum, alone:
    - group 1 finished all 8 steps and published the marker: group 0 stops with the
      marker's one line (``JobFinished``: train.py exits 0), nothing trained;
    - group 1 trained 6 steps and lives: group 0 commits nothing (its vote is no) until
      group 1 joins its quorum, heals it to step 6, and both commit step 7; asked to stop
      (SIGTERM) while it waits, it stops at once (``StoppedWaiting``), writing nothing
      (trial 990038: it waited out the timeout instead);
    - group 1 trained 6 steps and died: group 0 commits nothing, and after
      fault_tolerance.timeout_seconds (0.5) stops in one line naming step-6 and its
      folder; started now, it would load step-6.
    Group 0's checkpoint folder stays empty throughout. Catches a group that trains
    again, on a second timeline, the steps its job committed while it started (trial
    920008: steps 7-12 twice), and one that stops where a holder of the newer step was
    only on its way (it heals instead)."""
    import time

    from torchtitan.faults.fault_tolerance import FaultToleranceError, JobFinished, StoppedWaiting

    tokenizer = build_tokenizer(_cfg(tmp_path, 0, 2).model)
    lives = iter(range(10))

    def late_start(case: str, steps: int):
        job = tmp_path / f"{case}{next(lives)}"
        quorum = Quorum()
        late = Group(quorum, job, 0, 2, tokenizer,
                     extra=["--fault_tolerance.timeout_seconds", "0.5"]).resume()  # fmt: skip
        peer = Group(quorum, job, 1, 2, tokenizer).resume()
        for _ in range(steps):
            quorum.round([1])
            quorum.run({1: peer.try_step})
        if case != "lives":
            peer.checkpoint.close()
        if case == "finished":
            peer.replicas.finish(peer.state.step, STEPS)
        return job, quorum, late, peer

    job, quorum, late, _ = late_start("finished", STEPS)
    quorum.round([0])
    with pytest.raises(JobFinished) as e:
        late.try_step()
    late.checkpoint.close()
    assert str(job / "replica_1" / fault_tolerance.FINISHED) in str(e.value)
    assert late.state.step == 0 and not late.read

    job, quorum, late, peer = late_start("lives", 6)
    quorum.round([0])
    quorum.run({0: late.try_step})
    assert late.state.step == 0 and not late.read  # its vote was no
    quorum.round([0, 1])
    quorum.run({0: late.try_step, 1: peer.try_step})
    assert late.replicas.healed_at == 6 and late.state.step == peer.state.step == 7
    assert late.read[7] and late.replicas._behind is None
    for group in (late, peer):
        group.checkpoint.close()

    job, quorum, late, peer = late_start("lives", 6)  # and group 0 is asked to stop
    late.replicas.asked_to_stop = lambda: True
    quorum.round([0])
    with pytest.raises(StoppedWaiting) as e:
        late.try_step()
    assert e.value.step == 0 and not late.checkpoint.save_alone(0)
    for group in (late, peer):
        group.checkpoint.close()

    job, quorum, late, _ = late_start("dead", 6)
    begin = time.monotonic()
    with pytest.raises(FaultToleranceError) as e:
        while time.monotonic() - begin < 30:
            quorum.round([0])
            late.try_step()
            time.sleep(0.05)
    late.checkpoint.close()
    assert late.state.step == 0 and not late.read
    assert f"step-6 ({job / 'replica_1' / 'checkpoint'})" in str(e.value), e.value
    assert "fault_tolerance.timeout_seconds 0.5" in str(e.value), e.value
    assert complete_steps(str(job / "replica_0" / "checkpoint")) == []
    now = Group(Quorum(), job, 0, 2, tokenizer).resume()
    now.checkpoint.close()
    assert now.state.step == 6


def test_a_step_refused_again_and_again_is_said_once_then_periodically(tmp_path, monkeypatch):
    """A quorum short of min_replica_groups refuses every try (hundreds a minute in the
    campaign's trials): 30 refusals of one step say it once; with the period at 0 every
    refusal after the first adds a line with its count. Catches a warning per try."""
    import logging

    tokenizer = build_tokenizer(_cfg(tmp_path, 0, 2).model)
    quorum = Quorum()
    group = Group(quorum, tmp_path, 0, 2, tokenizer).resume()
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("torchtitan").addHandler(handler)
    try:
        for period, tries in ((3600.0, 30), (0.0, 3)):
            monkeypatch.setattr(fault_tolerance, "RETRY_SAY_S", period)
            said.clear()
            group.replicas._refused = None
            for _ in range(tries):
                quorum.round([0], fails=True)
                quorum.run({0: group.try_step})
            lines = [m for m in said if "not committed" in m]
            assert len(lines) == (1 if period else tries), lines
    finally:
        logging.getLogger("torchtitan").removeHandler(handler)
        group.checkpoint.close()
    assert group.state.step == 0
    assert "3 tries" in lines[-1], lines


def test_a_group_whose_first_quorum_commits_nothing_keeps_its_records_through_a_later_heal(
    tmp_path,
):
    """Groups 0 and 1 commit steps 1-3 (group 0 writes step-2); the whole job is killed.
    Group 1 starts again first and sees no checkpoint (step-2 out of sight then: its
    writer had not finished it yet), so it starts from step 0; its first quorum, alone,
    commits nothing (the job's step-2 is newer: it waits for a holder). Group 0 then
    starts from step-2, and the next quorum heals group 1 to step 2; both commit step 3.
    Group 1's records hold steps 1-2 of its first life and step 3 of this one, each
    once, and every step's sequences over both groups' are the uninterrupted run's.
    Catches the records trimmed at the first quorum (trial 980216: group 1 trimmed to
    step 0 there, then healed past steps 1-2 at the next: their share gone)."""
    tokenizer, expected = _uninterrupted(tmp_path, 2, 3)
    quorum = Quorum()
    groups = {g: RecordedGroup(quorum, tmp_path, g, tokenizer).resume() for g in (0, 1)}
    _rounds(quorum, groups, [[0, 1]] * 3)
    for group in groups.values():
        group.close()
    step2 = tmp_path / "replica_0" / "checkpoint" / "step-2"
    step2.rename(tmp_path / "step-2")
    quorum = Quorum()
    groups = {1: RecordedGroup(quorum, tmp_path, 1, tokenizer).resume()}
    assert groups[1].state.step == 0
    (tmp_path / "step-2").rename(step2)
    _rounds(quorum, groups, [[1]])  # its first quorum: nothing committed
    assert groups[1].state.step == 0 and groups[1].replicas._behind is not None
    groups[0] = RecordedGroup(quorum, tmp_path, 0, tokenizer).resume()
    _rounds(quorum, groups, [[0, 1]])
    assert groups[1].replicas.healed_at == 2 and groups[1].state.step == 3
    for group in groups.values():
        group.close()
    for name in ("rank0.jsonl", "tried_rank0.jsonl"):
        path = tmp_path / "replica_1" / "provenance" / name
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
        assert steps == [1, 2, 3], (name, steps)
    assert _job_sequences(tmp_path, (0, 1)) == expected
