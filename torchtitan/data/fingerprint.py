"""What changed between two data fingerprints (``plan.combine`` makes them).

Owns: turning two data fingerprints into readable 'field: old -> new' lines, and
telling a corpus that grew (files appended, nothing else changed) from one that
changed. Sources are matched by name: the mix (the weights, sources added or gone) is
no difference of the data, as the config may change it on resume (the loader's entry
says what changed, ``state.restore_cursors``); a changed file of a source in both is.
Never: decide what a change means (the loader's checkpoint entry does, ``state.py``).
"""

from __future__ import annotations


def fingerprint_diff(old: dict, new: dict) -> list[str]:
    """Each differing field of two data fingerprints, as 'field: old -> new'.

    Only the fields this version fingerprints count: a field an older version recorded
    and this one dropped (``data_shards``, gone with the virtual shards; ``seq_len``, which
    a resume may change: the stream continues at its token offsets) is not a change.
    """
    diffs = []
    for key in sorted(new):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "sources" and isinstance(a, list) and isinstance(b, list):
            diffs += _sources_diff(a, b)
        else:
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def _sources_diff(old: list[dict], new: list[dict]) -> list[str]:
    """The changed files of each source both fingerprints hold (by name)."""
    before = {s["name"]: s for s in old}
    diffs = []
    for b in new:
        a = before.get(b["name"])
        if a is None or appended_files(a, b):
            continue  # new to the mix, or grown: the saved files are the first, unchanged
        files_a = {f[0]: f[1:] for f in a["files"]}
        files_b = {f[0]: f[1:] for f in b["files"]}
        for name in sorted(set(files_a) | set(files_b)):
            if files_a.get(name) == [] and files_b.get(name):
                continue  # unsigned when saved (an object, before objects were signed)
            if files_a.get(name) != files_b.get(name):
                what = (
                    "added"
                    if name not in files_a
                    else "removed"
                    if name not in files_b
                    else "changed"
                )
                diffs.append(f"source {a['name']!r} file {name} {what}")
    return diffs


def appended_files(old: dict, new: dict) -> list[str]:
    """The files appended to a source between two fingerprints of it: the names of the
    new files when the old ones (and the source's stamps and identity) are the first of
    the new, unchanged and in order; else [] (no growth, or a change). A pass in progress
    reads the files it began with, so appended files join at the next pass (order.py)."""
    fa, fb = old.get("files") or [], new.get("files") or []
    if len(fb) <= len(fa) or fb[: len(fa)] != fa:
        return []
    if any(old.get(k) != new.get(k) for k in ("name", "identity")):
        return []
    added = fb[len(fa) :]
    if any(len(f) == 2 for f in added):  # a stamp (revision) appeared: not a pure append
        return []
    return [f[0] for f in added]


def grown_sources(old: dict, new: dict) -> list[str]:
    """'source X: N files appended (a, b, ...)' per source of two data fingerprints that
    grew without any other change."""
    out, before = [], {s["name"]: s for s in old.get("sources") or []}
    for b in new.get("sources") or []:
        a = before.get(b["name"])
        added = appended_files(a, b) if a is not None else []
        if added:
            out.append(f"source {b['name']!r}: {len(added)} file(s) appended ({', '.join(added[:3])}"
                       f"{', ...' if len(added) > 3 else ''})")  # fmt: skip
    return out
