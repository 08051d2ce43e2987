"""One seeded fault campaign over every fault and feature, judged against the uninterrupted run.

A trial is drawn whole from its seed (``draw``): a job (1-3 ranks, 0-2 loader workers,
sync or async saves, the local tier on or off, a local folder or a bucket on the
loopback S3 server, one source or a mix with or without a schedule, a spike policy,
FSDP, DDP, TP, PP or EP: the MoE model's experts over 2 ranks), the faults planted in its data path (a NaN or a spike at a step, which
does or does not recur on relaunch), and a schedule of faults, one per life of the job:

- ``kill``: SIGKILL to one rank, to the launcher alone, or to the whole job, after a
  drawn step, during a save or an upload, or just after a rewind;
- ``term``: SIGTERM to every rank, each 0-500 ms after the last (a scheduler's skew);
- ``store`` (a bucket only): 503s, dropped connections, a slow store, a store paused
  past the lease's timeout, or restarted (connections refused, its data kept);
- ``double``: a second copy of the job started with the first (a scheduler's double
  requeue): one takes the lease, the other waits it out and stops in one line, or
  resumes where the first finished;
- ``layout``: the next life on another rank count or worker count (the worker count
  alone under TP, PP and EP, whose degree is the rank count);
- replica groups (fault tolerance: 2-3 groups, a lighthouse of the runner's): ``group``,
  one group SIGKILLed (never group 0) while the others train on, started again two steps
  later and healed from a live peer (``run_groups``, judged by ``judge_groups``: every
  committed step's windows over all groups' records, tries included, the reference's;
  each token once; losses within ``ELASTIC_REL``; no lease left but a killed group's).

After each fault the same command is launched again, as a scheduler would, until the job
finishes. ``Trial.run`` then judges the history (``judge``) with an oracle that does not
ask the code under test what should have happened:

- the losses of every step, and every tensor of the final checkpoint, bit-equal to an
  uninterrupted run of the same job given the skips the records say were applied (the
  rewinds' skips) and the broken steps the final timeline dropped; where a life ran on
  another layout, every step's windows exactly (provenance) and the losses within
  ``ELASTIC_REL`` (the gradient's sum runs over other ranks in another order: ulps per
  step, 1e-6 after a dozen steps of the debug model; 1e-4 leaves a margin while a step
  off by one moves the loss by ~1e-2);
- exactly-once provenance (``check_provenance``);
- every life exits within ``EXIT_BOUND_S`` of its fault, the last one with 0, no
  traceback in any log, and no process of any life left behind; or the job stops, each
  rank in its one line, at a spike after ``MAX_REWINDS`` recorded rewinds (a plant that
  recurs on every relaunch adds one a life: the data is not its cause), its steps then
  judged against the reference's first ones;
- the lease released, and no unfinished multipart upload left in the bucket.

A failing trial prints its seed, its schedule as JSON and the command that replays it.
Cost: a trial is 2-5 launches of a 12-step debug job (each ~5-8 s of a 2-core machine,
most of it interpreter start-up) plus its reference, which is cached by what decides it
(the job, the skips, the dropped steps), so later trials of the same job reuse it.

Never: import the code under test's decisions (which checkpoint, which skip): the oracle
reads only what a run wrote (metrics, provenance, rewind records, checkpoints).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import s3
from torchtitan import REPO_ROOT
from torchtitan.tools.launch import DEBUG_CONFIG, free_port, launcher_workers, run_env

EXIT_BOUND_S = 90.0  # a life ends within this of its fault (a preemption's save included)
LIFE_BOUND_S = 240.0  # a life without a fault ends within this
ELASTIC_REL = 1e-4
STEPS, INTERVAL, SPIKE_LOSS = 12, 3, 100.0
# A spike that comes back after this many rewinds (over all lives: each relaunch where a
# recurring plant fires again adds one) stops the job in one line: the data was not its
# cause. The oracle then judges the steps before the stop.
MAX_REWINDS = 3
# Replica groups: how long a group waits for its quorum (or, starting, for the lighthouse)
# before it stops in one line; a dead lighthouse's groups exit within it and a margin.
QUORUM_TIMEOUT_S = 30.0
# Replica groups' faults that relaunch the whole job (run and judged by run_groups): the
# lighthouse killed (every group stops in one line), the job killed, SIGTERM to every
# rank of every group.
WHOLE_JOB_FT_FAULTS = ["lighthouse", "kill", "term"]
STOP_LINE = "a loss spike after"
LEASE_TIMEOUT_S, LEASE_WAIT_S = 6.0, 30.0
FAULT_ENV = "TORCHTITAN_TEST_FAULT"


@dataclass
class Job:
    ranks: int = 1
    workers: int = 0
    async_mode: str = "disabled"
    local_tier: bool = False
    bucket: bool = False
    mix: str = "none"  # none | mix | schedule
    spike: str = "none"  # none | skip_step | rewind
    layout: str = "fsdp"  # fsdp | ddp | tp | pp | ep (pp and ep: 2 ranks in every life)
    # Dropout draws a stream per data-parallel rank: a life on another rank count draws
    # other masks, so a job whose rank count changes trains without it.
    dropout: float = 0.1
    # Metrics every step (the guard's verdict read on the host each step) or every few (a
    # verdict learned a step late: spikes.py's lag), and the guard's z-score window (0:
    # the loss bound alone) whose checkpointed state a resume must restore.
    log_freq: int = 1
    spike_window: int = 0
    # Replica groups (fault tolerance, torchft): 0 for none, else this many groups of
    # ``ranks`` ranks each, a lighthouse of the runner's, each group its own torchrun.
    groups: int = 0
    # fault_tolerance.min_replica_groups: with every group, a killed group's peers commit
    # nothing until it is back, so it heals mid-run (with 1 the others often finish first).
    min_groups: int = 1

    def args(self, ranks: int, workers: int) -> list[str]:
        """The job's command line (without the dump folder) at a rank and worker count."""
        a = ["--job.config_file", DEBUG_CONFIG, "--training.steps", STEPS,
             "--training.seq_len", 32, "--training.batch_size", 2,
             "--training.global_batch_size", 6, "--training.num_workers", workers,
             "--checkpoint.enable_checkpoint", "--checkpoint.interval", INTERVAL,
             "--checkpoint.async_mode", self.async_mode,
             "--checkpoint.lease_timeout_seconds", LEASE_TIMEOUT_S,
             "--checkpoint.lease_wait_seconds", LEASE_WAIT_S,
             "--metrics.log_freq", self.log_freq, "--metrics.data_provenance",
             "--training.data_parallel", "ddp" if self.layout == "ddp" else "fsdp",
             "--lr_scheduler.warmup_steps", 2, "--model.dropout", self.dropout]  # fmt: skip
        if self.layout == "tp":
            a += ["--parallelism.tensor_parallel_degree", 2]
        elif self.layout == "pp":
            a += ["--parallelism.pipeline_parallel_degree", 2]
        elif self.layout == "ep":  # the MoE flavor, its 8 experts over the 2 ranks
            a += ["--model.flavor", "debug_moe", "--parallelism.expert_parallel_degree", 2]
        if self.local_tier:
            a += ["--checkpoint.local_interval", 2]
        if self.mix != "none":
            a += ["--training.datasets", "shakespeare:0.7,kjv:0.3"]
        if self.mix == "schedule":
            a += ["--training.mix_schedule",
                  json.dumps([{"step": 5, "weights": {"shakespeare": 0.2, "kjv": 0.8},
                               "ramp": 3}])]  # fmt: skip
        if self.spike != "none":
            a += ["--training.spike_window", self.spike_window, "--training.spike_max_loss", SPIKE_LOSS,
                  "--training.on_spike", self.spike, "--training.rewind_steps", 2,
                  "--training.skip_after", 1, "--training.max_bad_steps", 3,
                  "--training.max_rewinds", MAX_REWINDS]  # fmt: skip
        if self.groups:  # a dead lighthouse ends every group within this (see run_groups)
            a += ["--fault_tolerance.quorum_timeout_seconds", QUORUM_TIMEOUT_S,
                  "--fault_tolerance.min_replica_groups", self.min_groups]  # fmt: skip
        if self.spike != "none" and self.spike_window:
            # 4 steps make a poor estimate of the spread: at 6 sigma the debug model's own
            # gradient norms read as spikes (3 rewinds, the job stopped, in the trials
            # that first drew it); a planted x1000 is far above 100.
            a += ["--training.spike_sigma", 100]
        return [str(v) for v in a]


