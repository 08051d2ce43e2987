"""The fault-tolerant job simulated at scale, small here (harness/ft_sim.py): the real
split and the real rewind through random deaths (several in one step, during a heal),
joins and failed votes; every committed step reads the uninterrupted run's windows,
each once. The 1,000-group run: scripts/benchmarks/bench_ft_sim.py."""

from __future__ import annotations

import pytest

from harness.ft_sim import simulate
from torchtitan.data.schedule import BatchSchedule

# Often enough that 300 steps see every kind of event.
EVENTFUL = dict(death_rate=3e-3, burst_rate=0.03, vote_fail_rate=0.01, back_after=(3, 30))


@pytest.mark.parametrize("seed", [1, 2])
def test_every_committed_step_reads_the_uninterrupted_runs_windows_once(seed):
    report = simulate(20, 4, 300, seed=seed, **EVENTFUL)
    assert report.committed == 300
    # the events the check went through
    assert report.uncommitted > 0 and report.deaths > 0 and report.joins > 0
    assert report.deaths_in_a_step_most >= 2 and report.heals > 0
    assert report.joins_while_healing > 0 or report.heals_with_death > 0


def test_an_off_by_one_in_the_split_is_caught(monkeypatch):
    """Negative control: a rank's slice one window too long where the batch splits
    unevenly (``<=`` for ``<``): the spans overlap, and the check names the step."""

    def off_by_one(self, global_batch, rank):
        base, extra = divmod(global_batch, self.dp_world)
        lo = rank * base + min(rank, extra)
        return lo, lo + base + (rank <= extra)

    monkeypatch.setattr(BatchSchedule, "rank_slice", off_by_one)
    with pytest.raises(AssertionError, match="step 1: spans do not tile"):
        simulate(20, 4, 300, seed=1, **EVENTFUL)
