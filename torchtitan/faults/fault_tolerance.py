"""Live fault tolerance: replica groups as the outer data-parallel dimension (torchft).

Owns: the ``[fault_tolerance]`` section's own rules (``check_config``: torchft present,
the layouts it fits), this replica group's place in the job (``ReplicaGroup``): the
per-step quorum through torchft's ``Manager`` and lighthouse (reached within
``quorum_timeout_seconds`` at the start, or one line; given up by a group asked to stop
whose peers are gone, ``StoppedWaiting``), the cross-group all-reduce of
the gradients (and of the loss, for the log, and of the group's stop vote), the commit
vote, healing a joining group from a live peer (``peer_state``, ``load_peer_state``),
and the checkpoint manager that writes only in the lowest group (a group that becomes the
lowest writes at once where the job lacks its last due checkpoint) and resumes every group
from the job's newest checkpoint, in whichever group's folder (``LowestGroupSaves``,
``group_folders``), and the marker of a finished job that stops a group started after
it (``job_finished``, ``ReplicaGroup.finish``).
The decisions it acts on (the split, the rewind of an uncommitted step, who saves, the
default batch, who stops) are replica_steps.py's, free of torchft.

Layout: each replica group is its own torchrun job (FSDP or DDP over its ranks, as
without fault tolerance); torchft's process group joins the same group rank of every
live group. Tensor parallelism inside a group works alike (group rank ``r``'s shards are
the same slices in every group, so the all-reduce and a heal go rank to rank; every
rank heals its own loader). Pipeline parallelism and HSDP inside a group are refused.

Exactly once: the global order is a function of the window index alone (data/order.py),
so committed step ``s`` reads the windows an uninterrupted run's step ``s`` reads,
whoever is alive: the loader reads as data-parallel rank ``participant x group ranks +
dp_rank`` of ``participants x group ranks`` (``split_loader``), and the loss weights it
sets (ranks x sequences / global batch) make the gradient, averaged by FSDP over the
group and by torchft over the participants, the global batch's mean. A step that is not
committed rewinds the loader to where the step began: the position a peer or a
checkpoint reads is always that of the last committed step.

Healing: a group that joins (or rejoins) behind the quorum's step receives the model,
optimizer, LR schedule, train state and loader position of a live peer's same group
rank through torchft's checkpoint transport (HTTP), not from disk. The position is
global, so nothing per group is needed. What is per group: the RNG streams (dropout),
seeded from (seed, replica id, data-parallel rank) at the start and, in a healed group,
from those and the step it healed at; they are not sent.

Cost per step: one quorum round trip to the lighthouse and one vote inside the group,
one all-reduce of the gradients' local shards (one flat buffer) across the groups;
healing: one transfer of the group rank's shard of the training state. Per start, on a
group's rank 0: one listing of the job's folder, O(groups) marker reads, and the
manifests of every group's checkpoint folder (O(groups x kept checkpoints) small files,
whatever the data: c4 or FineWeb alike).

Never: choose windows (data/order.py), decide what a checkpoint holds (checkpoint/),
or train (step.py); the loop calls ``next_step`` and the step calls ``commit``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torchtitan import parallel
from torchtitan.checkpoint.folder import complete_steps
from torchtitan.checkpoint.store import is_url, store_for
from torchtitan.checkpoint.store import join as checkpoint_join
from torchtitan.config import ConfigError
from torchtitan.faults.replica_steps import (
    StepTry,
    default_schedule,
    leaving_groups,
    saves,
    split_loader,
    stop_vote,
    stops_after_step,
)
from torchtitan.io import storage
from torchtitan.records.metrics import truncate_jsonl_after

logger = logging.getLogger("torchtitan")

# What a joining group receives from a peer, by checkpoint component (stateful.py); the
# spike check's window too (spikes.py), or a joined group would judge a step otherwise
# than the others and apply an update they drop.
HEALED = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "spikes")

# A group's dump folder in the job's: <job folder>/replica_<i> (scripts/ft_launch.py).
GROUP_FOLDER = re.compile(r"replica_(\d+)")
# What the lowest group writes in its dump folder once the job has trained its last step
# (and its final checkpoint is durable): {"step": N}. Published whole (storage.publish).
FINISHED = "fault_tolerance_finished.json"


# How often the loop's thread looks at the stop flag while torchft waits for a quorum.
QUORUM_POLL_S = 0.1


# A step refused again and again (a quorum short of min_replica_groups) is said once, then
# at this period with its count.
RETRY_SAY_S = 10.0


class FaultToleranceError(RuntimeError):
    """A fault-tolerance step that cannot go on (no quorum within its timeout, a heal
    that failed): one line, the group stops."""


class JobFinished(Exception):
    """The job trained its last step while this group started (its peers finished and
    published the marker after its start looked): nothing to train, said in one line."""


class StoppedWaiting(Exception):
    """This group, asked to stop, gave up waiting for a quorum (too few live groups):
    it stops after ``step``, its last committed step, which it writes itself."""

    def __init__(self, step: int):
        super().__init__(f"stopped waiting for a quorum after step {step}")
        self.step = step


def check_config(cfg) -> None:
    """The section's rules, run by config.validate: torchft importable, and the layouts
    it fits (each refused in one line)."""
    ft, p, t = cfg.fault_tolerance, cfg.parallelism, cfg.training
    if not ft.enable:
        return
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"fault_tolerance.enable needs torchft, which cannot be imported ({e}); "
            'pip install -e ".[ft]" (torchft==0.2.0), or drop --fault_tolerance.enable'
        ) from None
    if ft.replica_id >= ft.replica_groups:
        raise ConfigError(
            f"fault_tolerance.replica_id {ft.replica_id} is not below "
            f"fault_tolerance.replica_groups {ft.replica_groups}; number the groups 0 .. "
            f"{ft.replica_groups - 1}"
        )
    if ft.min_replica_groups > ft.replica_groups:
        raise ConfigError(
            f"fault_tolerance.min_replica_groups {ft.min_replica_groups} is above "
            f"fault_tolerance.replica_groups {ft.replica_groups}; lower it"
        )
    refused = [
        (p.pipeline_parallel_degree > 1, f"parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree}",
         "a pipeline's stages do not heal from peers yet; use 1"),
        (p.data_parallel_replicate_degree > 1,
         f"parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree}",
         "the replica groups are the replicas (HSDP across groups); use 1"),
        (t.mask_document_boundaries, "training.mask_document_boundaries",
         "its label count is summed inside a group only; turn it off"),
    ]  # fmt: skip
    for broken, key, why in refused:
        if broken:
            raise ConfigError(f"{key} with fault_tolerance.enable: {why}")
    if cfg.checkpoint.enable_checkpoint:
        name = _base(cfg.job.dump_folder)
        if name != f"replica_{ft.replica_id}":
            raise ConfigError(
                f"job.dump_folder {cfg.job.dump_folder} with fault_tolerance.enable and "
                f"checkpoint.enable_checkpoint: name it <job folder>/replica_{ft.replica_id} "
                "(as scripts/ft_launch.py does), so that a group finds the job's newest "
                "checkpoint in the other groups' folders beside it"
            )
        if is_url(cfg.checkpoint.folder) or os.path.isabs(cfg.checkpoint.folder):
            raise ConfigError(
                f"checkpoint.folder {cfg.checkpoint.folder} with fault_tolerance.enable: every "
                "replica group keeps its own checkpoints under its job.dump_folder; give a "
                "relative folder (the default, checkpoint)"
            )
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError(
            "fault_tolerance.enable needs a lighthouse: pass --fault_tolerance.lighthouse "
            "http://host:29510 or set TORCHFT_LIGHTHOUSE (start one with torchft_lighthouse "
            "--min_replicas 1; docs/fault_tolerance.md)"
        )


def _base(folder: str) -> str:
    return str(folder).rstrip("/").rsplit("/", 1)[-1]


def group_folders(cfg) -> dict[int, str]:
    """The dump folders of this job's replica groups, by group index: this group's
    (``job.dump_folder``) and, where it is named ``replica_<id>`` (check_config asks it
    of a group that saves), the folders named ``replica_<j>`` beside it, groups an earlier
    launch had included among them (a relaunch with fewer groups still sees their
    checkpoints). Cost: one listing of the job's folder at the start, O(groups) names
    (1,000 groups: 1,000 names), whatever the data (c4, FineWeb alike)."""
    ft = cfg.fault_tolerance
    own = str(cfg.job.dump_folder).rstrip("/") or "."
    folders = {ft.replica_id: own}
    if _base(own) != f"replica_{ft.replica_id}":
        return folders
    parent = storage.dirname(own) or "."
    for name in store_for(parent).listdir(parent):
        found = GROUP_FOLDER.fullmatch(name)
        if found:
            folders.setdefault(int(found[1]), storage.join(parent, name))
    return dict(sorted(folders.items()))


def peer_checkpoint_folders(cfg) -> list[str]:
    """The other groups' checkpoint folders (``<job>/replica_<j>/<checkpoint.folder>``),
    which a start reads (never writes) to resume from the job's newest checkpoint."""
    own = cfg.fault_tolerance.replica_id
    return [checkpoint_join(folder, cfg.checkpoint.folder)
            for group, folder in group_folders(cfg).items() if group != own]  # fmt: skip