@dataclass
class Plant:
    """A fault in the data path at a step: ``nan`` or ``x1000`` (a spike)."""

    step: int
    kind: str
    recurs: bool  # armed again on every relaunch, or only in the first life


@dataclass
class Fault:
    kind: str  # kill | term | store | double | layout; replica groups: group | lighthouse
    # step | save | rewind (kill); the store's fault (store); step | quorum | heal (group)
    moment: str = "step"
    target: str = "job"  # job | one | launcher (kill); the group killed (group: "1", "2")
    at_step: int = 1
    seconds: float = 0.0  # a store fault's length; a term's skew bound (ms / 1000)
    ranks: int = 0  # layout
    workers: int = 0  # layout


@dataclass
class Trial:
    seed: int
    job: Job
    plants: list[Plant] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    stratum: str = ""  # the class of ``STRATA`` it was built as ("": drawn from its seed)

    @property
    def name(self) -> str:
        """Its dump folder's name (a stratum's trial shares its seed with a drawn one)."""
        return f"trial-{self.seed}" + (f"-{self.stratum}" if self.stratum else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Trial:
        d = json.loads(text)
        return Trial(d["seed"], Job(**d["job"]), [Plant(**p) for p in d["plants"]],
                     [Fault(**f) for f in d["faults"]], d.get("stratum", ""))  # fmt: skip


def draw(seed: int, bucket_ok: bool = True) -> Trial:
    """The trial of ``seed``: a job, its planted faults and its schedule."""
    rng = random.Random(seed)
    layout = rng.choice(["fsdp", "fsdp", "ddp", "tp"])
    ranks = 2 if layout == "tp" else rng.choice([1, 2, 2, 3])
    job = Job(ranks=ranks, workers=rng.choice([0, 1, 2]),
              async_mode=rng.choice(["disabled", "async"]), local_tier=rng.random() < 0.3,
              bucket=bucket_ok and rng.random() < 0.35,
              mix=rng.choice(["none", "none", "mix", "schedule"]),
              spike=rng.choice(["none", "skip_step", "rewind", "rewind"]), layout=layout)  # fmt: skip
    plants = []
    if job.spike != "none":
        if rng.random() < 0.8:
            plants.append(Plant(rng.randint(5, 9), "x1000", rng.random() < 0.5))
        if rng.random() < 0.3:
            plants.append(Plant(rng.randint(2, 4), "nan", rng.random() < 0.5))
    kinds = ["kill", "kill", "kill", "term", "term", "double"]
    if job.bucket:
        kinds += ["store", "store"]
    if layout != "tp":
        kinds += ["layout"]
    faults, at = [], 0
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        at = rng.randint(at + 1, min(at + 5, STEPS - 1)) if at < STEPS - 1 else STEPS - 1
        f = Fault(kind, at_step=at)
        if kind == "kill":
            moments = ["step", "save"] + (["rewind"] if any(p.kind == "x1000" for p in plants)
                                          and job.spike == "rewind" else [])  # fmt: skip
            f.moment = rng.choice(moments)
            f.target = rng.choice(["job", "one", "launcher"])
        elif kind == "term":
            f.seconds = rng.uniform(0, 0.5)
        elif kind == "store":
            f.moment = rng.choice(["503", "reset", "slow", "pause", "restart"])
            f.seconds = {"pause": LEASE_TIMEOUT_S * 2}.get(f.moment, rng.uniform(1, 3))
        elif kind == "layout":
            f.ranks = rng.choice([r for r in (1, 2, 3) if r != ranks] if layout != "ddp"
                                 else [ranks])  # fmt: skip
            f.workers = rng.choice([0, 1, 2])
        faults.append(f)
    if job.bucket and not any(f.kind == "store" for f in faults) and rng.random() < 0.6:
        # A bucket's own faults, drawn in most of its jobs: the store is why it is there.
        f = faults[-1]
        f.kind, f.moment = "store", rng.choice(["503", "reset", "slow", "pause", "pause",
                                                "restart"])  # fmt: skip
        f.seconds = LEASE_TIMEOUT_S * 2 if f.moment == "pause" else rng.uniform(1, 3)
    if job.spike == "rewind" and any(p.kind == "x1000" for p in plants) and rng.random() < 0.5:
        # The rewind's window (a kill between the rewind and the next save) is where a
        # skip held only in memory is lost: drawn first in half of the jobs that rewind.
        faults[0] = Fault("kill", "rewind", rng.choice(["job", "one", "launcher"]), 1)
    if any(f.kind == "layout" and f.ranks != ranks for f in faults[1:]):
        job.dropout = 0.0
    # Drawn last, so that every earlier draw of a seed is what it was before they came.
    if job.spike != "none" and rng.random() < 0.4:
        job.spike_window = 4  # full from step 5: the planted spikes' steps
    if rng.random() < 0.4:
        job.log_freq = rng.choice([3, 5])
        for p in plants:  # the oracle reads the dropped steps from the plants (all recur)
            p.recurs = True
        if job.spike == "rewind":
            # A rewind retakes the steps after its checkpoint in the same process, where a
            # plant has fired already: a NaN planted there is then not dropped in the final
            # timeline, which no log line would tell (trial 910028). Spikes only.
            plants[:] = [p for p in plants if p.kind != "nan"]
    if rng.random() < 0.2:
        return _replica_groups(seed, rng, job)
    if rng.random() < 0.25:
        # Pipeline stages or expert groups: 2 ranks in every life (the degree is the rank
        # count); a layout fault then changes the worker count alone.
        job.layout, job.ranks = rng.choice(["pp", "ep"]), 2
        for f in faults:
            if f.kind == "layout":
                f.ranks = 2
        job.dropout = 0.1
    return Trial(seed, job, plants, faults)


def _replica_groups(seed: int, rng: random.Random, job: Job) -> Trial:
    """A fault-tolerant job (drawn last: earlier draws of a seed stay what they were):
    2-3 replica groups of 1-2 ranks, its loader workers, saves and mix as drawn, no spike
    policy, no dropout (a group's masks follow its rank in the step's split, which
    changes when a group leaves or joins), and its own faults: a group killed (the others
    train on; restarted, it heals from a live peer), the lighthouse killed (every group
    stops in one line; the job is relaunched with a new one), the whole job killed, or
    SIGTERM to every rank of every group."""
    job = Job(ranks=rng.choice([1, 2]), workers=job.workers, async_mode=job.async_mode,
              mix=job.mix, dropout=0.0, groups=rng.choice([2, 3]))  # fmt: skip
    faults, at = [], 0
    for _ in range(rng.randint(1, 2)):
        at = rng.randint(at + 2, min(at + 5, STEPS - 2)) if at < STEPS - 3 else STEPS - 2
        kind = rng.choice(["group"] + WHOLE_JOB_FT_FAULTS)
        f = Fault(kind, at_step=at)
        if kind == "group":
            f.target = str(rng.randint(1, job.groups - 1))  # the lowest group saves: it lives
        elif kind == "term":
            f.seconds = rng.uniform(0, 0.5)
        faults.append(f)
    if rng.random() < 0.5:  # drawn last: the draws above stay what they were
        job.min_groups = job.groups
    for f in faults:  # a group's kill: after a step, inside its quorum, or inside its heal
        if f.kind == "group":
            f.moment = rng.choice(["step", "quorum", "heal"])
    return Trial(seed, job, [], faults)


# ---- the stratified trials ------------------------------------------------------------
# A defect is caught only by a trial that reaches the moment it spoils: a skip held in
# memory only, by a kill between a rewind and the next save (about 5 % of the draws);
# a lapsed lease's writes, by a store paused past its timeout. Every run of the campaign
# (the slow tier's included) starts with one trial of each class below, then fills its
# budget with drawn trials. Each is fixed but for what no guarded moment depends on (the
# loader workers, drawn from the run's seed), so a class is cited by its name.

# The properties a trial can catch a defect of (``guards``), each a class's own.
PROPERTIES = {
    "rewind-kill": "a rewind's skip is durable: a kill just after it, relaunched, keeps it",
    "save-kill": "a save is atomic: a rank killed in it leaves the previous checkpoint",
    "upload-kill": "an upload is atomic: the job killed in it leaves a bucket to resume from",
    "pause-requeue": "a lapsed lease writes nothing: a store paused past it, a requeued copy",
    "quorum-kill": "a replica group killed in its quorum heals from a peer, no step twice",
    "layout-change": "a life on another rank count reads every window once, SIGTERM first",
    "pp-plant": "a spike planted under PP fires and rewinds on both stages, killed after",
}


def stratum(name: str, seed: int) -> Trial:
    """The trial of class ``name`` (``PROPERTIES``) in the run of ``seed``."""
    workers = random.Random(f"{seed}/{name}").choice([0, 1, 2])
    kill_after_rewind = Fault("kill", "rewind", "job", 1)
    trials = {
        # A spike that fires once (its cause transient), the job killed as the rewind's
        # line is written, before the next save: the relaunch loads the checkpoint that
        # predates the skip, which only the rewind's record holds.
        "rewind-kill": (
            Job(ranks=1, workers=workers, spike="rewind"),
            [Plant(7, "x1000", False)],
            [kill_after_rewind],
        ),
        # One rank of two killed while the save of step 3 is written (a local folder,
        # sync saves); a NaN at step 2, armed in every life, dropped in each.
        "save-kill": (
            Job(ranks=2, workers=workers, spike="skip_step"),
            [Plant(2, "nan", True)],
            [Fault("kill", "save", "one", 3)],
        ),
        # The whole job killed while step 6 is uploaded to the bucket (async saves).
        "upload-kill": (
            Job(ranks=1, workers=workers, async_mode="async", bucket=True),
            [],
            [Fault("kill", "save", "job", 6)],
        ),
        # The store paused past the lease's timeout at step 2, then a requeued copy; the
        # oracle's lapse check reads every write the first life sent meanwhile.
        "pause-requeue": (
            Job(ranks=1, workers=workers, bucket=True),
            [],
            [Fault("store", "pause", at_step=2, seconds=LEASE_TIMEOUT_S * 2)],
        ),
        # Two groups, both needed for a commit: group 1 killed inside its quorum after
        # step 3, started again, healed from group 0.
        "quorum-kill": (
            Job(ranks=1, workers=workers, dropout=0.0, groups=2, min_groups=2),
            [],
            [Fault("group", "quorum", "1", 3)],
        ),
        # SIGTERM at step 4 (a preemption's save), the next life on 3 ranks.
        "layout-change": (
            Job(ranks=2, workers=workers, dropout=0.0),
            [],
            [
                Fault("term", at_step=4, seconds=0.3),
                Fault("layout", ranks=3, workers=workers, at_step=5),
            ],
        ),
        # PP 2: a spike at step 7 made on the last stage, rewound on both, then killed.
        "pp-plant": (
            Job(ranks=2, workers=workers, spike="rewind", layout="pp"),
            [Plant(7, "x1000", False)],
            [kill_after_rewind],
        ),
    }
    job, plants, faults = trials[name]
    return Trial(seed, job, plants, faults, name)


def strata(seed: int) -> list[Trial]:
    """One trial of every class, in ``PROPERTIES``' order."""
    return [stratum(name, seed) for name in PROPERTIES]


def guards(trial: Trial) -> set[str]:
    """The classes of ``PROPERTIES`` whose moment ``trial`` reaches: the features that
    let it catch their defect (read from the trial, not from its class name)."""
    job, faults, out = trial.job, trial.faults, set()
    once = [p for p in trial.plants if p.kind == "x1000" and not p.recurs]
    kills = [f for f in faults if f.kind == "kill"]
    rewinding = job.spike == "rewind" and once and not job.groups and job.log_freq == 1
    # The job (or its one rank) killed right after the rewind, in the first life: the
    # relaunch meets no spike and must keep the skip. A launcher killed alone may leave
    # its ranks to finish the run.
    after = faults[:1] and faults[0].kind == "kill" and faults[0].moment == "rewind"
    if rewinding and after and (faults[0].target == "job" or job.ranks == 1):
        out.add("pp-plant" if job.layout == "pp" else "rewind-kill")
    if any(f.moment == "save" for f in kills):
        out.add("upload-kill" if job.bucket else "save-kill")
    if job.bucket and any(f.kind == "store" and f.moment == "pause" for f in faults):
        out.add("pause-requeue")
    if job.groups and any(f.kind == "group" and f.moment == "quorum" for f in faults):
        out.add("quorum-kill")
    if any(f.kind == "layout" and f.ranks != job.ranks for f in faults[1:]):
        out.add("layout-change")
    return out


# ---- running a job ----------------------------------------------------------------------

# torchft's lines in a group's log where its rank 0 begins a quorum, and where a quorum
# found it behind (its heal from a peer follows): the "quorum" and "heal" moments.
QUORUM_LINE = "Start quorum for group_rank 0"
HEAL_LINE = "healing is required"


def _next_line(life: Life, text: str, timeout: float = 60.0) -> bool:
    """Wait until ``life``'s log holds one more line with ``text`` than now (False: the
    life ended or ``timeout`` passed first)."""
    with open(life.log, "rb") as f:
        f.seek(0, os.SEEK_END)  # what is written from now on (read as it comes)
        deadline, tail = time.monotonic() + timeout, b""
        while time.monotonic() < deadline and life.proc.poll() is None:
            tail = tail[-len(text) :] + f.read()
            if text.encode() in tail:
                return True
            time.sleep(0.002)
    return False


class LighthouseProcess:
    """torchft's lighthouse as a process of its own (``torchft_lighthouse``, in the
    wheel; ft_launch.py's settings), in a session of its own with no descriptor of ours:
    what a fault kills with SIGKILL. An in-process ``LighthouseServer``'s ``shutdown``
    keeps answering on the connections it has, so a trial that shut one down saw its
    groups train on to the end (the fault was inert)."""

    def __init__(self, log: Path):
        from torchtitan.tools.ft_launch import LIGHTHOUSE

        self.port = free_port()
        flags = [f"--{k}={v}" for k, v in LIGHTHOUSE.items()]
        binary = Path(sys.executable).parent / "torchft_lighthouse"
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(binary), f"--bind=[::]:{self.port}", *flags],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         close_fds=True)  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # listening: the groups' first request is answered
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                         timeout=1):  # fmt: skip
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.shutdown()
        raise RuntimeError(f"the lighthouse did not listen on port {self.port}: see {log}")

    def address(self) -> str:
        return f"http://{socket.gethostname()}:{self.port}"

    def shutdown(self):
        """SIGKILL, as a dead host; reaped."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def last_step(dump: Path) -> int:
    """The newest step of the job's timeline: the last line of rank 0's provenance (one a
    step, whatever ``log_freq``; trimmed on a resume and a rewind as the metrics are), or
    of the metrics where it has none yet."""
    for path in (dump / "provenance" / "rank0.jsonl", dump / "metrics.jsonl"):
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        for line in reversed(lines[-2:]):  # the last may be half written
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return json.loads(line)["step"]
    return 0


def _saving(dump: Path) -> bool:
    with contextlib.suppress(OSError):
        return any(e.name.endswith(".partial") for e in os.scandir(dump / "checkpoint"))
    return False


def _rewinds(dump: Path) -> int:
    with contextlib.suppress(OSError):
        return (dump / "spikes.jsonl").read_text().count('"kind": "rewind"')
    return 0


def _end_lives(lives: list, out) -> None:
    """Close every life's log; a process of any life still running a grace period after
    its launcher ended is a violation (and is killed)."""
    for life in lives:
        life.close()
        stray = life.left()
        if stray:
            out.violations.append(f"processes left behind: {stray}")
            for pid in stray:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _stopped_on_every_rank(life, ranks: int) -> bool:
    """Each of the life's ``ranks`` ranks said the max-rewinds stop, and nothing else, in
    its one error line."""
    errors = [ln for ln in life.output().splitlines() if "] error: " in ln]
    said = {ln.split("] error: ")[0] for ln in errors if STOP_LINE in ln}
    return len(said) == ranks and all(STOP_LINE in ln for ln in errors)


def _written_since(dump: Path, t: float) -> bool:
    for path in (dump / "provenance" / "rank0.jsonl", dump / "metrics.jsonl"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime > t:
                return True
    return False


class Life:
    """One launch of the job: its process, every pid it started, its log."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log, self.started = log, time.time()
        self.offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
        self.out = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.pids: set[int] = set()
        self.killed = False  # by the campaign (kill_all)
        self.tag = ""  # what its requests to the store say they come from (Runner._env)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._collect, daemon=True)
        self._watch.start()

    def _collect(self):
        while not self._stop.is_set() and self.proc.poll() is None:
            self.pids.update(_descendants(self.proc.pid))
            time.sleep(0.05)

    def output(self) -> str:
        """What this life wrote to the log."""
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def ranks(self) -> list[int]:
        return launcher_workers(self.proc.pid) or []

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        self._stop.set()
        self._watch.join()
        return code

    def stacks(self, settle_s: float = 3.0, frames: int = 8) -> str:
        """Every rank's threads, as train.py prints them on SIGUSR2 (faulthandler), each
        cut to its innermost ``frames``: where a life that did not exit hangs."""
        mark = self.log.stat().st_size
        ranks = self.ranks()
        for pid in ranks:  # one at a time, each under its own line
            with open(self.log, "ab") as f:
                f.write(f"--- the threads of rank process {pid}\n".encode())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
            time.sleep(settle_s / max(1, len(ranks)))
        with open(self.log, "rb") as f:
            f.seek(mark)
            text = f.read().decode(errors="replace")
        kept, depth = [], 0
        for line in text.splitlines():
            if line.startswith(("Thread 0x", "Current thread 0x")):
                kept.append(line)
                depth = 0
            elif line.startswith("  File ") and depth < frames:
                kept.append(line)
                depth += 1
            elif not line.startswith("  File "):
                kept.append(line)  # the job's own lines meanwhile
        return "\n".join(kept)

    def kill_all(self):
        self.killed = True
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def left(self, grace: float = EXIT_BOUND_S) -> list[int]:
        """Pids of this life still running ``grace`` seconds after the launcher ended."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            alive = [p for p in self.pids if _alive(p)]
            if not alive:
                return []
            time.sleep(0.1)
        return [p for p in self.pids if _alive(p)]

    def close(self):
        self.out.close()


@dataclass
class Outcome:
    lives: int = 0
    violations: list[str] = field(default_factory=list)
    moments: list[str] = field(default_factory=list)  # "kill/save", "term", "store/pause" ...
    reference: str = ""
    evidence: str = ""  # a hung life's stacks (each rank's threads), printed with its verdict
    stopped: bool = False  # the job stopped at a spike after MAX_REWINDS rewinds, as it must


class Runner:
    """Runs trials in ``root``; ``store`` is a (bucket, endpoint, traffic) of the loopback
    S3 server or None."""

    def __init__(self, root: Path, store=None, cache: Path | None = None):
        self.root, self.store = root, store
        self.cache = cache or root / "references"
        # (the life's tag, time.monotonic()) of each store pause's start in this trial
        self.paused: list[tuple[str, float]] = []

    # -- a life ---------------------------------------------------------------------------
    def _cmd(self, job: Job, dump: Path, ranks: int, workers: int, extra=()) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                f"--master_port={free_port()}", str(REPO_ROOT / "train.py"),
                *job.args(ranks, workers), "--job.dump_folder", str(dump),
                *self._folder(job, dump), *extra]  # fmt: skip

    def _folder(self, job: Job, dump: Path) -> list[str]:
        if not job.bucket:
            return []
        return ["--checkpoint.folder", f"s3://{self.store[0]}/{dump.name}"]

    def _env(self, plants: list[Plant], life: int, tag: str = "") -> dict:
        env = run_env()
        armed = [f"{p.step}:{p.kind}" for p in plants if p.recurs or life == 0]
        env[FAULT_ENV] = ",".join(armed)
        # botocore adds it to every request's User-Agent ("app/<tag>"): the store's log
        # then names the life that sent each write (Writes, _written_after_lapse).
        env[UA_ENV] = tag or f"life{life + 1}"
        return env

    # -- a trial --------------------------------------------------------------------------
    def run(self, trial: Trial) -> Outcome:
        if trial.job.groups:
            return self.run_groups(trial)
        out = Outcome()
        self.paused = []
        if self.store is not None and isinstance(self.store[2], Writes):
            self.store[2].writes.clear()
        job, dump = trial.job, self.root / trial.name
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir(parents=True)
        log = dump / "lives.log"
        ranks, workers, changed = job.ranks, job.workers, False
        pending, lives = list(trial.faults), []
        while True:
            if out.lives > len(trial.faults) + 3:
                out.violations.append(f"the job did not finish in {out.lives} lives")
                break
            f = pending.pop(0) if pending else None
            while f is not None and f.kind == "layout":  # this life on another layout
                if out.lives:
                    changed = changed or f.ranks != ranks
                    ranks, workers = f.ranks or ranks, f.workers
                    out.moments.append("layout")
                f = pending.pop(0) if pending else None
            life = Life(self._cmd(job, dump, ranks, workers),
                        self._env(trial.plants, out.lives), log)  # fmt: skip
            life.tag = f"life{out.lives + 1}"
            lives.append(life)
            out.lives += 1
            hit = f is not None and self._until(life, dump, job, f, LIFE_BOUND_S)
            if hit:
                out.moments.append(self._inject(f, life, dump, job, trial, out))
            bound = EXIT_BOUND_S if hit and f.kind in ("kill", "term") else LIFE_BOUND_S
            code = life.wait(bound)
            if code is None:
                out.evidence = life.stacks()
                life.kill_all()
                life.wait(10)
                what = f"after {f.kind}" if hit else "without a fault"
                out.violations.append(f"life {out.lives}: no exit within {bound:g}s {what}")
                break
            if hit and f.kind == "term" and "preempted at step" not in life.output():
                out.violations.append(f"life {out.lives}: SIGTERM did not stop it by preemption")
            if code == 0 and last_step(dump) >= STEPS:
                break
            if hit and f.kind in ("store", "double") and code and "error:" not in life.output():
                out.violations.append(f"life {out.lives}: exit {code} after {f.kind} without "
                                      "its one line")  # fmt: skip
            if code == 1 and _rewinds(dump) >= MAX_REWINDS and _stopped_on_every_rank(life, ranks):
                out.stopped = True  # judged below: the steps before the stop
                out.moments.append("stopped/max-rewinds")
                break
            if not hit and code != 0:
                out.violations.append(f"life {out.lives}: exit {code} without a fault")
                break
        _end_lives(lives, out)
        if not out.violations:
            out.violations += self.judge(trial, dump, changed, out)
        return out

    # -- a fault-tolerant job ----------------------------------------------------------
    def run_groups(self, trial: Trial) -> Outcome:
        """A job of replica groups: each life starts a lighthouse and every group; its
        fault lands when group 0 has logged the fault's step. After a group is killed the
        others must train on (group 0 logs 2 more steps) before it is started again, as
        a scheduler would, and heals; any other fault ends the life (a dead lighthouse
        stops every group in one line) and the job is launched again."""
        from torchtitan.tools.ft_launch import group_command

        out, job = Outcome(), trial.job
        dump = self.root / trial.name
        shutil.rmtree(dump, ignore_errors=True)
        dump.mkdir(parents=True)
        pending, lives = list(trial.faults), []
        args = job.args(job.ranks, job.workers)

        def start(g: int, address: str) -> Life:
            cmd = group_command(g, job.groups, job.ranks, address, dump, args)
            life = Life(cmd, run_env(), dump / f"group{g}.log")
            lives.append(life)
            return life

        while True:
            if out.lives > len(trial.faults) + 2:
                out.violations.append(f"the job did not finish in {out.lives} lives")
                break
            f = pending.pop(0) if pending else None
            server = LighthouseProcess(dump / f"lighthouse{out.lives + 1}.log")
            out.lives += 1
            groups = {g: start(g, server.address()) for g in range(job.groups)}
            first = dump / "replica_0"
            hit = f is not None and self._until_groups(groups, first, f.at_step)
            ended_by_fault = set()
            while hit:  # a group's death leaves the life going: the next group fault lands in it
                out.moments.append(self._inject_groups(f, groups, first, server, trial, start,
                                                       out))  # fmt: skip
                if f.kind != "group":
                    ended_by_fault = set(groups)
                    break
                if not pending or pending[0].kind != "group":
                    break
                f = pending.pop(0)
                hit = self._until_groups(groups, first, f.at_step)
            codes = {}
            for g, life in groups.items():
                bound = EXIT_BOUND_S if g in ended_by_fault else LIFE_BOUND_S
                codes[g] = life.wait(bound)
                if codes[g] is None:
                    out.evidence = life.stacks()
                    life.kill_all()
                    life.wait(10)
                    out.violations.append(f"life {out.lives}: group {g} did not exit within "
                                          f"{bound:g}s")  # fmt: skip
            server.shutdown()
            healed = sum("healed from a live peer" in life.output() for life in groups.values())
            out.moments += ["group/healed"] * healed
            if out.violations:
                break
            if hit and f.kind == "lighthouse":  # a group it stopped says so in one line
                silent = [g for g in groups if codes[g] and "error:" not in groups[g].output()]
                if silent:
                    out.violations.append(f"life {out.lives}: groups {silent} stopped after "
                                          "the lighthouse died without their one line")  # fmt: skip
            if hit and f.kind == "term" and not all(
                    "preempted at step" in groups[g].output() for g in groups):  # fmt: skip
                out.violations.append(f"life {out.lives}: SIGTERM did not stop every group by "
                                      "preemption")  # fmt: skip
            # Finished: every group exited 0 and one reached the last step (a group started
            # again after the others finished says so and has nothing to train).
            done = all(c == 0 for c in codes.values()) and any(
                last_step(dump / f"replica_{g}") >= STEPS for g in groups)  # fmt: skip
            if done:
                break
            if not hit and any(c != 0 for c in codes.values()):
                out.violations.append(f"life {out.lives}: exits {codes} without a fault")
                break
        _end_lives(lives, out)
        if not out.violations:
            out.violations += self.judge_groups(trial, dump, lives)
        return out

    def _until_groups(self, groups: dict, first: Path, at: int) -> bool:
        """Until any group has logged step ``at`` in this life (False: one ended first)."""
        deadline = time.monotonic() + LIFE_BOUND_S
        started = min(life.started for life in groups.values())
        folders = [first.parent / f"replica_{g}" for g in groups]
        while time.monotonic() < deadline and all(life.proc.poll() is None
                                                  for life in groups.values()):  # fmt: skip
            if any(_written_since(f, started) and last_step(f) >= at for f in folders):
                return True
            time.sleep(0.005)
        return False

    def _inject_groups(self, f: Fault, groups: dict, first: Path, server, trial: Trial, start,
                       out: Outcome) -> str:  # fmt: skip
        if f.kind == "group":
            g = int(f.target)
            killed = groups[g]
            where = "killed"
            if f.moment == "quorum":  # its next quorum has begun: killed inside it
                where = "killed-in-quorum" if _next_line(killed, QUORUM_LINE) else where
            killed.kill_all()
            killed.wait(EXIT_BOUND_S)
            # The others train on without it (2 more steps), then it starts again and heals;
            # with every group needed for a commit they wait for it: it starts at once.
            at, deadline = last_step(first), time.monotonic() + LIFE_BOUND_S
            more = 0 if trial.job.min_groups == trial.job.groups else 2
            while last_step(first) < min(at + more, STEPS) and groups[0].proc.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if groups[0].proc.poll() is not None:  # the job finished meanwhile
                return f"group/{where}-at-the-end"
            groups[g] = start(g, server.address())
            if f.moment == "heal" and _next_line(groups[g], HEAL_LINE):
                # Restarted, it is behind: killed while its heal runs, and started again.
                groups[g].kill_all()
                groups[g].wait(EXIT_BOUND_S)
                if groups[0].proc.poll() is not None:
                    return f"group/{where}-restarted-killed-in-heal-at-the-end"
                groups[g] = start(g, server.address())
                return f"group/{where}-restarted-killed-in-heal-restarted"
            return f"group/{where}-restarted"
        if f.kind == "lighthouse":
            server.shutdown()
            return "lighthouse"
        ranks = [pid for life in groups.values() for pid in life.ranks()]
        if f.kind == "kill":
            for life in groups.values():
                life.kill_all()
            return "kill/job"
        rng = random.Random(trial.seed + 1)  # term: every rank of every group, skewed
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            time.sleep(rng.uniform(0, f.seconds) / max(1, len(ranks) - 1))
        return "term"

    def judge_groups(self, trial: Trial, dump: Path, lives: list) -> list[str]:
        """A fault-tolerant job against the uninterrupted run of the same job without
        replica groups (1 rank, the same global batch): every committed step's windows
        exactly the reference's, over all groups' records, each token once; each group's
        losses within ``ELASTIC_REL`` (the participants of a step sum their gradients in
        another order, and a step trained while a group was away has fewer); no
        traceback; every group's lease released."""
        from torchtitan.records.provenance import check_exactly_once, read_job_provenance

        bad, job = [], trial.job
        killed = {pid for life in lives if life.killed for pid in life.pids}
        text = "".join(p.read_text(errors="replace") for p in sorted(dump.glob("group*.log")))
        raised = tracebacks(text)
        if raised:
            bad.append(f"a traceback in the job's output: {raised[0]}")
        plain = Job(**{**asdict(job), "groups": 0, "ranks": 1, "workers": 0,
                       "async_mode": "disabled"})  # fmt: skip
        ref = self.reference(plain, [], {})
        out_folders = sorted(dump.glob("replica_*"))
        job_provenance = read_job_provenance([str(f) for f in out_folders])
        merged: dict[int, list] = {}
        for steps in job_provenance.values():  # the committed steps' shares, tries included
            for step, seqs in steps.items():
                merged.setdefault(step, []).extend(map(json.dumps, seqs))
        merged = {k: sorted(v) for k, v in merged.items()}
        if merged != step_windows(ref):
            off = sorted(k for k in set(merged) | set(step_windows(ref))
                         if merged.get(k) != step_windows(ref).get(k))  # fmt: skip
            bad.append(f"the windows of steps {off[:6]} differ from the reference's")
        reports = check_exactly_once(job_provenance)
        twice = {k: r.duplicate_tokens for k, r in reports.items() if r.duplicate_tokens}
        if twice:
            bad.append(f"tokens read twice: {twice}")
        want = read_losses(ref)
        for folder in out_folders:
            # A group killed before its first log line, whose restart found the job
            # finished, logged nothing.
            got = read_losses(folder) if (folder / "metrics.jsonl").exists() else {}
            far = [s for s in got if s not in want or not _close(got[s], want[s])]
            if far:
                bad.append(f"{folder.name}: losses beyond {ELASTIC_REL} at steps {far[:6]}")
            lease = folder / "checkpoint" / "lease.json"
            with contextlib.suppress(OSError, ValueError):
                holder = json.loads(lease.read_text())["pid"]
                # A group the campaign killed cannot release its lease: the next holder
                # takes it over (its process is gone); any other lease left is a leak.
                if holder not in killed:
                    bad.append(f"{folder.name}: the lease of pid {holder} was not released")
        return bad

    def _until(self, life: Life, dump: Path, job: Job, f: Fault, timeout: float) -> bool:
        """Wait for the fault's moment; False if the life ended first."""
        deadline = time.monotonic() + timeout
        rng = random.Random(f.at_step)
        rewinds = _rewinds(dump)
        if f.kind == "double":  # a double requeue: both copies start together
            return True
        while life.proc.poll() is None and time.monotonic() < deadline:
            # Only what this life wrote: a relaunch starts with its predecessor's lines.
            step = last_step(dump) if _written_since(dump, life.started) else -1
            if f.moment == "rewind":
                if _rewinds(dump) > rewinds:
                    return True
            elif f.kind == "kill" and f.moment == "save":
                if _saving(dump) and step >= f.at_step - 1:
                    return True
                # A save a store writes (or one too quick to see): just after a saved step,
                # while its (async) upload runs.
                if step >= f.at_step and step % INTERVAL == 0:
                    time.sleep(rng.uniform(0, 0.15))
                    return True
            elif step >= f.at_step:
                return True
            time.sleep(0.002)
        return False

    def _inject(self, f: Fault, life: Life, dump: Path, job: Job, trial: Trial, out) -> str:
        if f.kind == "kill":
            ranks = life.ranks()
            if f.target == "one" and ranks:
                targets = [random.Random(trial.seed).choice(ranks)]
            elif f.target == "launcher":
                targets = [life.proc.pid]
            else:
                targets = [*_descendants(life.proc.pid), life.proc.pid]
            during = "save" if _saving(dump) else f.moment
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return f"kill/{f.target}/{during}"
        if f.kind == "term":
            ranks = life.ranks()
            rng = random.Random(trial.seed + 1)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                time.sleep(rng.uniform(0, f.seconds) / max(1, len(ranks) - 1))
            return "term"
        if f.kind == "store":
            self._store_fault(f)
            if f.moment == "pause":  # past the lease's timeout, then a scheduler's requeue
                self.paused.append((life.tag, time.monotonic()))
                time.sleep(f.seconds)
                return "store/pause/" + self._twin(life, dump, job, trial, out)
            return f"store/{f.moment}"
        if f.kind == "double":
            return "double/" + self._twin(life, dump, job, trial, out)
        return f.kind

    def _twin(self, life: Life, dump: Path, job: Job, trial: Trial, out) -> str:
        """A second copy of the job started while the first may live; it must wait out
        the lease and stop in one line, or (the first gone) resume and finish."""
        cmd = self._cmd(job, dump, len(life.ranks()) or job.ranks, job.workers,
                        ["--checkpoint.lease_wait_seconds", "3"])  # fmt: skip
        twin = Life(cmd, self._env(trial.plants, 1, "twin"), dump / "twin.log")
        code = twin.wait(LIFE_BOUND_S)
        twin.close()
        text = _tail(dump / "twin.log")
        if code is None:
            twin.kill_all()
            out.violations.append("the second copy did not exit")
        elif code != 0 and "in use by another job" not in text:
            out.violations.append(f"the second copy exited {code} without the lease's line")
        if tracebacks(text):
            out.violations.append(f"the second copy printed a traceback: {tracebacks(text)[0]}")
        stray = twin.left()
        if stray:
            out.violations.append(f"the second copy left processes: {stray}")
        return "waited-out" if code != 0 else "took-over"

    def _store_fault(self, f: Fault):
        traffic = self.store[2]
        with traffic.lock:
            if f.moment == "503":
                traffic.fail_kinds = ("GET", "GET range", "PUT", "HEAD", "POST", "DELETE")
                traffic.fail_status, traffic.fail_next = 503, 12
            elif f.moment == "reset":
                traffic.fail_kinds = ("GET", "GET range", "PUT", "HEAD", "POST", "DELETE")
                traffic.fail_status, traffic.fail_next = 0, 6
            else:  # slow, pause, restart: every request held (a restart: refused) a while
                traffic.hold = (f.moment, time.monotonic() + f.seconds)

    # -- the oracle -----------------------------------------------------------------------
    def judge(self, trial: Trial, dump: Path, changed: bool, out: Outcome) -> list[str]:
        bad = []
        raised = tracebacks((dump / "lives.log").read_text(errors="replace"))
        if raised:
            bad.append(f"a traceback in the job's output: {raised[0]}")
        skips = applied_skips(dump, self.checkpoint_listing(trial.job, dump))
        dropped = dropped_steps(dump, trial.job, trial.plants)
        ref = self.reference(trial.job, skips, dropped)
        out.reference = str(ref)
        got, want = read_losses(dump), read_losses(ref)
        if out.stopped:  # the run's steps are the reference's first ones
            want = {k: v for k, v in want.items() if k <= max(got, default=0)}
        if sorted(got) != sorted(want):
            bad.append(f"steps logged {sorted(got)} against the reference's {sorted(want)}")
        elif changed:
            far = [s for s in want if not _close(got[s], want[s])]
            if far:
                bad.append(f"losses beyond {ELASTIC_REL} at steps {far}")
        else:
            # mutant loss-tolerance: `_same(` -> `_close(`; test/test_campaign.py::test_the_judge_fails_a_fixed_layout_loss_one_part_in_a_million_off
            off = [s for s in want if not _same(got[s], want[s])]
            if off:
                bad.append(f"losses differ at steps {off}")
        if sorted(got) == sorted(want) and not changed and not out.stopped:
            final = self.final_tensors(trial.job, dump)
            expected = self.final_tensors(Job(), ref)
            if final.keys() != expected.keys():
                bad.append("the final checkpoint holds other entries than the reference's")
            else:
                import torch

                diff = [k for k in final if not torch.equal(final[k], expected[k])]
                if diff:
                    bad.append(f"final checkpoint tensors differ: {diff[:4]}")
        # Exactly once: every step read the reference's windows (the reference passed over
        # the same skips from its command line), no token twice, and, where nothing was
        # skipped, every document of a finished pass read whole.
        windows, ref_windows = step_windows(dump), step_windows(ref)
        if out.stopped:
            ref_windows = {k: v for k, v in ref_windows.items() if k in windows}
        # mutant no-windows: `windows != ref_windows` -> `False`; test/test_campaign.py::test_the_judge_fails_a_step_that_read_another_window
        if windows != ref_windows:
            bad.append("the windows of some step differ from the reference's")
        twice = _read_twice(dump)
        if twice:
            bad.append(f"tokens read twice: {twice}")
        if not skips and not out.stopped and _provenance_problem(dump, trial.job):
            bad.append("provenance: not every token once")
        bad += self.leftovers(trial.job, dump)
        bad += self.written_after_lapse(dump)
        return bad

    def written_after_lapse(self, dump: Path) -> list[str]:
        """Writes that a life whose store was paused sent under the trial's prefix more
        than ``LEASE_TIMEOUT_S`` into the pause: its lease had lapsed by then (its
        deadline is its last renewal sent, at the latest the pause's start, plus the
        timeout less a margin of two heartbeats), so every write path must have refused
        them. The other ranks' data files are not asked (lease.py: they hold no lease)."""
        if not self.paused or not isinstance(self.store[2], Writes):
            return []
        traffic, prefix = self.store[2], f"/{self.store[0]}/{dump.name}/"
        with traffic.lock:
            writes = list(traffic.writes)
        mine = [w for w in writes if w[3].startswith(prefix)]
        with open(dump / "store_writes.jsonl", "w") as f:  # the evidence, seconds into the pause
            for t, who, method, path in mine:
                f.write(json.dumps([round(t - self.paused[0][1], 3), who, method, path]) + "\n")
        bad = []
        for tag, began in self.paused:
            late = sorted({path[len(prefix):] for t, who, _, path in writes
                           if who == tag and t > began + LEASE_TIMEOUT_S
                           and path.startswith(prefix) and not _other_ranks_file(path)})  # fmt: skip
            if late:
                bad.append(f"{tag} wrote {late[:4]} after its lease lapsed (the store paused)")
        return bad

    def checkpoint_listing(self, job: Job, dump: Path) -> Path:
        """The checkpoint folder, locally (a bucket's copied down once judged)."""
        if not job.bucket:
            return dump / "checkpoint"
        import s3fs

        local = dump / "from-bucket"
        if not local.exists():
            s3fs.S3FileSystem(skip_instance_cache=True).get(
                f"{self.store[0]}/{dump.name}/", str(local), recursive=True
            )
        return local

    def final_tensors(self, job: Job, dump: Path) -> dict:
        folder = self.checkpoint_listing(job, dump)
        return read_tensors(folder / f"step-{STEPS}")

    def leftovers(self, job: Job, dump: Path) -> list[str]:
        bad = []
        if not job.bucket:
            if (dump / "checkpoint" / "lease.json").exists():
                bad.append("the lease was not released")
            return bad
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.store[1])
        bucket, prefix = self.store[0], f"{dump.name}/"
        with contextlib.suppress(Exception):
            s3.head_object(Bucket=bucket, Key=f"{prefix}lease.json")
            bad.append("the lease was not released")
        uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        if uploads:
            bad.append(f"{len(uploads)} unfinished multipart uploads left in the bucket")
        return bad

    def reference_folder(self, job: Job, skips: list, dropped: dict) -> tuple[Job, Path]:
        """The job the reference runs and its folder in the cache, named by what decides
        it. Workers, async saves, the local tier and the bucket must change no bit: the
        reference runs without them (0 workers, sync, one local folder)."""
        plain = Job(**{**asdict(job), "bucket": False, "workers": 0, "async_mode": "disabled",
                       "local_tier": False})  # fmt: skip
        key = hashlib.sha256(json.dumps([asdict(plain), skips, sorted(dropped.items())],
                                        sort_keys=True).encode()).hexdigest()[:16]  # fmt: skip
        return plain, self.cache / key

    def reference(self, job: Job, skips: list, dropped: dict) -> Path:
        """The uninterrupted run of ``job`` (local folder) with ``skips`` applied and the
        ``dropped`` steps' faults planted: cached by what decides it."""
        plain, ref = self.reference_folder(job, skips, dropped)
        if (ref / "done").exists():
            return ref
        shutil.rmtree(ref, ignore_errors=True)
        ref.mkdir(parents=True)
        extra = []
        if skips:
            extra += ["--training.skip_steps", ",".join(f"{a}-{a + n - 1}" for a, n in skips)]
        env = run_env()
        env[FAULT_ENV] = ",".join(f"{s}:{k}" for s, k in sorted(dropped.items()))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={plain.ranks}",
               f"--master_port={free_port()}", str(REPO_ROOT / "train.py"),
               *plain.args(plain.ranks, plain.workers), "--job.dump_folder", str(ref), *extra]  # fmt: skip
        life = Life(cmd, env, ref / "lives.log")
        code = life.wait(LIFE_BOUND_S)
        life.close()
        if code != 0:
            raise RuntimeError(f"the reference run failed (exit {code}); see {ref}/lives.log")
        (ref / "done").write_text("")
        return ref


