"""The decisions of a fault-tolerant step, fast (torchtitan/faults/replica_steps.py, and
the real ``ReplicaGroup`` of fault_tolerance.py driven by an in-process quorum,
harness/ft_quorum.py): a try that is not committed rewinds the loader's position and
step number; a heal carries the loader's position and the train state; the lowest
participant saves; the default global batch counts the replica groups; a stop asked in
one group is agreed by every group after the same step. Each test names the one-line
bug it catches (issue #49's mutants among them)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import CONFIG

import train as train_script
from harness.ft_quorum import Quorum
from torchtitan import parallel
from torchtitan.checkpoint import TrainState
from torchtitan.checkpoint.stateful import training_components
from torchtitan.config import parse_args
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.faults import replica_steps
from torchtitan.faults.fault_tolerance import LowestGroupSaves, ReplicaGroup
from torchtitan.faults.preemption import Preemption

ONE_RANK = parallel.ParallelDims(0, 1, 0, torch.device("cpu"), "gloo")
# Global batch 4, 8 from step 3, 6 from step 6: a step number one off reads another size.
SCHEDULE = ["--training.seq_len", "15", "--training.batch_size", "2",
            "--training.batch_size_schedule", "0:4,3:8,6:6"]  # fmt: skip


def _cfg(tmp_path, *extra):
    return parse_args([*CONFIG, "--fault_tolerance.enable", "--fault_tolerance.lighthouse",
                       "http://127.0.0.1:1", "--job.dump_folder", str(tmp_path), *extra])  # fmt: skip


class Group:
    """One replica group of one rank: a real loader, a tiny model, the real
    ``ReplicaGroup`` on the in-process quorum's manager."""

    def __init__(self, quorum: Quorum, gid: int, cfg, tokenizer):
        self.gid = gid
        self.loader = build_dataloader(cfg, tokenizer, 0, 1)
        self.model = torch.nn.Linear(4, 1, bias=False)
        self.state = TrainState()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        components = training_components(cfg, ONE_RANK, model=self.model, optimizer=optimizer,
                                         dataloader=self.loader, train_state=self.state,
                                         fingerprint={})  # fmt: skip
        manager = quorum.manager(gid)
        self.replicas = ReplicaGroup(cfg, ONE_RANK, self.loader, components, self.model,
                                     self.state, manager=manager)  # fmt: skip
        manager.replica = self.replicas
        self.read: dict[int, list] = {}  # committed step -> this group's windows
        self.losses = {}  # committed step -> (own loss, the participants' mean)
        self.tries = []  # (step tried, committed, loader (position, step) after)

    def try_step(self, dies: bool = False):
        batches = self.replicas.next_step()
        windows = [row.tolist() for b in batches for row in b["input"]]
        if dies:  # killed before the all-reduce
            return
        self.model.zero_grad()
        loss = (self.model.weight.sum() * float(len(windows))).reshape(())
        loss.backward()
        averaged = loss.detach().clone()
        ok = self.replicas.commit(averaged)
        if ok:  # what the loop does after a committed step
            self.state.step += 1
            self.read[self.state.step] = windows
            self.losses[self.state.step] = (loss.detach(), averaged)
        self.tries.append((self.state.step + (not ok), ok, self.loader.position.windows,
                           self.loader.step))  # fmt: skip


class Recorder:
    """The CheckpointManager's calls as LowestGroupSaves and the stop make them (what is
    tested is who calls, not what DCP writes)."""

    def __init__(self):
        self.saved = []

    def should_save(self, step):
        return True

    def save(self, step, **kw):
        self.saved.append(step)

    def close(self):
        return None


def _plain_steps(cfg, tokenizer, steps: int) -> list[list]:
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    return [[row.tolist() for b in loader.next_step() for row in b["input"]] for _ in range(steps)]


