"""A rewind's record (checkpoint/rewinds.py): numbered by the records the folder holds,
read back in order; a start reads every one of them."""

from __future__ import annotations

from torchtitan.checkpoint import rewinds


def test_records_are_numbered_by_the_folder_not_by_the_guards_counters(tmp_path):
    """A branch starts with its source's counters (3 rewinds): its first rewind is still
    record 1 and its second record 2, so a start reads both, in order. Negative control:
    a folder whose numbers have a gap (record 1 gone) reads nothing past it, which is why
    the numbers must come from the folder."""
    folder = str(tmp_path / "checkpoint")
    assert rewinds.record(folder, 9, 6, (7, 4), {"rewinds": 4, "spikes": 4}) == 1
    assert rewinds.record(folder, 15, 12, (13, 4), {"rewinds": 5, "spikes": 5}) == 2
    got = rewinds.read(folder)
    assert [(r["rewind"], r["skip"], r["counts"]["rewinds"]) for r in got] == [
        (1, (7, 4), 4), (2, (13, 4), 5)]  # fmt: skip
    (tmp_path / "checkpoint" / "rewinds" / "rewind-1.json").unlink()
    assert rewinds.read(folder) == []
