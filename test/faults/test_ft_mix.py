"""A mix schedule across quorum changes (fast, in one process): the real ``ReplicaGroup``
on harness/ft_quorum.py's quorum, real loaders over a mix of two sources whose weights
move by step (``training.mix_schedule``: 0.8/0.2, then a ramp to 0.2/0.8 over steps 3-5)
and a batch-size schedule, while the participants change in the middle of the ramp: a
vote that fails, a group killed mid-step (the step tried again alone), a group that
heals and joins, a leave and a join in one step (same count, another first
participant). Every committed step's windows must be the uninterrupted run's, each
once. Each test names the one-line bug it catches."""

from __future__ import annotations

import json

import pytest
from test_ft_elastic import Group, _cfg

from harness.ft_quorum import Quorum
from torchtitan.data import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer

pytest.importorskip("torchft")

STEPS = 8


def _mix(tiny_corpus, second_corpus, at: int = 3) -> list[str]:
    points = [{"step": at, "weights": {"shakespeare": 0.2, "kjv": 0.8}, "ramp": 2}]
    return ["--training.datasets", f"{tiny_corpus}:0.8,{second_corpus}:0.2",
            "--training.mix_schedule", json.dumps(points)]  # fmt: skip


class Faulted(Group):
    """``Group`` (test_ft_elastic.py) whose try can die before the all-reduce, and whose
    committed windows keep their sources (the spans)."""

    def try_step(self, dies: bool = False):
        batches = self.replicas.next_step()
        if dies:
            return
        self.model.zero_grad()
        (self.model.weight.sum() * float(len(batches))).backward()
        if self.replicas.commit(self.model.weight.sum().detach()):
            self.state.step += 1
            self.read[self.state.step] = _windows(batches)


def _windows(batches) -> list:
    """Each sequence's tokens and the source of its first span."""
    return [(row.tolist(), spans[0][0]) for b in batches
            for row, spans in zip(b["input"], b["spans"])]  # fmt: skip


def _uninterrupted(job, tokenizer, mix) -> list[list]:
    plain = build_dataloader(_cfg(job, 0, 1, *mix), tokenizer, 0, 1)
    return [_windows(plain.next_step()) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_corpus, second_corpus):
    job = tmp_path_factory.mktemp("mix") / "job"
    mix = _mix(tiny_corpus, second_corpus)
    tokenizer = build_tokenizer(_cfg(job, 0, 3, *mix).model)
    quorum = Quorum()

    def group(gid):
        return Faulted(quorum, job, gid, 3, tokenizer, extra=mix)

    g0, g1 = group(0), group(1)
    groups = [g0, g1]

    def step(live, dies=(), fails=False):
        quorum.round([g.gid for g in live], dies=dies, fails=fails)
        quorum.run({g.gid: (lambda g=g: g.try_step(g.gid in dies)) for g in live})

    step([g0, g1])  # 1
    step([g0, g1], fails=True)  # 2, not committed: both rewind
    step([g0, g1])  # 2
    step([g0, g1], dies=(1,))  # 3, the ramp's first step: group 1 killed, nobody commits
    step([g0])  # 3, alone
    step([g0])  # 4
    g1.checkpoint.close()  # its process ended (the lease goes with it)
    again = group(1)  # started afresh: heals at step 4
    groups.append(again)
    step([g0, again])  # 5, the ramp's last step
    g2 = group(2)  # group 0 leaves, group 2 joins (heals at 5): group 1 is now first
    groups.append(g2)
    for _ in range(3):
        step([again, g2])  # 6, 7, 8
    for g in groups[2:] + [g0]:
        g.checkpoint.close()
    later = _uninterrupted(job, tokenizer, _mix(tiny_corpus, second_corpus, at=4))
    return {"groups": groups, "expected": _uninterrupted(job, tokenizer, mix), "later": later}


def _committed(mixed) -> dict[int, list]:
    committed: dict[int, list] = {}
    for group in sorted(mixed["groups"], key=lambda g: g.gid):  # quorum order: by group id
        for step, windows in group.read.items():
            committed.setdefault(step, []).extend(windows)
    return committed


def test_every_committed_step_reads_the_uninterrupted_mix(mixed):
    """Each committed step's windows (tokens and source) over its participants are the
    uninterrupted run's, through the ramp, whoever took part. Catches: a rewind that
    keeps the sources' cursors the failed try advanced (the retry reads on), a rewind or
    heal whose step number is off (the retry reads another step's weights and batch), a
    split not redone when the first participant changes at the same count."""
    committed = _committed(mixed)
    assert sorted(committed) == list(range(1, STEPS + 1))
    for step, windows in committed.items():
        assert windows == mixed["expected"][step - 1], f"step {step}"
    readers = {s: sorted(g.gid for g in mixed["groups"] if s in g.read) for s in committed}
    assert readers[3] == readers[4] == [0] and readers[6] == [1, 2], readers


def test_the_mix_moves_and_a_schedule_one_step_later_reads_other_windows(mixed):
    """Negative control: the check above is not blind to the schedule. The weights do
    move (kjv's share of the windows rises from steps 1-2 to steps 6-8), and the same
    schedule starting one step later reads other windows at some committed step."""
    expected = mixed["expected"]

    def share(steps):
        got = [src for s in steps for _, src in expected[s - 1]]
        return got.count("kjv") / len(got)

    assert share([1, 2]) < share([6, 7, 8])
    committed = _committed(mixed)
    assert any(committed[s] != mixed["later"][s - 1] for s in committed)