def _round(quorum, groups, dies=(), fails=False):
    quorum.round([g.gid for g in groups], dies=dies, fails=fails)
    quorum.run({g.gid: (lambda g=g: g.try_step(g.gid in dies)) for g in groups})


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    """Two groups: a vote that fails (both rewind), group 1 dies during step 3 (group 0
    tries it again alone), group 0 trains alone, group 1 starts afresh and heals at step 5,
    and a stop asked by group 1 alone at step 6."""
    tmp = tmp_path_factory.mktemp("ft")
    cfg = _cfg(tmp, *SCHEDULE)
    tokenizer = build_tokenizer(cfg.model)
    quorum = Quorum()
    g0, g1 = Group(quorum, 0, cfg, tokenizer), Group(quorum, 1, cfg, tokenizer)
    rounds = {"lowest": [], "stop": []}
    _round(quorum, [g0, g1])  # step 1
    _round(quorum, [g0, g1], fails=True)  # step 2, not committed: both rewind
    _round(quorum, [g0, g1])  # step 2
    rounds["lowest"].append((g0.replicas.lowest, g1.replicas.lowest))
    _round(quorum, [g0, g1], dies=(1,))  # step 3: group 1 dies, nobody commits
    _round(quorum, [g0])  # step 3, alone
    _round(quorum, [g0])  # step 4
    again = Group(quorum, 1, cfg, tokenizer)  # started afresh: step 0, position 0
    _round(quorum, [g0, again])  # heals at step 4, step 5 together
    again.replicas.asked_to_stop = lambda: True  # a signal to group 1 only
    for _ in range(2):  # steps 6, 7
        _round(quorum, [g0, again])
        rounds["stop"].append((g0.replicas.stop_agreed, again.replicas.stop_agreed))
    # Group 0 leaves and group 2 joins in the same step: the count stays 2, but group 1
    # is now the first participant (its split changes at the same count).
    g2 = Group(quorum, 2, cfg, tokenizer)
    _round(quorum, [again, g2])  # step 8
    return {"g0": g0, "g1": g1, "again": again, "g2": g2, "rounds": rounds,
            "plain": _plain_steps(cfg, tokenizer, 8)}  # fmt: skip


def test_every_committed_step_reads_the_uninterrupted_runs_windows(faulted):
    """Catches: the rewind forgetting the position (the retry reads the next step's
    windows), the rewind's step number one off (the retry reads another global batch),
    a heal without the loader's position (the healed group reads from the start)."""
    g0, g1, again, plain = faulted["g0"], faulted["g1"], faulted["again"], faulted["plain"]
    for step in range(1, 9):
        readers = [g for g in (g0, g1, again, faulted["g2"]) if step in g.read]
        got = [w for g in sorted(readers, key=lambda g: g.gid) for w in g.read[step]]
        assert got == plain[step - 1], f"step {step}: {[g.gid for g in readers]}"
    assert sorted(g0.read) == list(range(1, 8)) and sorted(again.read) == [5, 6, 7, 8]


def test_a_try_that_is_not_committed_puts_position_and_step_back(faulted):
    """Catches: the rewind setting the step one off, or only the step (no seek)."""
    g0, g1 = faulted["g0"], faulted["g1"]
    failed = [t for t in g0.tries if not t[1]]
    assert [t[0] for t in failed] == [2, 3]
    committed_after = {t[0]: t for t in g0.tries if t[1]}
    for step, _, windows, loader_step in failed:
        before = committed_after[step - 1]
        assert (windows, loader_step) == (before[2], before[3]) == (before[2], step - 1)
    assert [t[1] for t in g1.tries] == [True, False, True]  # it died before its 4th


def test_a_heal_carries_the_loaders_position_and_the_train_state(faulted):
    """Catches: a heal that leaves out the loader (or the train state)."""
    g0, again = faulted["g0"], faulted["again"]
    assert again.loader.position.windows == faulted["g2"].loader.position.windows
    assert again.replicas.healed_at == 4 and faulted["g2"].replicas.healed_at == 7
    assert g0.loader.step == g0.state.step == 7
    assert again.loader.step == again.state.step == faulted["g2"].state.step == 8


def test_the_lowest_participant_saves_and_says_so(faulted, tmp_path):
    """Catches: LowestGroupSaves letting another participant save, and a log line that
    says a checkpoint exists where the group skipped the save."""
    assert faulted["rounds"]["lowest"] == [(True, False)]
    assert [replica_steps.saves(r) for r in (0, 1, 2, None)] == [True, False, False, False]

    records = []
    for group in (faulted["again"], faulted["g2"]):  # the last quorum: groups 1 and 2
        saver = LowestGroupSaves(Recorder(), group.replicas)
        records.append((saver.should_save(2), saver.save(2), saver._checkpoint.saved))
    assert records == [(True, True, [2]), (False, False, [])]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """Two groups with fault_tolerance.min_replica_groups 2; group 1 alone is signalled
    (the first of a scheduler's signals, node by node) before step 2's commit."""
    cfg = _cfg(tmp_path_factory.mktemp("min2"), *SCHEDULE, "--fault_tolerance.min_replica_groups",
               "2")  # fmt: skip
    tokenizer = build_tokenizer(cfg.model)
    quorum = Quorum()
    g0, g1 = Group(quorum, 0, cfg, tokenizer), Group(quorum, 1, cfg, tokenizer)
    stops = []
    for step in (1, 2):
        g1.replicas.asked_to_stop = lambda step=step: step == 2
        _round(quorum, [g0, g1])
        stops.append((g0.replicas.stop_agreed, g1.replicas.stop_agreed))
    return {"g0": g0, "g1": g1, "stops": stops}


