"""CheckpointManager: save and load the whole training state with torch.distributed.checkpoint.

Owns: the save interval and the tiers (``checkpoint.folder``, a local path or an object
store's URL; with ``checkpoint.local_interval``, a local tier saved between its saves,
resumed from when newer and held by every rank), the manifest, and loading the
timeline's resume point into every component. The components come as adapters (``stateful.Adapter``: what each saves,
which entries it expects from a given checkpoint, how it loads), all handled alike:
the manager names none of them. It composes the package's parts: ``lifecycle`` writes
and finalizes, ``timeline`` chooses and keeps, ``integrity`` verifies, ``stateful``
adapts (and, through ``compat``, refuses what does not fit).

One job per folder: rank 0 holds the folder's lease (``lease``) from construction to
``close()``; a second job waits for it, then stops in one line naming the holder. The
loop asks ``check_lease`` after every step: once rank 0's lease lapsed (its heartbeat
could not renew it: ``Lease`` counts it lost before another job may take it over) or was
taken, every rank stops there with the same line, before it saves; the savers ask the
lease before each write that starts, publishes or removes a checkpoint. Cost: one 4-byte
gloo all-reduce per step on the control group (a CPU tensor), rank 0's clock read.

Loading executes nothing from the checkpoint: the project's own entries are tensors
(``entries``), every other non-tensor entry is read with torch's weights-only
unpickler, and a checkpoint of format 2 (pickled loader and RNG entries) is refused.

A start: rank 0 surveys the folder (and any peer folders of the job: fault tolerance's
other replica groups, read only) and plans (O(checkpoints) manifest reads each), every
rank finishes or removes ``.partial`` folders and verifies the chosen checkpoint's
files by shares (O(total / ranks) each), then loads its own shard.

Never: decide what a component's state is, build components, write into a branch's
source (``checkpoint.branch_from``, ``branch.py``: only read), or load initial weights
from another job (``initial_weights.py`` does, when this run has no checkpoint).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan import parallel
from torchtitan.checkpoint import branch, integrity, timeline
from torchtitan.checkpoint.changes import resumable_changes
from torchtitan.checkpoint.entries import DataOnlyLoadPlanner
from torchtitan.checkpoint.folder import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    check_writable,
    partial_steps,
    read_manifest,
    step_folder,
)
from torchtitan.checkpoint.lease import Lease, LeaseLost
from torchtitan.checkpoint.lifecycle import Saver, root_cause
from torchtitan.checkpoint.stateful import Adapter, Saved
from torchtitan.checkpoint.store import join, store_for
from torchtitan.checkpoint.store_reader import StoreReadError

logger = logging.getLogger("torchtitan")


class CheckpointManager:
    """Saves the steps the loop asks for (``should_save``: every ``interval`` steps; the
    loop adds the step where the job stops); loads the timeline's resume point."""

    def __init__(self, cfg, dims, components: dict[str, Adapter], fingerprint: dict):
        """``components``: name -> adapter, in load order (``stateful.training_components``);
        ``fingerprint``: the data this run trains on, recorded in each manifest."""
        ck = cfg.checkpoint
        self.enabled = ck.enable_checkpoint
        self.folder = join(cfg.job.dump_folder, ck.folder)  # or a URL (an object store)
        self.interval = ck.interval
        self.options = timeline.recovery_options(ck.load_step, list(ck.exclude_from_loading))
        self.model_weights_only = ck.model_weights_only
        self.fallback_on_corruption = ck.fallback_on_corruption
        self.dims = dims
        self.fingerprint = fingerprint
        self.config_dict = cfg.to_dict()
        self.states = dict(components)
        self.lease = Lease(self.folder, ck.lease_timeout_seconds, ck.lease_wait_seconds)
        self.saver = Saver(self.folder, dims, ck.async_mode, ck.keep_latest_k, lease=self.lease)
        # The local tier (checkpoint.local_interval): frequent saves to a local folder.
        self.local_interval = ck.local_interval
        self.local_folder = (
            join(cfg.job.dump_folder, ck.local_folder) if ck.local_interval else None
        )
        self.local_saver = None
        if self.local_folder is not None:
            self.local_saver = Saver(self.local_folder, dims, ck.async_mode, ck.keep_latest_k,
                                     shares_stager_of=self.saver, lease=self.lease)  # fmt: skip
        # What this run's checkpoints record of their timeline (set by load()).
        self.timeline = {"generation": 0, "origin": self.options}
        self._verified: tuple[str, dict] | None = None  # (path, manifest) _verify read
        self.loaded_from: str | None = None
        if self.enabled:
            check_writable(self.folder)
            if self.local_folder is not None:
                check_writable(self.local_folder)
            self._take_lease()

    @property
    def savers(self) -> list[Saver]:
        return [self.saver] if self.local_saver is None else [self.saver, self.local_saver]

    @property
    def tiers(self) -> list[tuple[str, Saver]]:
        return [(s.folder, s) for s in self.savers]

    def _take_lease(self):
        """Rank 0 takes the folder's lease (waiting for a live holder); every rank gets
        the same outcome, so a refused job stops on every rank with the same line."""
        problem = None
        if self.dims.is_main:
            try:
                self.lease.acquire()
            except CheckpointError as e:
                problem = str(e)
            except OSError as e:
                problem = f"cannot take the lease on checkpoint folder {self.folder}: {e}"
        try:
            problem = parallel.broadcast_from_main(self.dims, problem)
        except BaseException:
            self.lease.release()  # no manager is returned to release it later
            raise
        if problem:
            raise CheckpointError(problem)

    def check_lease(self):
        """After every step (collective): raise ``LeaseLost`` on every rank, with rank 0's
        one line, once rank 0 may no longer write the folder (``Lease.valid``). Cost: one
        4-byte all-reduce on the control group; the line is sent only then."""
        if not self.enabled:
            return
        if parallel.any_rank(self.dims, self.dims.is_main and not self.lease.valid()):
            problem = self.lease.problem() if self.dims.is_main else None
            # the control group: an async save's finalization may hold the checkpoint one
            raise LeaseLost(parallel.broadcast_from_main(self.dims, problem, control=True))

    # ---- saving ---------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Every ``interval`` steps, and every ``local_interval`` steps to the local tier
        (where the job stops is the loop's to add)."""
        local = self.local_interval and step % self.local_interval == 0
        return self.enabled and (step % self.interval == 0 or bool(local))

    def _saver_for(self, step: int, final: bool) -> Saver:
        """The local tier for its own steps; the main folder for ``interval`` steps, the
        training's last step and any other (a preemption's: the node may not come back)."""
        local = self.local_interval and step % self.local_interval == 0
        if self.local_saver is not None and local and step % self.interval != 0 and not final:
            return self.local_saver
        return self.saver

    def save(self, step: int, *, final: bool = False, model_only: bool = False):
        """Write ``step-N`` (see ``Saver.save`` for what blocks the caller); ``final``: the
        training's last step, saved as weights only under ``checkpoint.model_weights_only``."""
        # The previous save's state_dict views (and the shared staging buffers) must not
        # be reused, and two DCP saves must not share the checkpoint group at once: wait
        # for any tier's (and say so, once, when that makes the loop wait).
        for saver in self.savers:
            saver.wait_for_previous(step)
        # Rank 0's lease, after the waits (the checkpoint group is free): a lapsed one is
        # every rank's LeaseLost here, not rank 0's alone with the others in the save.
        parallel.on_main(self.dims, self.lease.check)
        weights_only = model_only or (self.model_weights_only and final)
        names = [n for n, s in self.states.items() if s.weights or not weights_only]
        state = {name: self.states[name].state_dict() for name in names}
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "contents": names,
            "world_size": self.dims.world_size,
            "torch_version": torch.__version__,
            "config": self.config_dict,
            "data_fingerprint": self.fingerprint,
            "timeline": self.timeline,
        }
        self._saver_for(step, final or model_only).save(step, state, manifest)

    def wait_for_staging(self):
        for saver in self.savers:
            saver.wait_for_staging()

    def wait(self):
        for saver in self.savers:
            saver.wait()

    def close(self):
        """Finish the pending save, then release the folder's lease (idempotent)."""
        try:
            for saver in reversed(self.savers):  # the main saver owns the shared stager
                saver.close()
        finally:
            self.lease.release()

    def release_lease(self):
        """Release the folder's lease without waiting for a save (a job that failed): now,
        or, while an async save is still being written, when it ends, so that the next
        job never tidies ``.partial`` folders under a write in flight."""
        # Saves never overlap (save() waits for every tier's): at most one is pending.
        writing = [saver for saver in self.savers if saver.writing]
        (writing[0] if writing else self.saver).after_write(self.lease.release)

    # ---- loading --------------------------------------------------------------------
    def load(self, peers: list[str] | tuple = ()) -> list[str]:
        """Load the timeline's resume point into every component; the names of those
        loaded (none without a checkpoint). A run whose train state is not among them
        (a seed or weights-only checkpoint, or it was excluded) counts from step 0.
        ``peers``: the checkpoint folders of the same job's other writers (fault
        tolerance: the other replica groups'), read only: the job's newest checkpoint is
        resumed from wherever it is (``timeline.resume_order``); nothing in a peer's
        folder is finished, set aside or removed (its own group does that). With none
        anywhere, ``checkpoint.branch_from``'s source, read only (``_branch_source``).
        Cost: rank 0 reads O(checkpoints) manifests in each peer folder too."""
        if not self.enabled:
            return []
        for folder, saver in self.tiers:  # listed by rank 0 alone: O(1) requests a start
            for step in parallel.on_main(self.dims, partial_steps, folder):
                saver.finish_partial(step)
        path, exclude = self._choose(list(peers))
        if path is None:  # nothing of this run's own: a branch starts from its source
            path, exclude = self._branch_source()
        if path is None:
            logger.info("no checkpoint in %s: starting from scratch",
                        " or ".join([folder for folder, _ in self.tiers] + list(peers)))  # fmt: skip
            return []
        begin = time.perf_counter()
        loaded = self._load_from(path, exclude)
        self.loaded_from = path
        logger.info(
            "loaded checkpoint %s (%s) in %.2fs",
            path,
            ", ".join(loaded),
            time.perf_counter() - begin,
        )
        return loaded

    # ---- a branch's source (checkpoint.branch_from; branch.py): read, never written ----
    def _branch_source(self) -> tuple[str | None, list[str]]:
        """The source checkpoint of a branch whose own tiers hold none, checked (rank 0)
        and verified (every rank a share), and the components not to load
        (``checkpoint.exclude_from_loading``); (None, []) without ``branch_from``. Nothing
        is written, finished, set aside or leased there. Collective. Cost: one manifest
        read on rank 0, O(checkpoint / ranks) verified by each rank."""
        path = self.config_dict["checkpoint"]["branch_from"]
        if not path:
            return None, []
        parallel.on_main(self.dims, branch.check_source, path)
        problem = self._verify(path)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint.branch_from {path} is damaged: {problem}; branch from another "
                "step of the source run"
            )
        logger.info("no checkpoint of this run yet: branching from %s (read only); this run's "
                    "checkpoints go to %s", path, self.folder)  # fmt: skip
        return path, list(self.options["exclude_from_loading"]) if self.options else []

    def rewind(self, latest: int, earliest: int = 0) -> int | None:
        """Load, in this process, the newest complete checkpoint of a step in
        ``[earliest, latest]`` into every component (a loss spike's rewind); its step, or
        None where there is none (nothing is loaded then). Both tiers are looked at, a tie
        going to the local one where every rank holds its files; checkpoints after it, in
        either tier, belong to the abandoned stretch and are set aside (``.abandoned``),
        so a requeue resumes on the rewound timeline. Collective.

        Cost: a pending async save waited for; rank 0 reads O(checkpoints) manifests; every
        rank verifies a share of the chosen checkpoint (O(total / ranks)) and loads its
        own shard, as a start does."""
        self.wait()

        def survey() -> list:
            found = []
            for i, (folder, _) in enumerate(self.tiers):
                entries = timeline.survey(folder)
                steps = [e.step for e in entries if e.full and earliest <= e.step <= latest]
                if steps:  # (step, tier): the newest, a tie to the local tier (listed last)
                    found.append((max(steps), i, folder))
            return found

        # rank 0 lists; a store's fault on the way is every rank's one line, at once
        found = sorted(parallel.on_main(self.dims, survey), reverse=True)
        if found and found[0][1] == 1:  # the local tier: only where every rank holds it
            path = step_folder(found[0][2], found[0][0])
            holds = store_for(path).isfile(join(path, MANIFEST))
            if parallel.any_rank(self.dims, not (holds and integrity.dcp_data_complete(path))):
                found = [f for f in found if f[1] != 1]
        if not found:
            return None
        step, _, folder = found[0]
        path = step_folder(folder, step)
        problem = self._verify(path)
        if problem is not None:
            raise CheckpointError(f"rewinding: checkpoint {path} is damaged: {problem}")

        def set_aside():
            self.lease.check()  # setting aside writes the folder
            for tier, _ in self.tiers:
                entries = timeline.survey(tier)
                later = [e for e in entries if e.step > step]
                if later:
                    timeline.set_aside_after(tier, [*later, timeline.Entry(step, -1)], step)

        parallel.on_main(self.dims, set_aside)  # a lapsed lease: every rank's line at once
        self._load_from(path, [])
        self.loaded_from = path
        return step

    def resume_point(self, peers: list[str] | tuple = ()) -> tuple[int, str] | None:
        """Rank 0: the (step, folder) a start would resume from now, over this run's main
        folder and ``peers`` (``timeline.resume_order``'s first, with this command's
        options), unverified; None where there is none. Not the local tier: a start
        takes it only where every rank holds its files, which one rank cannot tell.
        Cost: O(checkpoints) manifest reads per folder (O(groups x kept checkpoints)
        small files under fault tolerance, whatever the data)."""
        plans = [(self.folder, *self._plan(self.folder))]
        plans += [(peer, *self._plan(peer)) for peer in peers]
        order = timeline.resume_order(plans[0], plans[1:])
        return order[0] if order else None

    def _plan(self, folder: str) -> tuple[list, timeline.Plan]:
        """Rank 0: a tier's checkpoints and what to resume from among them."""
        survey = timeline.survey(folder)
        return survey, timeline.plan_resume(survey, self.options, self.fingerprint)

    def _choose(self, peers: list[str]) -> tuple[str | None, list[str]]:
        """Rank 0 plans (timeline.plan_resume) in each tier, the newer tier wins (the local
        one only where every rank holds its files), then in each peer folder, the newest
        (generation, step) wins (``timeline.resume_order``); every rank verifies; rank 0 sets newer
        checkpoints of the chosen tier aside (never a peer's). Returns the path to load
        and the components not to load."""

        def plan_all() -> list:
            plans = [(folder, *self._plan(folder)) for folder, _ in self.tiers]
            return plans + [(peer, *self._plan(peer)) for peer in peers]

        plans = parallel.on_main(self.dims, plan_all)  # a store's fault: one line everywhere
        plans, peer_plans = plans[: len(self.tiers)], plans[len(self.tiers) :]
        folder, survey, plan = plans[0]
        if len(plans) > 1 and self._local_tier_wins(plans[0], plans[1]):
            folder, survey, plan = plans[1]
        order = timeline.resume_order((folder, survey, plan), peer_plans)
        if self.dims.is_main:
            for note in plan.notes:
                logger.info("%s", note)
        if plan.problem and not order:
            raise CheckpointError(plan.problem)
        chosen = None
        for i, (step, where) in enumerate(order):
            path = step_folder(where, step)
            problem = self._verify(path)
            if problem is None:
                chosen = step
                break
            others = order[i + 1 :]  # older ones, and copies of this step in peer folders
            if not self.fallback_on_corruption or not others:
                older = [s for s, _ in others if s < step]
                if older:
                    fix = (f"resume from the previous one with --checkpoint.load_step "
                           f"{older[0]}, or set --checkpoint.fallback_on_corruption to do "
                           "that automatically")  # fmt: skip
                elif others:  # a copy of this step, or a peer's of an older generation
                    fix = (f"set --checkpoint.fallback_on_corruption to resume from "
                           f"step-{others[0][0]} in {others[0][1]}")  # fmt: skip
                else:
                    fix = "there is no older checkpoint: delete it to start from scratch"
                raise CheckpointError(f"checkpoint {path} is damaged: {problem}; {fix}")
            logger.warning(
                "CHECKPOINT %s IS DAMAGED (%s): falling back to an older one", path, problem
            )
        if chosen is not None and where != folder:  # a peer's: its timeline continues here
            _, survey, plan = next(p for p in peer_plans if p[0] == where)
            others = [e for f, entries, _ in plans + peer_plans if f != where for e in entries]
            generation, origin = timeline.generation_for(others + survey, plan, chosen)
            self.timeline = {"generation": generation, "origin": origin}
            logger.info("the job's newest checkpoint is a peer's: step-%d in %s", chosen, where)
            return step_folder(where, chosen), plan.exclude
        # A new generation is newer than any tier's and any peer's (the chosen tier's
        # entries last: they name the chosen step), so that the branch outranks a peer
        # folder's abandoned steps at the next start (timeline.resume_order).
        others = [e for f, entries, _ in plans + peer_plans if f != folder for e in entries]
        generation, origin = timeline.generation_for(others + survey, plan, chosen)
        self.timeline = {"generation": generation, "origin": origin}
        if chosen is None:
            return None, []

        def set_aside():
            self.lease.check()
            timeline.set_aside_after(folder, survey, chosen)
            if plan.branch and self.options:
                logger.info(
                    "%s: a new timeline (generation %d) begins at step-%d; relaunching this "
                    "command continues it",
                    timeline.describe(self.options), generation, chosen,
                )  # fmt: skip

        parallel.on_main(self.dims, set_aside)  # a lapsed lease: every rank's line at once
        return step_folder(folder, chosen), plan.exclude

    def _local_tier_wins(self, main: tuple, local: tuple) -> bool:
        """Whether to resume from the local tier: its resume point is at least as new as
        the main folder's (a tie goes to the faster read), or only it has one, and every
        rank holds the files of that checkpoint. Collective (the same answer everywhere).

        "Holds": the manifest, DCP's ``.metadata`` and every byte range it names, checked
        by each rank on its own view of the local folder (O(files) stats per rank), then
        one all-reduce: a node-local folder that lacks another node's shards, or a wiped
        one, is not resumed from on any rank.
        """
        (_, main_survey, main_plan), (folder, local_survey, local_plan) = main, local
        if local_plan.problem or not local_plan.candidates:
            return False
        if not main_plan.problem and main_plan.candidates:
            order = {e.step: e.order for e in main_survey}[main_plan.candidates[0]]
            if {e.step: e.order for e in local_survey}[local_plan.candidates[0]] < order:
                return False
        path = step_folder(folder, local_plan.candidates[0])
        holds = store_for(path).isfile(join(path, MANIFEST)) and integrity.dcp_data_complete(path)
        missing = not holds
        if parallel.any_rank(self.dims, missing):
            logger.warning("not resuming from %s: not every rank holds its files there; "
                           "taking the newest in %s", path, main[0])  # fmt: skip
            return False
        return True

    def _verify(self, path: str) -> str | None:
        """Every rank checks a share of the files (O(total / ranks)); all get the first
        problem. The manifest is read by rank 0 alone and sent to the others (kept for
        ``_load_from``): every rank read it, two requests each on a store, 2,000 on one
        object at 1,000 ranks."""
        manifest, problem = parallel.on_main(self.dims, integrity.manifest_or_problem, path)
        if problem is not None:
            return problem
        self._verified = (path, manifest)
        mine = integrity.verify_share(path, self.dims.rank, self.dims.world_size, manifest)
        problems = [p for p in parallel.all_gather_objects(self.dims, mine) if p is not None]
        return problems[0] if problems else None

    def _load_from(self, path: str, exclude: list[str]) -> list[str]:
        """Load ``path`` into the components not in ``exclude``; their names. Collective.
        Cost: the manifest is the one ``_verify`` had rank 0 read and send (else rank 0
        reads and sends it: O(files) bytes); every rank reads DCP's ``.metadata`` and its
        own shard."""
        verified, self._verified = self._verified, None
        if verified is not None and verified[0] == path:
            manifest = verified[1]
        else:
            manifest = parallel.on_main(self.dims, read_manifest, path)
        problem = integrity.format_problem(path, manifest)
        if problem:
            raise CheckpointError(
                f"checkpoint {path} {problem}; resume it with the version that wrote it, or "
                f"start from its weights with --checkpoint.initial_load_path {path}"
            )
        reader = store_for(path).reader(path, manifest)  # also DCP's, below: one metadata read
        metadata = reader.read_metadata().state_dict_metadata
        saved: dict[str, Saved] = {}
        for key, md in metadata.items():
            name, entry = key.split(".", 1)
            saved.setdefault(name, Saved(path, manifest)).entries[entry] = md
        mine = [n for n in self.states if n in saved]
        pickled = [f"{n}.{k}" for n in mine if self.states[n].data_only
                   for k, md in saved[n].entries.items() if not isinstance(md, TensorStorageMetadata)]  # fmt: skip
        if pickled:
            raise CheckpointError(
                f"checkpoint {path}: entry {pickled[0]} is a pickle, not a tensor; this version "
                "writes its own entries as data and never unpickles them: restore the folder "
                "from a trusted copy"
            )
        names = [n for n in mine if n not in exclude]
        skipped = [n for n in mine if n in exclude]
        if skipped:
            logger.info("not loading %s (checkpoint.exclude_from_loading)", ", ".join(skipped))
        for name in skipped:
            self.states[name].not_loaded(saved[name])
        if any(self.states[n].resumes for n in names):
            self._log_config_changes(manifest.get("config") or {}, path)
        state = {}
        for name in names:
            targets = self.states[name].load_targets(saved[name])
            if targets is not None:
                state[name] = targets
        try:
            dcp.load(state, checkpoint_id=path, storage_reader=reader,
                     process_group=self.dims.cpu_group, planner=DataOnlyLoadPlanner(),
                     no_dist=not dist.is_initialized())  # fmt: skip
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line, every rank
            refused = [f[0] for f in getattr(e, "failures", {}).values()
                       if isinstance(f[0], (CheckpointError, StoreReadError))]  # fmt: skip
            # a planted pickle (entries.DataOnlyLoadPlanner): nothing ran; or the store
            # refused a read (a replaced file, a fault that persisted)
            if refused:
                raise CheckpointError(f"checkpoint {path}: {refused[0]}") from None
            raise CheckpointError(
                f"checkpoint {path} could not be loaded into this run: {root_cause(e)}; "
                "resume with the settings of the run that wrote it, or leave the component "
                "out with --checkpoint.exclude_from_loading"
            ) from e
        for name, value in state.items():
            self.states[name].load_state_dict(value)
        return list(state)

    def _log_config_changes(self, saved: dict, path: str):
        changes = resumable_changes(saved, self.config_dict)
        if changes:
            logger.info("config changed since %s, the config wins: %s", path, "; ".join(changes))
