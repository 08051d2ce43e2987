"""The timeline: which checkpoint a start resumes from, and which ones the folder keeps.

Checkpoints are ordered by (generation, step), not by step alone. A run whose command
carries a recovery option (``checkpoint.load_step``, ``checkpoint.exclude_from_loading``)
begins a *branch*: a new generation, whose origin (those options) every checkpoint of
the branch records in its manifest. A later start with the same options finds the
branch and continues it from its newest checkpoint instead of applying the options
again, so a scheduler may requeue the command that began a branch as often as it likes:
``load_step N`` rewinds once, ``exclude_from_loading dataloader`` restarts the data
once. (A data restart whose data changed again since the branch began is a new restart.)
Because the order is by generation first, a branch that restarts the step count
(``train_state`` excluded) is still the newest timeline, and ``keep_latest_k`` never
removes the checkpoint it has just written.

Checkpoints after the resume point belong to an abandoned timeline: they are renamed
``step-N.abandoned`` (never deleted, never resumed, never purged).

A run started from another run's checkpoint (``checkpoint.branch_from``, ``branch.py``)
is not such a branch: the other run's folder is never surveyed, planned or set aside
here; the new run's timeline begins in its own folder, and its own checkpoints,
once it has one, are what its starts resume.

Every function here runs on rank 0 and reads small manifests only: O(checkpoints)
per start or save, independent of their size. The manager broadcasts the decisions.

Never: read tensors, write checkpoints, or use a process group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torchtitan.checkpoint.folder import (
    complete_steps,
    fsync_dir,
    holds_training_state,
    read_manifest,
    remove_checkpoint,
    set_aside,
    step_folder,
)
from torchtitan.checkpoint.store import store_for

logger = logging.getLogger("torchtitan")


@dataclass(frozen=True)
class Entry:
    """One complete checkpoint as the timeline sees it."""

    step: int
    generation: int = 0
    origin: dict | None = None  # the recovery options its branch began with
    full: bool = True  # holds a training state (not weights-only, not a seed)
    fingerprint: dict = field(default_factory=dict)

    @property
    def order(self) -> tuple[int, int]:
        return self.generation, self.step


def survey(folder: str) -> list[Entry]:
    """Every complete checkpoint, oldest first. Cost: one small manifest read each."""
    entries = []
    for step in complete_steps(folder):
        try:
            manifest = read_manifest(step_folder(folder, step))
        except (OSError, ValueError):
            manifest = {}  # a damaged manifest: verification names it if it is chosen
        timeline = manifest.get("timeline") or {}
        entries.append(
            Entry(
                step,
                int(timeline.get("generation", 0)),
                timeline.get("origin"),
                holds_training_state(manifest),
                manifest.get("data_fingerprint") or {},
            )
        )
    return sorted(entries, key=lambda e: e.order)


def recovery_options(load_step: int, exclude: list[str]) -> dict | None:
    """The command's recovery options as a branch records them; None when it has none."""
    if load_step < 0 and not exclude:
        return None
    return {"load_step": load_step, "exclude_from_loading": sorted(set(exclude))}


def describe(options: dict) -> str:
    parts = []
    if options["load_step"] >= 0:
        parts.append(f"--checkpoint.load_step {options['load_step']}")
    if options["exclude_from_loading"]:
        parts.append(
            "--checkpoint.exclude_from_loading " + ",".join(options["exclude_from_loading"])
        )
    return " ".join(parts)


@dataclass
class Plan:
    """Rank 0's decision, broadcast to every rank."""

    candidates: list[int]  # steps to try, newest first (the next is the fallback)
    exclude: list[str]  # components not to load from the chosen one
    branch: bool  # the options are applied now: this run begins a new generation
    options: dict | None = None  # the command's recovery options
    problem: str | None = None
    notes: list[str] = field(default_factory=list)  # rank 0 logs them