def test_a_signalled_group_leaves_and_the_others_train_on(faulted):
    """min_replica_groups 1: the signalled group stops after the step its vote went in,
    the other trains on alone. Catches: a stop that takes every group (or none)."""
    assert faulted["rounds"]["stop"] == [(False, True), (False, True)]
    assert faulted["g0"].replicas.asked_to_stop() is False


def test_when_too_few_would_be_left_every_group_stops_after_the_same_step(preempted):
    """min_replica_groups 2: group 1's signal stops group 0 after the same step, instead
    of leaving it to wait for a quorum that cannot come (issue #49's 100 ms case).
    Catches: the stop read from this group's own flag, not the all-reduced votes."""
    assert preempted["stops"] == [(False, False), (True, True)]


@pytest.mark.parametrize(
    "asked, leaving, participants, least, stops",
    [(True, 1, 3, 1, True), (False, 1, 3, 2, False), (False, 2, 3, 2, True),
     (False, 0, 1, 2, False), (False, 1, 2, 2, True), (False, 1, 2, 1, False)],
)  # fmt: skip
def test_who_stops_after_a_step(asked, leaving, participants, least, stops):
    assert replica_steps.stops_after_step(asked, leaving, participants, least) is stops
    assert replica_steps.leaving_groups(leaving / participants, participants) == leaving


def test_the_stop_log_never_claims_a_checkpoint_it_did_not_write(faulted, caplog):
    """Catches: the stop's log line saying ``checkpoint step-N written`` in a group whose
    LowestGroupSaves skipped the save."""
    preemption = Preemption(ONE_RANK, [])
    logger = logging.getLogger("torchtitan")
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        logger.propagate = True
        try:
            for group in (faulted["g2"], faulted["again"]):  # not the lowest, then the lowest
                saver = LowestGroupSaves(Recorder(), group.replicas)
                train_script.stop_with_checkpoint(saver, preemption, 5, saved=False)
        finally:
            logger.propagate = False
    lines = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert "written" not in lines[0] and "no checkpoint from this" in lines[0], lines
    assert "checkpoint step-5 written" in lines[1], lines  # negative control


@pytest.mark.parametrize("groups", [1, 3])
def test_the_default_global_batch_counts_the_replica_groups(tmp_path, groups):
    """Catches: the default global batch forgetting the replica groups (a job of N
    groups training on one group's batch)."""
    cfg = _cfg(tmp_path, "--training.batch_size", "2", "--fault_tolerance.replica_groups",
               str(groups))  # fmt: skip
    loader = build_dataloader(cfg, build_tokenizer(cfg.model), 0, 1)
    ReplicaGroup(cfg, ONE_RANK, loader, {}, torch.nn.Linear(1, 1), TrainState(),
                 manager=Quorum().manager(0))  # fmt: skip
    assert loader.schedule.global_batch(0) == 2 * groups
    # negative control: a global batch the config sets holds as it is
    set_batch = _cfg(tmp_path, "--training.batch_size", "2", "--training.global_batch_size", "6")
    assert replica_steps.default_schedule(set_batch.training, 1, 0, groups) is None
    four = replica_steps.default_schedule(cfg.training, 4, 1, groups)
    assert (four.global_batch(0), four.dp_world) == (2 * 4 * groups, 4)


def test_the_logged_loss_is_the_participants_mean(faulted):
    """Catches: the loss read from another slot of the all-reduced buffer."""
    g0, again = faulted["g0"], faulted["again"]
    for step in (5, 6, 7):
        own = [g.losses[step][0] for g in (g0, again)]
        assert g0.losses[step][1] == again.losses[step][1] == (own[0] + own[1]) / 2, step
    assert g0.losses[4][1] == g0.losses[4][0]  # alone: its own


def test_the_loop_stops_on_the_agreed_flag_not_its_own(preempted):
    """Catches: ``Preemption.requested`` reading this group's own flag under fault
    tolerance (the group never signalled would wait for a quorum that cannot come)."""
    preemption = Preemption(ONE_RANK, ["SIGUSR2"])
    try:
        preemption.agree_across(preempted["g0"].replicas)
        assert preemption.received is None and preemption.requested()
    finally:
        preemption.close()
    plain = Preemption(ONE_RANK, ["SIGUSR2"])  # negative control: no signal, no stop
    try:
        assert not plain.requested()
    finally:
        plain.close()


