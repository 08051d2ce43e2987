"""Training metrics: what a step reports, on the console, in JSONL and TensorBoard, and
the data provenance.

Owns: the per-step values (``StepMetrics``: loss over ranks, grad norm, LR,
throughput, MFU, data wait, memory; from the data position, which every rank shares,
skipped documents, tokens per source and passes begun; the held-out loss the loop
measured), formatting and writing them. Rank 0 writes the JSONL file and TensorBoard
events; the first rank of each tensor-parallel group (on the first pipeline stage) writes the provenance of its
data-parallel rank (TP peers train on the same data). On resume, lines of steps after
the resumed step (left by the interrupted run) are dropped, so the files always
describe the run as it finally counts.

Cost: on a log step, one read of the device (``StepMetrics.read``: every logged device
value, the guard's verdict included, stacked: one copy, a sync on a GPU) and one small
gather to rank 0 (``across_ranks``); nothing on other steps but the provenance line.

Never: compute losses, pull batches, run validation, count the tokens seen or decide
when to stop (the loop in ``train.py`` does).
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource

import torch

from torchtitan import parallel
from torchtitan.models import llama

logger = logging.getLogger("torchtitan")

# Dense bf16 peak TFLOP/s of one device, from the vendor datasheets (half the
# with-sparsity figure where only that is given), keyed by the model tokens of
# torch.cuda.get_device_name(): "NVIDIA A100-SXM4-80GB" has the tokens NVIDIA, A100,
# SXM4, 80GB. Tokens match whole, so an L40 is not an L4 and an RTX A1000 not an A100;
# the key with the most tokens wins, so an H100 NVL or PCIe is not read as the SXM part
# that a bare H100 names.
PEAK_BF16_TFLOPS = {
    ("H100",): 989.5,  # SXM5, which reports itself as "H100 80GB HBM3"
    ("H100", "PCIE"): 756.0,
    ("H100", "NVL"): 835.5,
    ("H200",): 989.5,
    ("H200", "NVL"): 835.5,
    ("GH200",): 989.5,
    ("A100",): 312.0,  # SXM4 and PCIe alike
    ("A10",): 125.0,
    ("A10G",): 125.0,
    ("L40S",): 362.05,
    ("L40",): 181.05,
    ("L4",): 121.0,
}


def peak_tflops(cfg, device: torch.device) -> float:
    """metrics.peak_tflops, else the known figure of this GPU; 0 when unknown (no MFU)."""
    if cfg.metrics.peak_tflops > 0:
        return cfg.metrics.peak_tflops
    if device.type != "cuda":
        return 0.0
    return device_peak_tflops(torch.cuda.get_device_name(device))


def device_peak_tflops(name: str) -> float:
    """The PEAK_BF16_TFLOPS entry of the most specific key all of whose tokens are in
    ``name``; 0 for a device not in the table."""
    tokens = set(re.split(r"[\s_-]+", name.upper()))
    keys = [key for key in PEAK_BF16_TFLOPS if tokens.issuperset(key)]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] if keys else 0.0


def _record(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None  # a line cut short by a kill mid-write


def _step_of(line: str) -> int | None:
    record = _record(line)
    return None if record is None else record.get("step", 0)


def _segments(lineage: list) -> dict[str, list[tuple[int, float]]]:
    """{branch: [(first step, end step, exclusive)]} of a lineage's segments."""
    out: dict[str, list[tuple[int, float]]] = {}
    for i, (name, first) in enumerate(lineage):
        end = lineage[i + 1][1] if i + 1 < len(lineage) else float("inf")
        out.setdefault(name, []).append((first, end))
    return out