UA_ENV = "AWS_SDK_UA_APP_ID"  # botocore's: "app/<value>" in every request's User-Agent


@dataclass
class Writes(s3.Traffic):
    """The loopback store's traffic, with every write request as it arrives (before a
    pause holds it): (time.monotonic(), the sender's tag (``UA_ENV``), method, path)."""

    writes: list = field(default_factory=list)

    def wrap(self, app):
        counted = super().wrap(app)

        def logged(environ, start_response):
            method = environ["REQUEST_METHOD"]
            if method in ("PUT", "POST", "DELETE"):
                agent = environ.get("HTTP_USER_AGENT", "")
                who = next((w[4:] for w in agent.split() if w.startswith("app/")), "")
                with self.lock:
                    self.writes.append((time.monotonic(), who, method,
                                        environ.get("PATH_INFO", "")))  # fmt: skip
            return counted(environ, start_response)

        return logged


def _other_ranks_file(path: str) -> bool:
    """A DCP data file of a rank but 0 (``__<rank>_<i>.distcp``)."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith("__") and not name.startswith("__0_") and name[2:3].isdigit()


# torchrun's own report of a rank that a fault killed: the launcher's, not the job's.
_LAUNCHER_REPORT = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def tracebacks(text: str) -> list[str]:
    """The last line (the exception) of every traceback in ``text`` but torchrun's report
    of a rank that a fault killed."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        prefix = line.split("Traceback")[0]  # "[rank1]:" where torchrun tags a rank's lines
        j = i + 1
        while j < len(lines) and lines[j].startswith(prefix + " "):
            j += 1
        last = lines[j] if j < len(lines) else ""
        if _LAUNCHER_REPORT not in last:
            out.append(last.strip()[:200])
    return out


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")
    except OSError:
        return ""


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _close(a: float, b: float) -> bool:
    return _same(a, b) or math.isclose(a, b, rel_tol=ELASTIC_REL, abs_tol=0.0)