@pytest.mark.parametrize("participants, group_world", [(1, 1), (3, 1), (3, 4), (5, 8)])
def test_each_group_rank_reads_its_own_share_of_the_step(participants, group_world):
    """Catches: groups and their ranks interleaved another way (ranks of one group not
    contiguous, or two ranks of the step on one slice)."""
    ranks = [replica_steps.step_rank(p, participants, r, group_world)
             for p in range(participants) for r in range(group_world)]  # fmt: skip
    assert ranks == [(i, participants * group_world) for i in range(participants * group_world)]


# ---- loader workers ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["1worker", "2workers"])
def with_workers(request, tmp_path_factory):
    """Two groups whose loaders have ``params`` workers per rank: 2 participants, a vote
    that fails (both rewind), group 1 dies during step 3 (group 0 rewinds and trains it
    alone: the split changes 2 -> 1), group 1 starts afresh, heals and joins (1 -> 2).
    Group 0's worker pids are recorded after each of its tries."""
    workers = request.param
    cfg = _cfg(tmp_path_factory.mktemp(f"w{workers}"), *SCHEDULE, "--training.num_workers",
               str(workers))  # fmt: skip
    tokenizer = build_tokenizer(cfg.model)
    quorum = Quorum()
    g0, g1 = Group(quorum, 0, cfg, tokenizer), Group(quorum, 1, cfg, tokenizer)
    groups, pids = [g0, g1], []
    try:
        for live, dies, fails in [([g0, g1], (), False), ([g0, g1], (), True),
                                  ([g0, g1], (), False), ([g0, g1], (1,), False),
                                  ([g0], (), False), ([g0], (), False)]:  # fmt: skip
            _round(quorum, live, dies=dies, fails=fails)
            pids.append(g0.loader.worker_pids())
        again = Group(quorum, 1, cfg, tokenizer)
        groups.append(again)
        for _ in range(2):  # heals at step 4; steps 5 and 6 by both
            _round(quorum, [g0, again])
            pids.append(g0.loader.worker_pids())
    finally:
        # Closed together: a worker forked after another loader's holds that loader's
        # workers' exit pipes, and a close joins its own workers on theirs.
        closing = [threading.Thread(target=g.loader.close) for g in groups]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
    plain_cfg = _cfg(tmp_path_factory.mktemp("w0"), *SCHEDULE)
    return {"groups": [g0, g1, again], "pids": pids, "workers": workers,
            "plain": _plain_steps(plain_cfg, tokenizer, 6)}  # fmt: skip


def test_with_loader_workers_a_participant_change_is_a_seek_not_a_restart(with_workers):
    """With 1 and 2 workers per rank, every committed step's windows are the 0-worker
    loader's (through 2 -> 1 -> 2 participants, a rewind and a heal), and group 0's
    workers are the ones it started with: the split, the rewind and the heal reached
    them as requests. Catches: the split not forwarded to running workers (they read the
    old split), the request's step or position one step early, a restart per change."""
    groups, plain = with_workers["groups"], with_workers["plain"]
    g0 = groups[0]
    for step in range(1, 7):
        got = [w for g in groups if step in g.read for w in g.read[step]]
        assert got == plain[step - 1], f"step {step}: {[g.gid for g in groups if step in g.read]}"
    assert sorted(g0.read) == list(range(1, 7))
    assert [t[1] for t in g0.tries] == [True, False, True, False, True, True, True, True]
    first = with_workers["pids"][0]
    assert len(first) == with_workers["workers"]
    assert all(p == first for p in with_workers["pids"]), with_workers["pids"]


def test_a_worker_left_on_the_old_split_reads_other_windows(tmp_path, monkeypatch):
    """Negative control of the test above: workers that keep the request they started
    with (the split never reaches them) hand out the old split's windows after a change."""
    from torchtitan.data import loader as loader_module

    cfg = _cfg(tmp_path, *SCHEDULE, "--training.num_workers", "1")
    tokenizer = build_tokenizer(cfg.model)
    plain = _plain_steps(_cfg(tmp_path, *SCHEDULE), tokenizer, 2)
    publish, first = loader_module.Requests.publish, {}

    def stale(self, payload):  # every later request is the first one again
        return publish(self, first.setdefault(id(self), payload))

    monkeypatch.setattr(loader_module.Requests, "publish", stale)
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    try:
        replica_steps.split_loader(loader, 0, 2, 0, 1)  # half of step 1
        half = [row.tolist() for b in loader.next_step() for row in b["input"]]
        assert half == plain[0][: len(half)]
        replica_steps.split_loader(loader, 0, 1, 0, 1)  # alone from step 2: all of it
        got = [row.tolist() for b in loader.next_step() for row in b["input"]]
        assert got != plain[1]
    finally:
        loader.close()