def on_lineage(lineage: list | None, branch: str | None, step: int, segments=None) -> bool:
    """Whether a record line of ``step`` written on ``branch`` is on the timeline
    ``lineage`` (``TrainState.lineage``: ``[branch, first step]`` segments): its branch's
    segment holds the step. A line without a branch, or no lineage, is kept (records
    and checkpoints from before lineages). ``segments``: ``_segments(lineage)``, made
    once for many lines (a lookup a line, whatever the lineage's length)."""
    if not lineage or branch is None:
        return True
    spans = (segments if segments is not None else _segments(lineage)).get(branch, ())
    return any(first <= step < end for first, end in spans)


def truncate_jsonl_after(path: str, step: int, lineage: list | None = None):
    """Keep only the complete lines of a JSONL file whose ``step`` is at most ``step`` and,
    with ``lineage``, whose branch is on it (``on_lineage``). Cost: one pass over the
    file, a lookup a line."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    segments = _segments(lineage) if lineage else None
    kept = []
    for line in lines:
        record = _record(line) if line.endswith("\n") else None  # parsed once a line
        if record is None or record.get("step", 0) > step:
            continue
        if not lineage or on_lineage(lineage, record.get("branch"), record.get("step", 0),
                                     segments):  # fmt: skip
            kept.append(line)
    if kept != lines:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)


def move_jsonl_after(path: str, step: int, to: str, **tag):
    """The lines of ``path`` after ``step`` move to the end of ``to``, each with ``tag``
    (a rewind: the steps it undid); lines of ``to`` with the same tag values go first, so
    the same rewind run again (a requeue) leaves each line once. Written whole (a
    temporary file, then a rename): a kill leaves the old file or the new one."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.endswith("\n")]
    moved = []
    for line in lines:
        step_of = _step_of(line)
        if step_of is not None and step_of > step:
            moved.append(json.dumps({**json.loads(line), **tag}) + "\n")
    if not moved:
        return
    kept_before = []
    if os.path.exists(to):
        with open(to) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if any(record.get(k) != v for k, v in tag.items()):
                    kept_before.append(line)
    tmp = to + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept_before + moved)
    os.replace(tmp, to)
    truncate_jsonl_after(path, step)


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def passes_begun(epoch_starts: list) -> str:
    """``[step, source, pass]`` events as one line, a range per source ("passes 31-45 of
    few began at steps 7-9"): a small source at a high weight begins many per step."""
    by_source: dict[str, list] = {}
    for at, source, e in epoch_starts:
        by_source.setdefault(source, []).append((at, e))
    parts = []
    for source, events in by_source.items():
        (s0, e0), (s1, e1) = events[0], events[-1]
        passes = f"pass {e0}" if e0 == e1 else f"passes {e0}-{e1}"
        steps = f"step {s0}" if s0 == s1 else f"steps {s0}-{s1}"
        parts.append(f"{passes} of {source} began at {steps}")
    return "; ".join(parts)


# Keys of the cumulative tokens read from each source (``source_tokens/<name>``), the
# source's weight in the step (``mix_weight/<name>``, normalized), its pass in progress
# (``source_pass/<name>``) and the share of that pass read (``source_read/<name>``).
SOURCE_TOKENS = "source_tokens/"
MIX_WEIGHT, SOURCE_PASS, SOURCE_READ = "mix_weight/", "source_pass/", "source_read/"
# A mixture of experts: each MoE layer's largest expert load over the mean
# (``expert_load_max_mean/<layer>``, 1.0 is even) and, under EXPERT_LOADS, the step's
# tokens per expert, [layer][expert], over all ranks (plot_expert_load.py draws it).
EXPERT_LOAD_MAX_MEAN, EXPERT_LOADS = "expert_load_max_mean/", "expert_loads"


def expert_load_values(loads: torch.Tensor | None) -> dict:
    """The last step's expert loads (read to the host: [layers, experts]) as metrics (none
    for a dense model)."""
    if loads is None:
        return {}
    mean = loads.double().mean(-1).clamp(min=1e-12)
    ratio = (loads.double().max(-1).values / mean).tolist()
    values = {f"{EXPERT_LOAD_MAX_MEAN}{i}": r for i, r in enumerate(ratio)}
    values[EXPERT_LOADS] = loads.tolist()
    return values


