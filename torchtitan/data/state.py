"""The loader's checkpoint entry: how the data position is stored, who writes it, and
whether a saved one belongs to this run's data.

Owns: the entry's key (``dp_rank_<d>``, one per data-parallel rank) and format (UTF-8
JSON in a 1-D ``uint8`` tensor, which DCP stores and reads as a tensor: a checkpoint
holds data, never a pickle); which rank writes it (the first of its TP peers and
pipeline stages: they build the same loader and consume the same batches, so one
writer per data-parallel rank keeps one entry each without leaning on DCP's merging of
equal keys); which entry a rank loads (its own, else the first: every entry holds the
same global position, whatever layout wrote it); whether a saved position belongs
to this run's data: where the checkpoint's data fingerprint differs from this run's
(a file of a source changed), the load is refused in one line, unless
``checkpoint.accept_data_change`` keeps the position anyway; and how a saved position
meets a changed mix, the config winning (``restore_cursors``): sources are keyed by
name, a source added begins its pass 0, a source that left the list keeps its cursor
in the entry (``retired``) to continue where it stopped if it comes back, and each
change (weights, a source added, left or back) is one line naming the step.

``LoaderState`` is what the checkpoint's adapter (``checkpoint.stateful``) wraps: it
hands over what to save and checks what it is given, and the adapter only moves tensors
between it and DCP. The loader (loader.py) builds its entry from its position and reads
it back.

Cost: O(sources, retired ones included) to encode or decode an entry; O(files) to compare two fingerprints,
once per load.

Never: import the checkpoint package, read or write checkpoint files, or choose a
checkpoint.
"""

from __future__ import annotations

import logging

from torchtitan.data.fingerprint import fingerprint_diff, grown_sources
from torchtitan.data.order import Cursor
from torchtitan.data.spec import DataError
from torchtitan.io import tensor_json

logger = logging.getLogger("torchtitan")

KEY_PREFIX = "dp_rank_"
# 5: the global order's position (windows, a cursor of lanes per source); the keys
# ``retired`` (cursors of sources not in the list, by name), ``weights`` (the mix of
# the next step), ``skips`` (data passed over: [first step, steps, first window, end
# window], -1 for windows not reached yet) and ``skip_windows`` ([first window, windows])
# came later, and an entry without them has none.
STATE_VERSION = 5


def entry_key(dp_rank: int) -> str:
    return f"{KEY_PREFIX}{dp_rank}"


to_tensor = tensor_json.to_tensor


def from_tensor(value) -> dict:
    """The entry ``to_tensor`` encoded; anything but a uint8 tensor is refused."""
    if not tensor_json.is_encoded(value):
        raise DataError(
            f"a checkpoint entry is {type(value).__name__}, not JSON in a uint8 tensor: it was "
            "written by an older version (pickled); resume it with the version that wrote it"
        )
    return tensor_json.from_tensor(value)


def entry_to_load(saved: list[str], dp_rank: int) -> str:
    """The one entry of ``saved`` (the checkpoint's loader keys) a rank reads: its own,
    else the first (all hold the same position). O(1) per rank, whatever the old layout."""
    mine = entry_key(dp_rank)
    if mine in saved:
        return mine
    entries = sorted(k for k in saved if k.startswith(KEY_PREFIX))
    if not entries:
        raise DataError("the checkpoint holds no dataloader entry (dp_rank_<r>)")
    return entries[0]


def saved_entry(state_dict: dict) -> dict:
    """The loader entry of a loaded ``state_dict`` (the first, if several), decoded and of
    this version's format. Raises DataError naming what to do otherwise."""
    entries = [v for k, v in sorted(state_dict.items()) if k.startswith(KEY_PREFIX)]
    if not entries:
        raise DataError("the checkpoint holds no dataloader entry (dp_rank_<r>)")
    entry = from_tensor(entries[0])
    if entry.get("version") != STATE_VERSION:
        raise DataError(
            f"the checkpoint's dataloader state has format {entry.get('version')}, this "
            f"version reads {STATE_VERSION}; resume with the version that wrote it, or pass "
            "--checkpoint.exclude_from_loading dataloader to restart the data"
        )
    return entry


