"""A run's per-step records read back, strictly.

Owns the readers of a run's JSON lines files (``metrics.jsonl``, the provenance
records): a step that appears twice, or out of order, is an error rather than a value
that silently wins (a resume that failed to trim its files must not look fine).

Never: launch or train (``tools/launch.py`` launches), or decide whether a run is
correct (the callers compare). Cost: one pass over the file, O(its lines) memory.
"""

from __future__ import annotations

import json
from pathlib import Path


class RunRecordError(ValueError):
    """A run's records contradict themselves (a step twice, steps out of order)."""


def read_records(path: str | Path) -> list[dict]:
    """The JSON lines of a per-step file; raises RunRecordError unless steps strictly increase."""
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if records and record["step"] <= records[-1]["step"]:
                what = "twice" if record["step"] == records[-1]["step"] else "out of order"
                raise RunRecordError(f"{path}:{number}: step {record['step']} appears {what}")
            records.append(record)
    return records


def losses(dump: str | Path) -> dict[int, float]:
    """{step: loss} of a run's ``metrics.jsonl`` (strict: see ``read_records``)."""
    return {r["step"]: r["loss"] for r in read_records(Path(dump) / "metrics.jsonl")}


def validation_losses(dump: str | Path) -> dict[int, float]:
    """{step: validation_loss} of the steps of ``metrics.jsonl`` that ran a validation."""
    records = read_records(Path(dump) / "metrics.jsonl")
    return {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