class MetricLogger:
    """Console line on rank 0 every ``log_freq`` steps, the same values to JSONL and TensorBoard."""

    def __init__(self, cfg, rank: int, start_step: int, lineage: list | None = None,
                 trim: bool = True):  # fmt: skip
        self.rank = rank
        self.log_freq = cfg.metrics.log_freq
        self.jsonl_path = cfg.jsonl_path() if rank == 0 else None
        self.tb = None
        self.wandb = None
        self._skipped_seen = 0  # skipped documents the console has reported
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)
            if trim:  # otherwise ``trim`` is called once the state trained from is known
                self.trim(start_step, lineage)
            if cfg.metrics.enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                folder = os.path.join(cfg.job.dump_folder, cfg.metrics.tensorboard_folder)
                self.tb = SummaryWriter(folder, purge_step=start_step + 1)
            if cfg.metrics.enable_wandb:
                self.wandb = _start_wandb(cfg)

    def trim(self, step: int, lineage: list | None):
        """Rank 0: keep the lines of steps up to ``step`` on ``lineage`` (the file is
        opened for each line written: nothing to reopen)."""
        if self.rank == 0:
            truncate_jsonl_after(self.jsonl_path, step, lineage)

    def should_log(self, step: int, last_step: int) -> bool:
        return step % self.log_freq == 0 or step == last_step or step == 1

    def log(self, step: int, values: dict, epoch_starts: list | None = None):
        """One step's values; ``epoch_starts`` lists ``[step, source, pass]`` of every pass
        over a source's documents begun since the last log line (said in one line)."""
        if self.rank != 0:
            return
        if epoch_starts:
            logger.info("step %d: %s", step, passes_begun(epoch_starts))
        stage = f" stage {values['slowest_stage']}" if "slowest_stage" in values else ""
        logger.info(
            "step %5d  loss %.4f  grad_norm %.4f  lr %.2e  tok/s %.0f  step %.1fms (median %.1f, "
            "max %.1f rank %d%s)  data %.1fms (max %.1f)  mem %.2fGiB",
            step, values["loss"], values["grad_norm"], values["lr"], values["tokens_per_s"],
            values["step_ms"], values.get("step_ms_median", values["step_ms"]),
            values.get("step_ms_max", values["step_ms"]), values.get("slowest_rank", 0), stage,
            values["data_wait_ms"], values.get("data_wait_ms_max", values["data_wait_ms"]),
            values["memory_gib"],
        )  # fmt: skip
        skipped = values.get("skipped_documents", 0)
        if skipped > self._skipped_seen:  # said on the console, not only in the JSONL
            logger.warning(
                "step %d: %d documents skipped so far (%d since the last line): empty, null, "
                "non-string or undecodable text; --training.bad_data error stops at the first",
                step, skipped, skipped - self._skipped_seen,
            )  # fmt: skip
            self._skipped_seen = skipped
        shares = {
            k[len(SOURCE_TOKENS) :]: v for k, v in values.items() if k.startswith(SOURCE_TOKENS)
        }
        if len(shares) > 1:
            total = sum(shares.values()) or 1
            logger.info("step %5d  tokens by source: %s", step, "  ".join(
                f"{name} {n} ({100 * n / total:.1f}%)" for name, n in shares.items()))  # fmt: skip
        balance = [v for k, v in values.items() if k.startswith(EXPERT_LOAD_MAX_MEAN)]
        if balance:  # a mixture of experts: how far each layer's busiest expert is above the mean
            logger.info("step %5d  expert load max/mean by layer: %s", step,
                        " ".join(f"{v:.2f}" for v in balance))  # fmt: skip
        extra = [f"{k} {values[k]:.4f}" for k in ("mfu_pct", "validation_loss") if k in values]
        if extra:
            logger.info("step %5d  %s", step, "  ".join(extra))
        # json writes a float with repr(), so the loss reads back bit-exact.
        record = {"step": step, **values}
        if epoch_starts:
            record["epoch_starts"] = epoch_starts
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):  # not expert_loads' table
                    self.tb.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            numbers = {f"train/{k}": v for k, v in values.items() if isinstance(v, int | float)}
            self.wandb.log(numbers, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
            import wandb

            # Its service process would otherwise outlive training until the interpreter
            # exits (train.main run in-process: a notebook, the tests); a later run
            # starts a new one.
            wandb.teardown()


def _start_wandb(cfg):
    """A W&B run whose id is the dump folder's, so a resumed job continues the same run.

    Project from ``WANDB_PROJECT`` (default ``torchtitan``); ``WANDB_MODE=offline`` writes
    the run under ``<dump_folder>/wandb`` for a later ``wandb sync``.
    """
    import hashlib

    import wandb

    folder = os.path.abspath(cfg.job.dump_folder)
    run_id = hashlib.sha256(folder.encode()).hexdigest()[:16]
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "torchtitan"),
        id=run_id,
        resume="allow",
        dir=folder,
        name=os.path.basename(folder),
        config=cfg.to_dict(),
    )