def finished_step(cfg) -> tuple[int, str] | None:
    """(step, marker path) of the newest ``FINISHED`` marker among the job's groups'
    folders, None where none is. A marker is published whole (a kill -9 during its write
    leaves a stray temporary file, never a torn marker); one that cannot be read as
    ``{"step": N}`` is no marker. Cost: O(groups) small reads at the start."""
    found = None
    for folder in group_folders(cfg).values():
        path = storage.join(folder, FINISHED)
        try:
            step = int(json.loads(storage.read_bytes(path))["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if found is None or step > found[0]:
            found = (step, path)
    return found


def job_finished(cfg, dims, last_step: int) -> bool:
    """Whether the job this group belongs to has already trained to ``last_step`` (a
    group restarted after its peers finished): then one line says so, and the group
    exits 0 instead of training alone again. A command with a recovery option
    (``checkpoint.load_step``, ``checkpoint.exclude_from_loading``) begins a new timeline
    from a checkpoint: no marker stops it. Rank 0 reads, every rank gets its answer."""
    ck = cfg.checkpoint
    if not cfg.fault_tolerance.enable or ck.load_step >= 0 or ck.exclude_from_loading:
        return False
    found = finished_step(cfg) if dims.is_main else None
    found = parallel.broadcast_from_main(dims, found)
    if found is None or found[0] < last_step:
        return False
    if dims.is_main:
        logger.warning(
            "the job already finished: %s says step %d (this run's last step is %d); "
            "replica group %d has nothing to train and stops (remove the file to train again)",
            found[1], found[0], last_step, cfg.fault_tolerance.replica_id,
        )  # fmt: skip
    return True


def _local(value):
    """``value`` with every DTensor replaced by its local shard (what crosses to a peer's
    same group rank, whose shard is the same slice)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    if hasattr(value, "to_local"):
        return value.to_local().detach()
    return value


def _fill(target, got):
    """``got`` (a peer's ``_local`` state) put into the shape of ``target`` (this rank's
    own state): DTensors keep their placement and receive the peer's shard."""
    if isinstance(target, dict):
        return {k: _fill(target[k], got[k]) if k in target else got[k] for k in got}
    if isinstance(target, list | tuple) and isinstance(got, list | tuple):
        return type(target)(_fill(a, b) for a, b in zip(target, got))
    if hasattr(target, "to_local"):
        target.to_local().copy_(got)
        return target
    if isinstance(target, torch.Tensor) and isinstance(got, torch.Tensor):
        return got.to(target.device).clone()
    return got


def _like(param, got: torch.Tensor) -> torch.Tensor:
    """A peer's optimizer moment for a parameter this rank has no state for yet (it has
    not stepped): placed like the parameter (a DTensor under FSDP)."""
    if hasattr(param, "device_mesh") and got.dim() > 0:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(got.to(param.to_local().device).clone(), param.device_mesh,
                                  param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())  # fmt: skip
    return got.clone()


def _fill_optimizer(target: dict, got: dict, params: dict) -> dict:
    """``_fill`` for an optimizer state dict, whose per-parameter entries this rank may
    lack (a fresh joiner)."""
    state = {}
    for fqn, entries in got["state"].items():
        mine = target["state"].get(fqn, {})
        state[fqn] = {k: _fill(mine[k], v) if k in mine else _like(params[fqn], v)
                      for k, v in entries.items()}  # fmt: skip
    return {"state": state, "param_groups": got["param_groups"]}


def peer_state(components: dict) -> dict:
    """What a joining peer's same group rank receives: every ``HEALED`` component this
    rank has, DTensors as their local shards; the loader's position from every rank (a
    checkpoint keeps it from the first of each rank's tensor-parallel peers only, but
    each rank heals its own loader)."""
    return {name: _local(components[name].own_state() if name == "dataloader"
                         else components[name].state_dict())
            for name in HEALED if name in components}  # fmt: skip


def load_peer_state(components: dict, state: dict):
    """Load a peer's ``peer_state`` into this rank's components, each shaped as its own
    (DTensors keep their placement; optimizer moments this rank lacks are made)."""
    for name in HEALED:
        if name in state:
            adapter = components[name]
            if name == "optimizer":
                params = components["model"].state_dict()
                value = _fill_optimizer(adapter.state_dict(), state[name], params)
            else:
                value = _fill(adapter.state_dict(), state[name])
            adapter.load_state_dict(value)


class _WithoutTraceback(logging.Filter):
    """torchft's report of an error it recovers from (a peer gone in the middle of a
    collective: ``got exception waiting for work ...``), kept to its one line: the
    traceback of an error the step survives (it is not committed and is tried again, which
    the loop says) would read as a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def one_line_torchft_errors():
    """Each torchft logger that reports errors with a traceback, from now on without it."""
    for name in ("torchft.manager", "torchft.process_group", "torchft_errors"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _WithoutTraceback) for f in log.filters):
            log.addFilter(_WithoutTraceback())


def _torchft_manager(cfg, dims, heal, state_dict):
    """torchft's ``Manager`` for this group rank, connected to the lighthouse within
    ``fault_tolerance.quorum_timeout_seconds``; one line naming the address otherwise."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    ft = cfg.fault_tolerance
    timeout = timedelta(seconds=ft.timeout_seconds)
    quorum_timeout = timedelta(seconds=ft.quorum_timeout_seconds)
    pg = (ProcessGroupNCCL(timeout=timeout) if dims.device.type == "cuda"
          else ProcessGroupGloo(timeout=timeout))  # fmt: skip
    store = None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr is None or port is None:  # one plain process: a store of its own
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        addr, port = "localhost", str(store.port)
    lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    try:
        manager = Manager(
            pg=pg, load_state_dict=heal, state_dict=state_dict,
            min_replica_size=ft.min_replica_groups, use_async_quorum=False, timeout=timeout,
            quorum_timeout=quorum_timeout, connect_timeout=quorum_timeout, rank=dims.rank,
            world_size=dims.world_size, store_addr=addr, store_port=int(port),
            lighthouse_addr=ft.lighthouse or None, replica_id=f"replica_{ft.replica_id}",
            init_sync=False,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - one line: the lighthouse cannot be reached
        why = (str(e).splitlines() or [""])[0].split("; ")[0][:160]  # torchft's first clause
        raise FaultToleranceError(
            f"replica group {ft.replica_id}: cannot reach the lighthouse {lighthouse} within "
            f"fault_tolerance.quorum_timeout_seconds {ft.quorum_timeout_seconds:g} ({why}); "
            "start it (torchft_lighthouse, docs/fault_tolerance.md), fix "
            "fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE, or raise the timeout"
        ) from None
    return manager, store


def quorum_key(quorum_id: int, replica_ids) -> str:
    """A quorum's name for the records: the lighthouse's id (which a new lighthouse
    numbers from 1 again) and a digest of its members' ids (torchft gives each Manager a
    fresh uuid: a group started again is another member)."""
    digest = hashlib.sha1("\n".join(sorted(map(str, replica_ids))).encode()).hexdigest()
    return f"{quorum_id}-{digest[:12]}"


class QuorumSeen:
    """The last quorum the lighthouse gave this group rank, as torchft's client returned
    it (torchft 0.2.0's Manager keeps only its number): ``watching`` wraps the client."""

    def __init__(self):
        self.key: str | None = None

    def watching(self, client):
        seen = self

        class Watched:
            def _quorum(self, *args, **kwargs):
                result = client._quorum(*args, **kwargs)
                seen.key = quorum_key(result.quorum_id, result.replica_ids)
                return result

            def __getattr__(self, name):
                return getattr(client, name)

        return Watched()


def tried_path(dump_folder: str, dp_rank: int) -> str:
    """Where a rank's tries are on record (``ReplicaGroup._write_tried``), beside its
    provenance file."""
    return os.path.join(dump_folder, "provenance", f"tried_rank{dp_rank}.jsonl")


class ReplicaGroup:
    """This replica group in the fault-tolerant job: the feed the loop reads each step's
    batches from (``next_step``, otherwise the loader's), and the commit the step calls
    between backward and update (``commit``). ``manager``: torchft's ``Manager`` (made
    here when None) or anything that answers as it does (a simulated quorum, in tests)."""

    def __init__(self, cfg, dims, loader, components: dict, model: torch.nn.Module, train_state,
                 manager=None):  # fmt: skip
        ft = cfg.fault_tolerance
        self.cfg, self.dims, self.loader, self.model = cfg, dims, loader, model
        self.components, self.train_state = components, train_state
        self.replica_id = ft.replica_id
        self.lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self.seed = cfg.training.seed
        self._store = None
        self._quorum = QuorumSeen()
        if manager is None:
            one_line_torchft_errors()
            manager, self._store = _torchft_manager(cfg, dims, self._heal, self._peer_state)
            manager._client = self._quorum.watching(manager._client)
        self.manager = manager
        schedule = default_schedule(cfg.training, dims.dp_world, dims.dp_rank, ft.replica_groups)
        if schedule is not None:
            loader.reshard(dims.dp_rank, schedule)
        # Dropout streams per group and data-parallel rank (group 0's are a plain run's).
        torch.manual_seed(self._stream_seed(0))
        self._synced = False
        self._try = StepTry(loader)  # where the step being trained began
        self.participant, self.participants = 0, 0  # this group's place in the last quorum
        self.quorum_s = 0.0  # what the last quorum cost the loop
        self.healed_at: int | None = None
        # The stop agreement (preemption.py): this rank's flag, asked at each commit, and
        # whether this group stops after the last committed step (it was signalled, or
        # too few groups would be left after those that were).
        self.asked_to_stop = lambda: False
        self.stop_agreed = False
        self.job_stops = False  # every group stops after the last committed step
        # A heal writes the state in torchft's quorum thread: a group that gives up
        # waiting (``_quorum_or_stop``) does so between heals, never during one.
        self._heal_lock = threading.Lock()
        self._gave_up = False
        self._heal_failed: Exception | None = None  # what a heal raised (not the quorum)
        # One line per try of a step (its share, whether it was committed), and per heal
        # (rank 0): what bench_ft.py reads.
        self._events = None
        if dims.is_main:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            path = os.path.join(cfg.job.dump_folder, "fault_tolerance.jsonl")
            self._events = open(path, "a")  # noqa: SIM115 - kept open for the run
        # With data provenance: each try's spans, written before its cross-group
        # all-reduce (``_write_tried``), so that a share trained by a committing quorum is
        # on record even where this group dies before its provenance line.
        self._tried = self._tried_path = self._spans = None
        if cfg.metrics.data_provenance and dims.tp_rank == 0:  # the provenance's writers
            self._tried_path = tried_path(cfg.job.dump_folder, dims.dp_rank)
        # At its first quorum (a heal may bring a peer's step and timeline),
        # ``check_current`` (LowestGroupSaves's: the job has not moved past it); at its
        # first commit, the records (metrics, provenance, tries) trimmed to the timeline
        # it trains on (``_trim_records``), ``on_timeline`` the metrics' part
        # (StepMetrics.trim, set by the loop).
        self.check_current = None
        self.on_timeline = None
        self._settled = False
        self._trimmed = False
        # The job's newer checkpoint this group found at its first quorum, and since when
        # (``_behind_job``): it commits no step until a heal brings it there.
        self._behind: tuple[int, str, float] | None = None
        self._refused: list | None = None  # the step being refused, for its warnings

    def _event(self, **fields):
        if self._events is not None:
            self._events.write(json.dumps({**fields, "time": time.time()}) + "\n")
            self._events.flush()

    def _stream_seed(self, step: int) -> int:
        return self.seed + (self.replica_id * self.dims.dp_world + self.dims.dp_rank) + step * 7919

    # ---- the feed ------------------------------------------------------------------------
    def next_step(self) -> list[dict]:
        """The next step's micro-batches for this rank: a quorum first (healing this group
        from a peer when it is behind), then the loader split over the participants."""
        if self._gave_up:  # asked to stop, and too few groups to commit (``commit``)
            raise StoppedWaiting(self.train_state.step)
        if not self._synced:  # the committed step count is the train state's (a resume)
            self.manager.load_state_dict({"step": self.train_state.step, "batches_committed": 0})
            self._synced = True
        begin = time.perf_counter()
        if not self._quorum_or_stop():
            raise StoppedWaiting(self.train_state.step)
        self.quorum_s = time.perf_counter() - begin
        if not self._settled:  # after the quorum thread's heal, if any
            self._first_quorum()
        self.train_state.name_branch(self.quorum_id())  # before the try's records name it
        if self._behind is not None:
            self._behind_job()
        self.participant, self.participants = self.participation()
        split_loader(self.loader, self.participant, self.participants, self.dims.dp_rank,
                     self.dims.dp_world)  # fmt: skip
        self._try.begin()
        batches = self.loader.next_step()
        if self._tried_path is not None:
            self._spans = [spans for b in batches for spans in b["spans"]]
        return batches

    def quorum_id(self) -> str | int | None:
        """The last quorum, the same on every group in it and on no other quorum of the
        job, whatever the lighthouse's lives (``QuorumSeen.key``); torchft's own id where
        its client is not watched (a simulated quorum)."""
        return self._quorum.key or getattr(self.manager, "_quorum_id", None)

    def _write_tried(self):
        """One line for this try: its step, quorum, this group's share and the spans it
        read (provenance.py's ``read_job_provenance`` counts it where a quorum's peer
        committed the step and this group never wrote its own line). Flushed before the
        all-reduce, so a SIGKILL after it leaves the line in the file. Cost: the step's
        spans twice on disk (this line and the provenance line), provenance runs only."""
        if self._tried is None:
            os.makedirs(os.path.dirname(self._tried_path), exist_ok=True)
            self._tried = open(self._tried_path, "a")  # noqa: SIM115 - kept open for the run
        line = {"step": self._try.number, "quorum": self.quorum_id(),
                "participant": self.participant, "participants": self.participants,
                "sequences": self._spans, "branch": self.train_state.current_branch}  # fmt: skip
        self._tried.write(json.dumps(line) + "\n")
        self._tried.flush()

    def _first_quorum(self):
        """The group's first quorum (a heal included): the job must not have moved past
        its state (``check_current``: the marker raises, a newer checkpoint makes it
        wait for a holder, ``_behind_job``)."""
        self._settled = True
        newer = None if self.check_current is None else self.check_current(self.train_state.step)
        if newer is not None:
            self._behind = (*newer, time.monotonic())
            if self.dims.is_main:
                logger.warning(
                    "replica group %d is at step %d, and the job's newest checkpoint is "
                    "step-%d in %s: it commits no step until a group that holds it heals this "
                    "one (at most fault_tolerance.timeout_seconds %g)", self.replica_id,
                    self.train_state.step, newer[0], newer[1],
                    self.cfg.fault_tolerance.timeout_seconds,
                )  # fmt: skip

    def _behind_job(self):
        """This group found the job's newest checkpoint past its state at its first
        quorum: a group that holds it (or is past it) may be on its way (starting, its
        save just made durable), or gone (finished or dead). Training on would commit
        those steps again on a second timeline beside them, so this group vetoes its own
        commits (``commit``: its gradients still go into the step's all-reduce; a peer of
        its quorum that commits the step trains its share, and heals it at the next
        quorum) until a heal brings it to that step. Asked to stop meanwhile (SIGTERM),
        it stops at once (``StoppedWaiting``). It waits at most
        ``fault_tolerance.timeout_seconds``, the longest a live peer may lag; then the
        holder is gone, and the group stops in one line (the marker's, where the job
        finished meanwhile), to be started again from that checkpoint. The ranks of the
        group decide alike (an all-reduce of their clocks' verdicts, while behind only)."""
        newest, folder, since = self._behind
        if self.train_state.step >= newest:
            self._behind = None
            return
        if parallel.any_rank(self.dims, self.asked_to_stop()):
            # Preempted while it waits: it stops as a group that gave up its quorum does,
            # and writes nothing (its step is in the checkpoint it loaded; trial 990038).
            raise StoppedWaiting(self.train_state.step)
        waited = time.monotonic() - since >= self.cfg.fault_tolerance.timeout_seconds
        if parallel.any_rank(self.dims, waited):
            self.check_current(self.train_state.step)  # the marker's line, if it is there now
            raise FaultToleranceError(
                f"replica group {self.replica_id} is at step {self.train_state.step}, and no "
                f"group holding the job's newest checkpoint step-{newest} ({folder}) joined "
                f"within fault_tolerance.timeout_seconds "
                f"{self.cfg.fault_tolerance.timeout_seconds:g}: it stops without training "
                "on beside it; start the job's groups again to resume from it"
            )

    def _trim_records(self, step: int):
        """This rank's records kept to the timeline it trains on, at this start's first
        commit (of ``step``): the lines of steps up to ``step`` on the train state's
        lineage (records.metrics.truncate_jsonl_after; the lineage's last segment, named
        at this quorum, holds this try's own line of ``step``), on the loop's thread (the
        records' writers' own), before the step's provenance and metrics lines. Not at
        the start, nor at the first quorum: until a step is committed a heal may still
        bring a peer's step and timeline, and a trim to the state before it would drop
        the group's own lines of steps the job committed (trial 950007 at the start;
        trial 980216 at a first quorum that committed nothing, the heal at the next).
        After the first commit a heal needs none: the group took part in the quorum of
        every step it has lines of since, on the timeline its peer goes on with. Each
        rank trims its own files (rank 0 also the metrics and skips): nothing to wait
        for. Cost: one pass over the rank's records per start, never per step."""
        self._trimmed = True
        lineage = self.train_state.lineage
        if self._tried is not None:  # opened again at its next line
            self._tried.close()
            self._tried = None
        if self._tried_path is not None:
            truncate_jsonl_after(self._tried_path, step, lineage)
        if self.on_timeline is not None:
            self.on_timeline(step, lineage)

    def _quorum_or_stop(self) -> bool:
        """torchft's ``start_quorum`` (a heal included) in a thread of its own, while the
        loop's thread looks every ``QUORUM_POLL_S`` whether the group was asked to stop:
        True once every rank of the group has its quorum; False where the group, asked to
        stop, has waited ``fault_tolerance.timeout_seconds`` (the longest a live peer may
        lag: a collective with it would fail after that): its peers are gone, too few are
        left for a quorum, and it stops after its last committed step instead of waiting
        ``quorum_timeout_seconds`` for nothing. The ranks of the group decide alike (the
        flags travel in the group's control all-reduce). Cost: one 4-byte all-reduce
        inside the group per look, one per step where the quorum is quick."""
        done, failed = threading.Event(), []
        device = self.dims.device

        def quorum():
            try:
                if device.type == "cuda":  # the heal's tensors land on this rank's device
                    torch.cuda.set_device(device)
                self.manager.start_quorum()
            except Exception as e:  # noqa: BLE001 - raised in the loop's thread below
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=quorum, name="ft-quorum", daemon=True).start()
        begin, patience = time.monotonic(), self.cfg.fault_tolerance.timeout_seconds
        while True:
            done.wait(QUORUM_POLL_S)
            if not parallel.any_rank(self.dims, not done.is_set()):
                break
            waited = time.monotonic() - begin >= patience
            if parallel.any_rank(self.dims, waited and self.asked_to_stop()):
                with self._heal_lock:  # a heal under way finishes first; none starts after
                    self._gave_up = True
                if self.dims.is_main:
                    logger.warning(
                        "replica group %d: asked to stop, and no quorum within "
                        "fault_tolerance.timeout_seconds %g (too few live groups): it stops "
                        "after step %d, its last committed step", self.replica_id, patience,
                        self.train_state.step,
                    )  # fmt: skip
                return False
        if failed:  # one line: the lighthouse or the quorum failed
            raise self._no_quorum(failed[0]) from None
        return True

    def _no_quorum(self, e: Exception) -> FaultToleranceError:
        """The one line for a quorum that did not come within its timeout: the lighthouse
        died or cannot be reached (torchft waits the whole timeout for it, then says
        ``Timeout expired``), or too few groups are alive; both named, with the setting.
        A heal that failed inside the quorum is named as such."""
        ft = self.cfg.fault_tolerance
        if self._heal_failed is not None:
            cause = self._heal_failed
            return FaultToleranceError(
                f"replica group {self.replica_id}: healing from a live peer failed "
                f"({type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}); "
                "start the group again (it heals anew) or resume the job from its checkpoint"
            )
        why = (str(e).splitlines() or [""])[0]
        if 'message: "' in why:  # a gRPC status: its message alone ("Timeout expired")
            why = why.split('message: "', 1)[1].split('"', 1)[0]
        return FaultToleranceError(
            f"replica group {self.replica_id}: no quorum within "
            f"fault_tolerance.quorum_timeout_seconds {ft.quorum_timeout_seconds:g} "
            f"({type(e).__name__}: {why[:160]}): the lighthouse {self.lighthouse} did not answer "
            f"(restart it, or fix fault_tolerance.lighthouse / TORCHFT_LIGHTHOUSE) or fewer "
            f"than fault_tolerance.min_replica_groups {ft.min_replica_groups} groups are alive"
        )

    def participation(self) -> tuple[int, int]:
        """(this group's index among the step's participants, how many there are)."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise FaultToleranceError(
                f"replica group {self.replica_id} is not a participant of quorum step "
                f"{self.manager.current_step()}"
            )
        return rank, self.manager.num_participants()

    def __getattr__(self, name):  # what the loop and the metrics read: the loader's
        if name == "loader":  # not set yet (during __init__)
            raise AttributeError(name)
        return getattr(self.loader, name)

    # ---- the step ------------------------------------------------------------------------
    def commit(self, loss: torch.Tensor) -> bool:
        """Average the gradients' local shards (and ``loss``, in place) over the step's
        participants, with the stop votes summed alongside, then vote: True when every
        group rank and the quorum agree the step counts. False: the gradients are to be
        dropped, and the loader is back where the step began, so the next try reads the
        same windows."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        # The group's stop vote, the same on its ranks, so that the all-reduce counts groups.
        asked = parallel.any_rank(self.dims, self.asked_to_stop())
        vote = torch.tensor([stop_vote(asked)], device=loss.device)
        flat = torch.cat([g.reshape(-1).float() for g in local] + [loss.reshape(1).float(), vote])
        if self._tried_path is not None:
            self._write_tried()
        self.manager.allreduce(flat).wait()
        if self._behind is not None:  # after the all-reduce: the peers' average holds its share
            self.manager.report_error(RuntimeError("behind the job's newest checkpoint"))
        ok = self.manager.should_commit()
        # Which share of the step this group trained (participant of participants): a
        # participant that dies after the all-reduce leaves its share trained by the
        # committing groups but in no provenance file; this line names it.
        self._event(step=self._try.number, committed=ok, quorum=self.quorum_id(),
                    participant=self.participant, participants=self.participants,
                    quorum_s=self.quorum_s)  # fmt: skip
        if ok:
            if not self._trimmed:  # this start's first commit: its timeline is settled
                self._trim_records(self._try.number)
            i = 0
            for g in local:
                g.copy_(flat[i : i + g.numel()].view_as(g))
                i += g.numel()
            loss.copy_(flat[-2])
            leaving = leaving_groups(float(flat[-1]), self.participants)
            least = self.cfg.fault_tolerance.min_replica_groups
            self.job_stops = stops_after_step(False, leaving, self.participants, least)
            self.stop_agreed = asked or self.job_stops
            if leaving and not asked:
                logger.warning("step %d: %d of %d replica groups leave (preempted)%s",
                               self._try.number, leaving, self.participants,
                               "; too few are left: this one stops too" if self.stop_agreed
                               else "; this one trains on")  # fmt: skip
        elif asked and self.participants < self.cfg.fault_tolerance.min_replica_groups:
            # A lighthouse whose --min_replicas is below min_replica_groups gives a lone
            # group quorums whose commits torchft refuses: it would retry for ever, and
            # its stop vote, counted only in a committed step, would never be read.
            self._gave_up = True
            if self.dims.is_main:
                logger.warning(
                    "replica group %d: asked to stop, and step %d cannot be committed with %d "
                    "of fault_tolerance.min_replica_groups %d groups: it stops after step %d, "
                    "its last committed step", self.replica_id, self._try.number,
                    self.participants, self.cfg.fault_tolerance.min_replica_groups,
                    self._try.number - 1,
                )  # fmt: skip
        elif self._behind is None:  # behind the job: said once (``_first_quorum``)
            self._say_not_committed(self._try.number)
        return self._try.settle(ok)

    def _say_not_committed(self, step: int):
        """A step that was not committed, said at its first refusal and then every
        ``RETRY_SAY_S`` with its count (a quorum short of ``min_replica_groups`` refuses
        every try until a group is back: hundreds a minute)."""
        now = time.monotonic()
        if self._refused is None or self._refused[0] != step:
            self._refused = [step, 1, now, now]  # step, refusals, first, last said
            logger.warning("step %d not committed: it is tried again with the same windows", step)
            return
        self._refused[1] += 1
        if now - self._refused[3] >= RETRY_SAY_S:
            self._refused[3] = now
            logger.warning("step %d still not committed: %d tries in %.0f s (too few groups "
                           "for fault_tolerance.min_replica_groups %d, or a failing peer)",
                           step, self._refused[1], now - self._refused[2],
                           self.cfg.fault_tolerance.min_replica_groups)  # fmt: skip

    @property
    def lowest(self) -> bool:
        """This group is the first participant of the last quorum (the one that saves)."""
        return saves(self.manager.participating_rank())

    @property
    def writes_the_stop(self) -> bool:
        """This group writes the checkpoint of the last committed step: the lowest; and,
        where every group stops after it (an agreed stop of the job), the next
        participant too, a second copy in its own folder: a scheduler that kills the
        lowest group's node before its write is durable then costs the job nothing."""
        return self.lowest or (self.job_stops and self.manager.participating_rank() == 1)

    # ---- healing -------------------------------------------------------------------------
    def _peer_state(self) -> dict:
        """What a joining peer's same group rank receives (torchft's quorum thread calls
        it while the loop waits for the quorum: between steps)."""
        return peer_state(self.components)

    def _heal(self, state: dict):
        """Load a peer's state (torchft calls it inside ``start_quorum``, in the quorum
        thread while the loop's waits), then reseed this group's RNG streams for the step
        healed at. Nothing, once the group gave up waiting (it is saving its own state)."""
        with self._heal_lock:
            if not self._gave_up:
                try:
                    self._load_healed(state)
                except Exception as e:  # noqa: BLE001 - torchft re-raises it from start_quorum
                    self._heal_failed = e
                    raise

    def _load_healed(self, state: dict):
        begin = time.perf_counter()
        load_peer_state(self.components, state)
        self.healed_at = self.train_state.step
        self.reseed(self.healed_at)
        self._event(healed_at=self.healed_at, heal_s=time.perf_counter() - begin)
        logger.warning(
            "replica group %d healed from a live peer at step %d (%.2f s)",
            self.replica_id, self.healed_at, time.perf_counter() - begin,
        )  # fmt: skip

    def reseed(self, step: int):
        """This group's RNG streams (dropout) for ``step``, after a state that is not its
        own came in: a heal, or a peer's checkpoint loaded at the start."""
        torch.manual_seed(self._stream_seed(step))

    def finish(self, step: int, last_step: int):
        """After the loop, once the checkpoint manager is closed (the final save durable):
        where the job trained its last step, the lowest group's rank 0 publishes the
        ``FINISHED`` marker, which a group restarted later reads (``job_finished``)."""
        if step >= last_step and self.lowest and self.dims.is_main:
            payload = json.dumps({"step": step}).encode()
            storage.publish(storage.join(self.cfg.job.dump_folder, FINISHED),
                            lambda f: f.write(payload))  # fmt: skip

    def close(self):
        self.manager.shutdown(wait=False)
        for f in (self._events, self._tried):
            if f is not None:
                f.close()


class LowestGroupSaves:
    """The checkpoint manager of a replica group, saving only while this group is the
    quorum's first participant: one durable checkpoint per interval for the job, in that
    group's folder (an agreed stop of every group: the second participant writes a copy;
    a group that becomes the first writes at once where the last due step is not
    durable; a group left alone writes its own stop). Whole-job restart (with as many groups, more or fewer, and as many
    ranks per group or not): every group loads the job's newest checkpoint, in whichever
    group's folder it is (``load``), so every group starts at the same step and nothing
    waits for a heal; a quorum would heal a group still behind from the highest."""

    def __init__(self, checkpoint, replicas: ReplicaGroup, last_step: int | None = None):
        """``last_step``: the job's (train.last_step; the configured training.steps
        where None), which a published marker must reach to mean the job finished."""
        self._checkpoint, self._replicas = checkpoint, replicas
        self._saver = False  # this group was the lowest at the last step asked about
        self._last_step = replicas.cfg.training.steps if last_step is None else last_step
        replicas.check_current = self.check_current

    def check_current(self, step: int) -> tuple[int, str] | None:
        """After the group's first quorum (a heal included), at ``step``: whether the job
        moved past it while this group started (its peers saved newer steps, then went on,
        finished or died: a late start saw none of it). A job whose marker is published
        stops this group as ``job_finished`` does (``JobFinished``: the one line, exit
        0; trial 920008: a group up late loaded step-6 while its peers trained to 12 and
        finished, then trained 7-12 again alone). Otherwise the job's newest checkpoint,
        as a start would now choose it (``CheckpointManager.resume_point``), where it is
        past ``step`` (the group waits for its holder: ``ReplicaGroup._behind_job``), else
        None. Rank 0 looks, every rank gets the answer. Cost: once per start, one marker
        read per group folder and O(groups x kept checkpoints) manifest reads, whatever
        the data."""
        if not self._checkpoint.enabled:
            return None
        cfg, dims = self._replicas.cfg, self._replicas.dims
        ck = cfg.checkpoint

        def look():
            recovering = ck.load_step >= 0 or ck.exclude_from_loading  # a new timeline
            finished = None if recovering else finished_step(cfg)
            return finished, self._checkpoint.resume_point(peer_checkpoint_folders(cfg))

        finished, newest = parallel.on_main(dims, look)
        if finished is not None and finished[0] >= self._last_step and finished[0] > step:
            if dims.is_main:
                logger.warning(
                    "the job already finished: %s says step %d (this group started at step "
                    "%d); replica group %d has nothing to train and stops (remove the file to "
                    "train again)", finished[1], finished[0], step,
                    cfg.fault_tolerance.replica_id,
                )  # fmt: skip
            raise JobFinished(finished[1])
        return newest if newest is not None and newest[0] > step else None

    def job_checkpoint_folders(self) -> list[str]:
        """Every group's checkpoint folder, this group's first."""
        cfg = self._replicas.cfg
        own = checkpoint_join(cfg.job.dump_folder, cfg.checkpoint.folder)
        return [own, *peer_checkpoint_folders(cfg)]

    def job_complete_steps(self) -> set[int]:
        """The steps with a complete checkpoint in any group's folder. Cost: O(groups)
        folder listings and one manifest test per step folder, whatever the data (c4,
        FineWeb alike); paid on rank 0 when this group becomes the saver (its first committed
        step of each start included) and at a stop alone, never per step."""
        return {s for folder in self.job_checkpoint_folders() for s in complete_steps(folder)}

    def newest_complete(self) -> int:
        """The job's newest complete checkpoint step in any group's folder (0: none)."""
        return max(self.job_complete_steps(), default=0)

    def _takes_over(self, step: int) -> bool:
        """Whether this group, the saver from ``step`` on and not at the step before (the
        lowest group died or left: its save of the last due step may never have become
        durable, a kill -9 mid-way), writes ``step`` now: where no group's folder holds a
        complete checkpoint of the last due step (every ``checkpoint.interval``), the steps
        since would otherwise be lost to a whole-job restart until the next due step.
        Every rank of the group decides alike (rank 0 looks, the group is told)."""
        interval = self._checkpoint.interval
        due = step - step % interval
        if not self._checkpoint.enabled or due == step or due == 0:
            return False
        dims = self._replicas.dims
        newest = parallel.broadcast_from_main(  # the control group: a save may be in flight
            dims, self.newest_complete() if dims.is_main else None, control=True
        )
        if newest >= due:
            return False
        if dims.is_main:
            logger.warning(
                "replica group %d now writes the job's checkpoints, and the newest complete one "
                "is step-%d, older than the due step-%d (its writer left before it was "
                "durable): step-%d is written now", self._replicas.replica_id, newest, due, step,
            )  # fmt: skip
        return True

    def load(self) -> list[str]:
        """The job's newest checkpoint, from this group's folder or a peer's (read only:
        ``peer_checkpoint_folders``); the loader's entry is any rank's (every entry holds
        the global position), the model and optimizer are resharded by DCP, as in an
        elastic resume. After a peer's, this group's RNG streams are its own again
        (reseeded for the step, as after a heal). Cost: one listing of the job's folder
        and O(checkpoints) manifest reads per group folder, on rank 0."""
        replicas = self._replicas  # the peers are surveyed by rank 0 alone (the manager's plan)
        loaded = self._checkpoint.load(
            peer_checkpoint_folders(replicas.cfg) if replicas.dims.is_main else []
        )
        source = self._checkpoint.loaded_from
        if source is not None and storage.dirname(source) not in [f for f, _ in self.tiers]:
            replicas.reseed(replicas.train_state.step)
        return loaded

    def should_save(self, step: int) -> bool:
        """Due and this group's to write; or this group has just become the saver and the
        job lacks the last due step's checkpoint (``_takes_over``)."""
        was, self._saver = self._saver, self._replicas.lowest
        if not self._saver:
            return False
        return self._checkpoint.should_save(step) or (not was and self._takes_over(step))

    def save_alone(self, step: int) -> bool:
        """The stop of a group that gave up waiting for a quorum (``StoppedWaiting``): no
        quorum says who writes, so it writes its last committed ``step`` in its own
        folder, unless some group's folder holds it complete already (its due save, its
        own async one waited for first); whether this group wrote it. Every group that
        stops so writes the same state (the groups are equal after every commit). Not
        where the group's ranks stand at other steps (a heal that reached some of them):
        nothing consistent to write."""
        dims = self._replicas.dims
        if len(set(parallel.all_gather_objects(dims, step, control=True))) > 1:  # a save may fly
            return False
        if step == 0 or not self._checkpoint.enabled:
            return False
        self._checkpoint.wait()  # this group's own save of the step, if one is in flight
        held = parallel.broadcast_from_main(
            dims, step in self.job_complete_steps() if dims.is_main else None
        )
        if not held:
            self._checkpoint.save(step)
        return not held

    def save(self, step: int, **kw) -> bool:
        """Save ``step`` if this group is one that writes it (``writes_the_stop``);
        whether it wrote."""
        if not self._replicas.writes_the_stop:
            return False
        self._checkpoint.save(step, **kw)
        return True

    def __getattr__(self, name):
        if name == "_checkpoint":
            raise AttributeError(name)
        return getattr(self._checkpoint, name)