def read_losses(dump: Path) -> dict[int, float]:
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


def applied_skips(dump: Path, checkpoint: Path) -> list:
    """The skips the records say were applied: every rewind's, from its event and from its
    durable record (``[first, steps]``, each once)."""
    found = set()
    with contextlib.suppress(OSError):
        for line in (dump / "spikes.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e.get("kind") == "rewind":
                found.add(tuple(e["skip_steps"]))
    with contextlib.suppress(OSError):
        for p in (checkpoint / "rewinds").iterdir():
            found.add(tuple(json.loads(p.read_text())["skip"]))
    return sorted(list(s) for s in found)


def dropped_steps(dump: Path, job: Job, plants: list[Plant] = ()) -> dict[int, str]:
    """The steps the final timeline dropped ({step: the fault that makes the reference drop
    it}), read from the loss each step logged: not finite (a broken step), or past the
    spike bound under skip_step. (Not from the guard's counters: they outlive a rewind,
    so a step retaken after one would carry an earlier step's count.) Where not every
    step logs (``log_freq`` > 1), from the plants, which then recur in every life: each
    planted step is trained in the final timeline with its fault armed (``draw`` plants
    no NaN in such a job that rewinds: a rewind retakes a step in the process whose plant
    has fired)."""
    if job.log_freq > 1:
        return {p.step: p.kind for p in plants if p.kind == "nan" or job.spike == "skip_step"}
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if not math.isfinite(r["loss"]):
            out[r["step"]] = "nan"
        elif job.spike == "skip_step" and r["loss"] > SPIKE_LOSS:
            out[r["step"]] = "x1000"
    return out


def step_windows(dump: Path) -> dict:
    from torchtitan.records.provenance import read_provenance, sequences_by_step

    by_step = sequences_by_step(read_provenance(dump / "provenance"))
    return {s: sorted(map(json.dumps, v)) for s, v in by_step.items()}


def _read_twice(dump: Path) -> dict:
    from torchtitan.records.provenance import check_exactly_once, read_provenance

    reports = check_exactly_once(read_provenance(dump / "provenance"))
    return {s: r.duplicate_tokens for s, r in reports.items() if r.duplicate_tokens}


def _provenance_problem(dump: Path, job: Job) -> bool:
    from torchtitan.tools.check_provenance import main as check_provenance

    args = [
        str(dump / "provenance"),
        "--job.config_file",
        DEBUG_CONFIG,
        *job.args(job.ranks, job.workers)[2:],
    ]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        return check_provenance(args) != 0


def read_tensors(step_dir: Path) -> dict:
    """The model's, the optimizer's and the schedule's tensors of a checkpoint, in this
    process (the loader's entry names the layout it was written on: the provenance and
    the losses judge the data)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan.checkpoint.store import store_for

    store = store_for(str(step_dir))
    metadata = store.reader(str(step_dir)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, dcp.TensorStorageMetadata)
             and k.split(".")[0] in ("model", "optimizer", "lr_scheduler")}  # fmt: skip
    dcp.load(state, checkpoint_id=str(step_dir), storage_reader=store.reader(str(step_dir)),
             no_dist=True)  # fmt: skip
    return state


def replay_command(trial: Trial) -> str:
    return f"python scripts/campaigns/campaign.py --replay '{trial.to_json()}'"