def restore_cursors(entry: dict, names: list[str],
                    weights: list[float]) -> tuple[list[Cursor], dict, list[str]]:  # fmt: skip
    """The saved ``entry``'s position over this run's sources ``names``, whose weights at
    the entry's step are ``weights``: a cursor per source (its saved one, by name; the
    one it had when it left the list; or a fresh one, pass 0, for a source new to the
    run), the cursors of saved sources this run does not hold (kept, by name), and one
    line per change of the mix, the config winning. Cost: O(sources)."""
    active = dict(zip(entry["sources"], entry["cursors"]))
    retired = {k: v for k, v in (entry.get("retired") or {}).items() if k not in active}
    cursors, lines = [], []
    for name in names:
        if name in active:
            cursors.append(Cursor.from_list(active[name]))
        elif name in retired:
            cursor = Cursor.from_list(retired[name])
            cursors.append(cursor)
            lines.append(f"source {name!r} is back: it continues its pass {cursor.pass_} "
                         f"where it stopped ({cursor.tokens} tokens read before)")  # fmt: skip
        else:
            cursors.append(Cursor())
            lines.append(f"source {name!r} joins the mix: it begins its pass 0")
    kept = {k: list(v) for k, v in retired.items() if k not in names}
    for name in entry["sources"]:
        if name not in names:
            kept[name] = list(active[name])
            lines.append(
                f"source {name!r} left training.datasets: its cursor (pass "
                f"{Cursor.from_list(active[name]).pass_}) stays in the checkpoint, and it "
                "continues there if it comes back"
            )
    old = entry.get("weights")
    new = dict(zip(names, _normal(weights)))
    if old is not None:
        old = dict(zip(old, _normal(list(old.values()))))
        if any(old.get(n, 0.0) != w for n, w in new.items()) or set(old) - set(new):
            out = [n for n, w in new.items() if w == 0 and old.get(n, 0.0) > 0]
            lines.append(
                f"source weights {_shown(old)} -> {_shown(new)}"
                + (f" ({', '.join(map(repr, out))} retired: weight 0)" if out else "")
                + "; the config wins"
            )
    return cursors, kept, lines


def _normal(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else list(weights)


def _shown(weights: dict) -> str:
    return "{" + ", ".join(f"{n}: {w:.4g}" for n, w in weights.items()) + "}"


class LoaderState:
    """A loader's checkpoint entry as this rank saves and loads it: written only where
    ``writes`` (``writes_entry``), loaded only into the data it is a position in
    (``fingerprint``, this run's), unless ``accept_data_change``."""

    def __init__(self, loader, writes: bool, fingerprint: dict, accept_data_change: bool):
        self.loader, self.writes = loader, writes
        self.fingerprint, self.accept_data_change = fingerprint, accept_data_change

    def state_dict(self) -> dict:
        return self.loader.state_dict() if self.writes else {}

    def entry_to_load(self, saved: list[str], saved_fingerprint: dict, where: str) -> str:
        """The key of the one entry this rank loads from the checkpoint at ``where``, whose
        loader keys are ``saved`` and data fingerprint ``saved_fingerprint``; refused in
        one line where the data differs (and not accepted)."""
        diffs = fingerprint_diff(saved_fingerprint, self.fingerprint)
        if diffs and not self.accept_data_change:
            raise DataError(
                f"the data stream differs from checkpoint {where}: {'; '.join(diffs)}. "
                "Resume with the original data settings, or pass "
                "--checkpoint.accept_data_change (keep the data positions) or "
                "--checkpoint.exclude_from_loading dataloader (restart the data)"
            )
        if diffs:
            logger.warning(
                "data changed since %s (%s); checkpoint.accept_data_change: the saved data "
                "positions are applied to the new data as they are",
                where, "; ".join(diffs),
            )  # fmt: skip
        grown = grown_sources(saved_fingerprint, self.fingerprint)
        if grown:
            logger.info(
                "the corpus grew since %s: %s; the pass in progress reads on the files it began "
                "with, the new ones join the next pass", where, "; ".join(grown),
            )  # fmt: skip
        return self.loader.entry_to_load(saved)

    def not_loaded(self, saved_fingerprint: dict, where: str):
        """The checkpoint at ``where`` holds a position the user chose not to load."""
        diffs = fingerprint_diff(saved_fingerprint, self.fingerprint)
        if diffs:
            logger.warning(
                "data changed since %s, data state not loaded: %s", where, "; ".join(diffs)
            )

    def load_state_dict(self, state_dict: dict):
        self.loader.load_state_dict(state_dict)


def writes_entry(dims) -> bool:
    """Whether this rank writes its loader's entry: the first of its TP peers and pipeline
    stages, one writer per data-parallel rank."""
    return dims.tp_rank == 0 and dims.pp_rank == 0
