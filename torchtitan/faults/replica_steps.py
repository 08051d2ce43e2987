"""The decisions of a fault-tolerant step, apart from torchft: plain functions of the
quorum's answers, so that each can be tested in milliseconds and driven at the scale of
a thousand groups by a simulated quorum (harness/ft_sim.py).

Owns: which data-parallel rank a group rank reads as in a step (``step_rank``) and the
loader's split (``split_loader``); the try of a step (``StepTry``: where it began, and
the rewind of the position and the step number when it is not committed); which group
writes the job's checkpoints (``saves``); the default global batch over the groups
(``default_schedule``); the stop agreement carried in the step's all-reduce
(``stop_vote``, ``leaving_groups``, ``stops_after_step``).

Cost: O(1) a step for each (the split: a seek when the participant count changes,
nothing otherwise; a rewind: one seek). With loader workers either is a request the
running workers follow from their next micro-batch (data/loader.py), not a restart:
what they had made ahead for the old plan is dropped.

Never: talk to torchft, the lighthouse or a process group (fault_tolerance.py does),
choose windows (data/order.py) or split a step's windows (data/schedule.py).
"""

from __future__ import annotations

from torchtitan.data.schedule import BatchSchedule


def step_rank(participant: int, participants: int, group_rank: int,
              group_world: int) -> tuple[int, int]:  # fmt: skip
    """(data-parallel rank, data-parallel world) of group rank ``group_rank`` of the
    step's ``participant``-th group of ``participants``: the groups in quorum order,
    each group's ranks inside its share."""
    return participant * group_world + group_rank, participants * group_world


def split_loader(loader, participant: int, participants: int, group_rank: int, group_world: int):
    """Make ``loader`` read as ``step_rank(...)`` from its next step on: the same global
    windows per step, split over this step's ranks. A seek (O(1)) when the split
    changes, nothing otherwise."""
    rank, world = step_rank(participant, participants, group_rank, group_world)
    if (loader.dp_rank, loader.dp_world) == (rank, world):
        return
    old = loader.schedule
    loader.reshard(rank, BatchSchedule(old.points, old.micro, world, rank))


def default_schedule(training, group_world: int, group_rank: int,
                     replica_groups: int) -> BatchSchedule | None:  # fmt: skip
    """The schedule a group's loader reads when the config sets no global batch: every
    rank's micro-batch over the most groups the job has (``replica_groups``), so that
    the step's global batch does not change with the participants. None where the
    config sets one (it holds as it is)."""
    t = training
    if t.global_batch_size or t.batch_size_schedule:
        return None
    size = t.batch_size * group_world * replica_groups
    return BatchSchedule([(0, size)], t.batch_size, group_world, group_rank)


class StepTry:
    """One try of a step: where the loader stood when it began (``begin``), and what the
    commit vote decides (``settle``): a committed try keeps the loader where the step
    left it; a try that is not committed puts it back, position and step number, so
    that the next try reads the same windows by the same schedule step. The position a
    peer heals from or a checkpoint saves is therefore always the last committed step's."""

    def __init__(self, loader):
        self.loader = loader
        self.position = None
        self.step: int | None = None  # loader.step when the try began (committed steps)

    def begin(self):
        self.position, self.step = self.loader.position.copy(), self.loader.step

    @property
    def number(self) -> int:
        """The training step this try is for (1-based, as the loop counts)."""
        return self.step + 1

    def settle(self, committed: bool) -> bool:
        """Keep the step (committed) or rewind the loader to where it began; the vote."""
        if not committed:
            self.loader.seek(self.position)
            self.loader.set_step(self.step)
        return committed


def saves(participating_rank: int | None) -> bool:
    """Whether this group writes the job's checkpoints: it is the first participant of
    the last quorum (the lowest live group), so that one group writes one per due step."""
    return participating_rank == 0


def stop_vote(asked: bool) -> float:
    """This group's part of the stop agreement (1 where any of its ranks received a
    signal), averaged with the gradients in the step's cross-group all-reduce."""
    return 1.0 if asked else 0.0


def leaving_groups(mean_vote: float, participants: int) -> int:
    """How many of the committed step's participants asked to stop, from the vote's
    all-reduced mean: the same count on every rank of every participant."""
    return round(mean_vote * participants)


def stops_after_step(asked: bool, leaving: int, participants: int, min_groups: int) -> bool:
    """Whether this group stops after the committed step: it asked (a signal reached
    it: it leaves, the others may train on), or so many leave that fewer than
    ``min_groups`` would be left (the job cannot commit another step: every group stops
    after the same step instead of waiting for a quorum that cannot come)."""
    return asked or (leaving > 0 and participants - leaving < min_groups)
