"""torchtitan/data/schedule.py: the global batch of a step and its split over ranks.

The split's use by the loader (each rank's micro-batches and their loss weights) is
tested with the loader (test_loader.py).
"""

from __future__ import annotations

import pytest

from torchtitan.data.schedule import BatchSchedule, parse_schedule


def test_an_uneven_split_over_1_016_ranks_is_measured_and_said():
    """Where the global batch does not split evenly enough (2,048 over 1,016 ranks: 2 or
    3 each), the loader says so with the figure and a batch that divides; where it does
    (8,192), it is silent."""
    import io
    import logging

    said = io.StringIO()
    handler = logging.StreamHandler(said)
    log = logging.getLogger("torchtitan.data.schedule")
    log.addHandler(handler)
    try:
        assert BatchSchedule([(0, 8192)], 8, 1016).imbalance(8192) == pytest.approx(
            9 / (8192 / 1016)
        )
        assert not said.getvalue()
        BatchSchedule([(0, 2048)], 3, 1016)
    finally:
        log.removeHandler(handler)
    assert "1.49 x the mean" in said.getvalue() and "2032" in said.getvalue()


# ---- resume -----------------------------------------------------------------------------


def test_a_schedule_is_step_points_that_increase_from_step_0():
    """``0:4,2:8`` gives 4 sequences at steps 0 and 1, then 8; a schedule that does not
    start at 0, goes back, or has a part that is not step:sequences is refused naming it."""
    schedule = BatchSchedule(parse_schedule("0:4,2:8"), 2, 2)
    assert [schedule.global_batch(s) for s in range(4)] == [4, 4, 8, 8]
    for text, problem in (("1:4", "first point must be at step 0"),
                          ("0:4,2:8,2:16", "steps must increase"),
                          ("0:4,x:8", "'x:8' is not step:sequences"),
                          ("0:0", "at least 1 sequence")):  # fmt: skip
        with pytest.raises(ValueError, match=problem):
            parse_schedule(text)
