"""A rewind's record: the skip a loss spike's rewind decided, durable before the next step.

Owns: the files ``<checkpoint folder>/rewinds/rewind-<k>.json``, one per rewind of the
job (k = 1, 2, ..., in the order they happened), each holding the spike's step, the
checkpoint step it went back to, the skip (``[first step, steps]``) and the guard's
counters after it. A rewind reloads a checkpoint written before the spike, whose loader
entry holds no such skip; until the next checkpoint is written the skip lived in memory
only, so a job killed in that stretch and requeued (with the spike's cause gone: a
flipped bit, a bad host) trained on the skipped data. The record is written, by rank 0,
before the rewind's line is logged and before the next step trains; a start reads every
record (``read``) and passes over their skips as it passes over
``training.skip_steps``: a rewound run is, by definition, the run started with its
skips, so a skip is right whichever checkpoint the start loads (one written after the
rewind already lists it; the loader adds a skip once).

Torn files: each record is published whole (a local file renamed over its name, then
the folder synced; one PUT on a store), so a kill -9 leaves a record whole or absent. A
record that does not parse was damaged by something else: the start stops with one line
naming it and the fix rather than guess which data to skip.

Cost: one small file (~200 bytes) and one sync per rewind (at most
``training.max_rewinds`` a job); a start reads ``rewinds + 1`` of them on rank 0 (one GET
each on a store: a missing name ends the list) and broadcasts them; O(rewinds), never
O(steps), the same at c4's or FineWeb's scale.

Never: choose or load checkpoints, or decide what a spike is (spikes.py).
"""

from __future__ import annotations

import json

from torchtitan.checkpoint.folder import CheckpointError, fsync_dir
from torchtitan.io import storage

FOLDER = "rewinds"


def path_of(folder: str, k: int) -> str:
    return storage.join(folder, FOLDER, f"rewind-{k}.json")


def record(folder: str, spike: int, to: int, skip: tuple[int, int], counts: dict) -> int:
    """Publish the next record (rank 0), synced before it returns; its number. Numbered
    by the records the folder holds, never by the guard's counters (a branch starts
    with its source's): ``read`` stops at the first number missing, so none may be.
    Cost: one existence check per record already there (O(rewinds))."""
    where = storage.join(folder, FOLDER)
    storage.makedirs(where)
    k = 1
    while storage.exists(path_of(folder, k)):
        k += 1
    body = json.dumps({"rewind": k, "spike": spike, "to": to, "skip": list(skip),
                       "counts": counts}, sort_keys=True).encode()  # fmt: skip
    storage.publish(path_of(folder, k), lambda f: f.write(body))
    if not storage.is_remote(where):
        fsync_dir(where)
    return k


def read(folder: str) -> list[dict]:
    """Every rewind's record, in order (rank 0; the caller broadcasts them)."""
    out, k = [], 1
    while True:
        path = path_of(folder, k)
        try:
            body = storage.read_bytes(path)
        except FileNotFoundError:
            return out
        try:
            entry = json.loads(body)
            first, steps = (int(v) for v in entry["skip"])
            counts = {str(n): int(v) for n, v in entry["counts"].items()}
            out.append({"rewind": k, "spike": int(entry["spike"]), "to": int(entry["to"]),
                        "skip": (first, steps), "counts": counts})  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"rewind record {path} is damaged ({type(e).__name__}: {e}); it names data "
                "a loss spike's rewind skipped: restore it, or remove the rewinds folder and "
                "pass every rewind's skip as --training.skip_steps (spikes.jsonl's rewind "
                "events name them)"
            ) from None
        k += 1