def across_ranks(dims, loss, step_ms: float, data_wait_ms: float) -> dict:
    """What a log line says of all ranks, combined on rank 0 in one gather on the control
    group (it replaces a mean and a gather): the mean loss, the slowest rank's step
    time against the median (and, under pipeline parallelism, its stage), the longest
    data wait. Other ranks get {}. Cost: one small
    message per rank per log line, none on other steps (a straggler shows on the line
    after it slowed). What the data position says (skipped documents, passes begun,
    tokens per source) is the same on every rank: rank 0's own."""
    mine = [(dims.rank, float(loss), step_ms, data_wait_ms)]
    every = sorted(parallel.gather_to_main(dims, mine), key=lambda r: r[0])
    if not every:
        return {}
    times = sorted(r[2] for r in every)
    slowest = max(every, key=lambda r: (r[2], -r[0]))
    stage = {}
    if getattr(dims, "pp", 1) > 1:  # the pipeline stage the straggler runs
        stage["slowest_stage"] = slowest[0] // (dims.world_size // dims.pp)
    return {
        "loss": sum(r[1] for r in every) / len(every),
        "step_ms_median": times[len(times) // 2]
        if len(times) % 2
        else sum(times[len(times) // 2 - 1 : len(times) // 2 + 1]) / 2,
        "step_ms_max": slowest[2],
        "slowest_rank": slowest[0],
        "data_wait_ms_max": max(r[3] for r in every),
        **stage,
    }


# The skips passed over (training.skip_steps, a rewind's), beside the rank files.
SKIPS = "skips.jsonl"


def _rank_of(name: str) -> int | None:
    """The data-parallel rank of a provenance file named ``rank<r>.jsonl`` or
    ``tried_rank<r>.jsonl`` (None: another file)."""
    for prefix in ("rank", "tried_rank"):
        number = name[len(prefix) : -len(".jsonl")]
        if name.startswith(prefix) and name.endswith(".jsonl") and number.isdigit():
            return int(number)
    return None


class ProvenanceWriter:
    """Per rank, one JSON line per step: for each sequence, its spans ``[source, doc_id, start, end, epoch, unit]`` (provenance.py reads them)."""

    def __init__(self, folder: str, rank: int, start_step: int, is_main: bool,
                 lineage: list | None = None, writers: int | None = None):  # fmt: skip
        """``writers``: None, rank 0 trims every file now (the loop's barrier follows);
        otherwise the number of data-parallel ranks writing now, and every file waits for
        ``trim_own`` (a replica group: the state it trains from is known at its first
        commit, a heal included)."""
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        self.is_main = is_main  # the one rank that writes (and trims) skips.jsonl
        self._writers = writers
        self._file = None
        if is_main:
            os.makedirs(folder, exist_ok=True)
            if writers is None:
                self._trim_shared(start_step, lineage, 0)

    def _trim_shared(self, step: int, lineage: list | None, first_rank: int):
        """Rank 0: the files of ranks from ``first_rank`` on (ranks of an old, larger
        layout among them) and ``skips.jsonl``, to the timeline of ``step``."""
        folder = os.path.dirname(self.path)
        for name in sorted(os.listdir(folder)):
            number = _rank_of(name)
            if number is not None and number >= first_rank:
                truncate_jsonl_after(os.path.join(folder, name), step, lineage)
        truncate_jsonl_after(os.path.join(folder, SKIPS), step)

    def trim_own(self, step: int, lineage: list | None):
        """This rank's file (closed first, opened again at the next line), and on rank 0
        ``skips.jsonl`` and the files of ranks of an old, larger layout (nobody writes
        them now), to the timeline of ``step`` on ``lineage``. Cost: one pass over the
        rank's file (rank 0: and the old layout's), paid at a replica group's first
        commit."""
        self.close()
        self._file = None
        truncate_jsonl_after(self.path, step, lineage)
        if self.is_main:
            self._trim_shared(step, lineage, self._writers or 0)

    def rewind(self, step: int, number: int):
        """Rewind ``number`` went back to ``step``: the lines after it move to
        ``rewound_rank<r>.jsonl`` (each with ``"rewind": number``): the documents it skipped."""
        self.close()
        self._file = None
        folder, name = os.path.split(self.path)
        move_jsonl_after(self.path, step, os.path.join(folder, "rewound_" + name), rewind=number)
        if self.is_main:  # its one writer: ranks trimming it at once crossed their renames
            truncate_jsonl_after(os.path.join(folder, SKIPS), step)  # passed over again

    def write_skip(self, step: int, first: int, count: int, lo: int, hi: int):
        """The data of steps ``first..first+count-1``, windows ``lo..hi-1``, was passed
        over at ``step`` (one line of ``skips.jsonl``, written by one rank); ``first`` -1:
        a range of training.skip_windows."""
        folder = os.path.dirname(self.path)
        steps = {"skip_steps": [first, count]} if first >= 0 else {}
        with open(os.path.join(folder, SKIPS), "a") as f:
            f.write(json.dumps({"step": step, **steps, "windows": [lo, hi]}) + "\n")

    def write(self, step: int, spans: list, branch: str | None = None):
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run
        line = {"step": step, "sequences": spans, **({"branch": branch} if branch else {})}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()


class StepClock:
    """A step's time as the log line reports it. On a CPU: the host's clock around the
    step. On a GPU the host only queues the step's work (a step that logs nothing never
    waits for the device), so its clock would time the launches: a step that logs
    records a CUDA event where it begins and where it ends, on the compute stream, and
    the log line, which waits for the device anyway, reads the time between them: the
    step on the device's timeline (the device's own work, or the host's where the
    device waited for it). Cost: two events on a step that logs, none on others."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events = None

    def start(self, timed: bool):
        """Before the step's data is pulled; ``timed``: the step logs."""
        self._events = None
        if self.cuda and timed:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()

    def stop(self):
        if self._events is not None:
            self._events[1].record()

    def seconds(self, host_s: float) -> float:
        """The step's seconds, once the device is past its end (a log line read it)."""
        if self._events is None:
            return host_s
        self._events[1].synchronize()  # done already: the log line's read waited for it
        return self._events[0].elapsed_time(self._events[1]) / 1000


class StepMetrics:
    """Reports each step the loop took: every ``metrics.log_freq`` steps (and at the first
    and last, and where a validation ran) the console line, JSONL and TensorBoard; every
    step, the provenance line. The loop owns the step, its bound, the token count and
    validation; this only reports them."""

    def __init__(self, cfg, dims, model, preemption, loader, start_step: int, last_step: int,
                 guard=None, train_state=None, trim_later: bool = False):  # fmt: skip
        """``trim_later``: the records are trimmed by ``trim`` once the state trained from
        is known (a replica group: at its first commit, a heal before it bringing a peer's
        step and timeline), not to ``start_step`` now."""
        t = cfg.training
        self.dims = dims
        # Its lineage trims the records to this start's timeline; its branch tags each line.
        self.train_state = train_state
        lineage = None if train_state is None else train_state.lineage
        self.guard = guard  # spikes.SpikeGuard: its counters, and the events it saw
        self.events_path = os.path.join(cfg.job.dump_folder, "spikes.jsonl")
        self.model = model
        self.preemption = preemption
        self.loader = loader
        self.last_step = last_step
        schedule = loader.schedule
        global_batch = schedule.global_batch(start_step)
        accumulation = schedule.accumulation(global_batch)
        self.flops_per_token = llama.flops_per_token(
            getattr(model, "module", model).args, t.seq_len
        )
        self.peak = peak_tflops(cfg, dims.device)
        self.logger = MetricLogger(cfg, dims.rank, start_step, lineage, trim=not trim_later)
        self.provenance = None
        if cfg.metrics.data_provenance and dims.tp_rank == 0 and dims.pp_rank == 0:
            folder = os.path.join(cfg.job.dump_folder, "provenance")
            writers = dims.dp_world if trim_later else None
            self.provenance = ProvenanceWriter(folder, dims.dp_rank, start_step, dims.is_main,
                                               lineage, writers)  # fmt: skip
        self.epoch_starts: list[list] = []  # [step, source, pass] since the last line
        logger.info(
            "training steps %d..%d, %d tokens per step (%d sequences: %d micro-batches of at "
            "most %d x %d per data-parallel rank; %s)%s",
            start_step + 1, last_step, global_batch * t.seq_len, global_batch, accumulation,
            schedule.largest_micro(global_batch), t.seq_len, parallel.describe_layout(dims),
            f"; global batch by step {t.batch_size_schedule}" if t.batch_size_schedule else "",
        )  # fmt: skip

    def trim(self, step: int, lineage: list | None):
        """The records kept to the timeline this rank now trains on: the lines of steps up
        to ``step`` on ``lineage`` (``truncate_jsonl_after``), each rank its own
        provenance file, rank 0 the metrics and skips. A replica group calls it (through
        ``ReplicaGroup.on_timeline``) at its first commit, of ``step`` (after any heal,
        before the step's own lines): a group started from step 0 or an older checkpoint
        that heals to a peer's step keeps its own lines of the steps that peer's timeline
        committed (trial 950007 lost them to a trim at its start), and drops those of
        steps the peer trained again."""
        self.logger.trim(step, lineage)
        if self.provenance is not None:
            self.provenance.trim_own(step, lineage)

    def logs(self, step: int) -> bool:
        """Whether ``step`` writes a log line (and reads the step's values on the host)."""
        return self.logger.should_log(step, self.last_step)

    def report(self, step: int, tokens_seen: int, step_tokens: int, batches: list[dict],
               step_s: float, data_wait_s: float, loss: torch.Tensor, grad_norm: torch.Tensor,
               lr: float, validation_loss: float | None = None,
               clock: StepClock | None = None):  # fmt: skip
        """The step just taken: ``step_tokens`` over all ranks in ``step_s`` seconds (the
        host's; ``clock``'s where it timed the step on the device; the validation
        excluded), ``data_wait_s`` of them waiting for ``batches``."""
        branch = None if self.train_state is None else self.train_state.current_branch
        if self.provenance is not None:
            self.provenance.write(step, [s for b in batches for s in b["spans"]], branch)
        passed_over = getattr(self.loader, "take_passed_over", list)()
        if self.provenance is not None and self.dims.is_main:
            for first, count, lo, hi in passed_over:
                self.provenance.write_skip(step, first, count, lo, hi)
        self.epoch_starts += [[step, *e] for e in self.loader.take_epoch_starts()]
        validation = {} if validation_loss is None else {"validation_loss": validation_loss}
        if not validation and not self.logger.should_log(step, self.last_step):
            return
        loss, grad_norm, loads = self.read(step, loss, grad_norm)
        if clock is not None:  # after the read: the device is past the step
            step_s = clock.seconds(step_s)
        per_rank = step_tokens / self.dims.world_size / step_s
        peak, per_token = self.peak, self.flops_per_token
        mfu = {"mfu_pct": 100 * per_rank * per_token / (peak * 1e12)} if peak else {}
        ranks = across_ranks(self.dims, loss, 1000 * step_s, 1000 * data_wait_s)
        sources = {f"{SOURCE_TOKENS}{k}": v for k, v in self.loader.tokens_by_source().items()}
        sources.update({f"{MIX_WEIGHT}{k}": v for k, v in self.loader.mix_by_source().items()})
        for name, (pass_, read) in self.loader.passes_by_source().items():
            sources[f"{SOURCE_PASS}{name}"], sources[f"{SOURCE_READ}{name}"] = pass_, read
        values = {
            "loss": ranks.get("loss", 0.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": per_rank,
            **mfu,
            "step_ms": 1000 * step_s,
            "data_wait_ms": 1000 * data_wait_s,
            # the previous step's stop agreement (save on preemption)
            "stop_check_ms": 1000 * self.preemption.last_check_s,
            "memory_gib": memory_gib(self.dims.device),
            "tokens_seen": tokens_seen,
            **({"branch": branch} if branch else {}),
            **{k: v for k, v in ranks.items() if k != "loss"},
            "skipped_documents": self.loader.skipped_documents(),
            **({} if self.guard is None else self.guard.metrics()),
            **sources,
            **expert_load_values(loads),
            **validation,
        }
        self.logger.log(step, values, epoch_starts=self.epoch_starts)
        self.epoch_starts = []

    def read(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor):
        """What a log line reads of the device, in one read (a sync on a GPU): the loss,
        the gradient norm, the guard's verdict of the step (the guard learns it here, not
        a step later) and a mixture of experts' loads, cast to float64 (exact: float32
        values, counts below 2**53) and stacked. Returns the loss and the norm as floats
        and the loads ([layers, experts] int64 on the host, or None)."""
        record = None if self.guard is None else self.guard.newest(step)
        inner = getattr(self.model, "module", self.model)
        loads = getattr(inner, "last_loads", None)
        parts = [loss.detach().reshape(1), grad_norm.detach().reshape(1)]
        parts += [t.reshape(-1) for t in (record, loads) if t is not None]
        values = torch.cat([t.to(torch.float64) for t in parts]).tolist()  # one device
        if record is not None:
            self.guard.learn(step, now=True, newest=values[2 : 2 + record.numel()])
        if loads is not None:
            loads = torch.tensor(values[len(values) - loads.numel() :]).to(torch.int64)
            loads = loads.view(inner.last_loads.shape)
        return values[0], values[1], loads

    def event(self, record: dict):
        """Rank 0: a broken step, a spike or a rewind, one line of ``spikes.jsonl`` (a
        record of what happened: never trimmed, a rewind's events included)."""
        with open(self.events_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def rewind(self, step: int, number: int):
        """Rewind ``number`` went back to ``step``: the records of the steps after it move
        aside (``metrics.jsonl`` to ``metrics_rewound.jsonl`` on rank 0, each provenance
        file to ``rewound_rank<r>.jsonl``), so the run's files hold each step once."""
        if self.dims.is_main:
            path = self.logger.jsonl_path
            move_jsonl_after(path, step, path[: -len(".jsonl")] + "_rewound.jsonl", rewind=number)
        if self.provenance is not None:
            self.provenance.rewind(step, number)

    def close(self):
        self.logger.close()
        if self.provenance is not None:
            self.provenance.close()