def plan_resume(entries: list[Entry], options: dict | None, fingerprint: dict) -> Plan:
    """What to resume from, given the command's recovery options.

    A branch that these options began already (a requeue of its command) is continued
    from its newest checkpoint, loading everything. Otherwise the options apply:
    ``load_step`` picks its step (older ones as fallback), else the newest checkpoint
    holding a training state (weights-only and seed checkpoints only while no full one
    exists).
    """
    if options is not None:
        restarts_data = "dataloader" in options["exclude_from_loading"]
        branch = [
            e for e in entries
            if e.full and e.origin == options and (not restarts_data or e.fingerprint == fingerprint)
        ]  # fmt: skip
        if branch:
            note = (
                f"continuing the timeline that {describe(options)} began (its newest "
                f"checkpoint is step-{branch[-1].step}): the option is not applied again"
            )
            return Plan([e.step for e in reversed(branch)], [], False, options, notes=[note])
    exclude = options["exclude_from_loading"] if options else []
    branch = options is not None
    load_step = options["load_step"] if options else -1
    if load_step >= 0:
        steps = [e.step for e in entries]
        if load_step not in steps:
            return Plan([], exclude, branch, options, problem=(
                f"checkpoint.load_step={load_step}: no complete checkpoint step-{load_step} in "
                f"the checkpoint folder; complete steps: {sorted(steps) or 'none'}"
            ))  # fmt: skip
        upto = entries[: steps.index(load_step) + 1]
        return Plan([e.step for e in reversed(upto)], exclude, branch, options)
    full = [e for e in entries if e.full]
    if not full:
        return Plan([e.step for e in reversed(entries)], exclude, branch, options)
    notes = [
        f"not resuming from step-{e.step}: it holds model weights only"
        for e in entries
        if not e.full and e.order > full[-1].order
    ]
    return Plan([e.step for e in reversed(full)], exclude, branch, options, notes=notes)


def resume_order(own: tuple[str, list[Entry], Plan],
                 peers: list[tuple[str, list[Entry], Plan]]) -> list[tuple[int, str]]:  # fmt: skip
    """The (step, folder) to try, newest first by (generation, step), over this job's own
    folder and its peers' (fault tolerance: the other replica groups' folders, read-only,
    each given as (folder, its ``survey``, its plan)): the job's newest checkpoint
    wherever it is, this folder's first at a tie (no read of another's then), and the
    next ones as the fallback. By generation first, as in one folder: a group left out
    of a branch (``load_step`` on fewer groups) keeps the abandoned timeline's newer
    steps in its folder, and a later start of the whole job resumes the branch, not
    them. A checkpoint holding a training state comes before a weights-only or seed one
    of any folder, as ``plan_resume`` has it within one. A folder whose plan has a problem
    (a ``load_step`` it does not hold) offers nothing. O(candidates log candidates)."""
    found = []
    for folder, entries, plan in [own, *peers]:
        if not plan.problem:
            by_step = {e.step: e for e in entries}
            found += [((by_step[step].full, *by_step[step].order), folder)
                      for step in plan.candidates]  # fmt: skip
    found.sort(key=lambda c: c[0], reverse=True)  # stable: own first among equals
    return [(order[2], folder) for order, folder in found]


def generation_for(entries: list[Entry], plan: Plan, chosen: int | None) -> tuple[int, dict | None]:
    """(generation, origin) that this run's checkpoints record.

    A continued timeline keeps the chosen checkpoint's; a branch (or a fresh start with
    options, so that its requeue continues it) takes the next generation.
    """
    by_step = {e.step: e for e in entries}
    if chosen is not None and not plan.branch:
        return by_step[chosen].generation, by_step[chosen].origin
    newest = max((e.generation for e in entries), default=-1)
    return newest + 1, plan.options


def set_aside_after(folder: str, entries: list[Entry], chosen: int) -> list[str]:
    """Rank 0: checkpoints after the resume point belong to an abandoned timeline."""
    position = {e.step: e for e in entries}[chosen].order
    moved = []
    for entry in entries:
        if entry.order > position:
            src = step_folder(folder, entry.step)
            dst = set_aside(src)
            moved.append(dst)
            logger.warning(
                "moved %s aside to %s: it is newer than the resume point step-%d, so it "
                "belongs to an abandoned timeline (never resumed, never purged)",
                src, dst, chosen,
            )  # fmt: skip
    if moved:
        fsync_dir(folder)
    return moved


def purge(folder: str, keep_latest_k: int) -> list[int]:
    """Rank 0: remove all but the newest ``keep_latest_k`` full checkpoints, newest by
    timeline order (weights-only and seed checkpoints are outputs, never purged)."""
    if keep_latest_k <= 0:
        return []
    full = [e for e in survey(folder) if e.full]
    removed = []
    for entry in full[:-keep_latest_k]:
        remove_checkpoint(step_folder(folder, entry.step))
        removed.append(entry.step)
        logger.info("removed old checkpoint step-%d (keep_latest_k=%d)", entry.step, keep_latest_k)
    return removed


def make_room(folder: str, step: int):
    """Rank 0, before publishing ``step-N``: an older timeline's ``step-N`` is set aside."""
    final = step_folder(folder, step)
    if store_for(folder).isdir(final):
        dst = set_aside(final)
        logger.warning(
            "moved %s aside to %s: an older timeline's checkpoint of the step being saved",
            final, dst,
        )  # fmt: skip
