"""What changed between a checkpoint and this run's config.

Owns: turning two nested config dicts into readable 'key: old -> new' lines (the data
fingerprint's diffs are the data's: ``torchtitan.data.fingerprint``). Never: decide
what a change means (the manager does).
"""

from __future__ import annotations


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Each differing leaf of two nested config dicts, as 'section.key: old -> new'."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_diff(a, b, name + ".")
        elif a != b:
            diffs.append(f"{name}: {a!r} -> {b!r}")
    return diffs


# Config settings a resume may change (the config wins); the log lists what did change.
RESUMABLE = (
    "optimizer",
    "lr_scheduler",
    "training.steps",
    "training.stop_at_step",
    "training.mix_schedule",
)


def resumable_changes(old: dict, new: dict) -> list[str]:
    """The differences between two configs in settings a resume may change."""

    def resumable(diff: str) -> bool:
        key = diff.split(":")[0]
        return key in RESUMABLE or key.split(".")[0] in RESUMABLE

    return [d for d in config_diff(old, new) if resumable(d)]
