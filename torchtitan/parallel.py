"""Device and process-group setup, the layout of the ranks, and wrapping a model in it.

Owns: choosing the device and backend from what is present (``device_type``: CUDA +
NCCL, else CPU + gloo), the parallel settings' own rules for a config (``check_config``,
run by torchtitan.config.validate before anything is built), initializing and tearing
down the default process group and two gloo groups for CPU-side work (checkpoint
traffic; control: the per-step stop agreement), the layout (``parallelism.*``:
data-parallel replicas x shards x tensor-parallel ranks, one ``DeviceMesh``; which
data-parallel and tensor-parallel rank this rank is), the small collectives the trainer
needs (a barrier, the mean of a scalar over ranks, a flag raised on any rank), the
timeout of every process group (``comm.init_timeout_seconds`` until the first step is
done, then ``comm.train_timeout_seconds``), telling the other ranks which rank failed
and why (one key in the job's c10d store), naming the ranks that stopped answering when
a collective breaks, and applying parallelism and its companions to a model: tensor
parallel (``tensor_parallel.py`` holds the plan), FSDP2 or HSDP with mixed precision, or
DDP, gradient sync during accumulation, activation checkpointing and per-block
compilation.

Rank layout: rank = (replica x shard_degree + shard) x tp_degree + tp_rank. Tensor
parallel is innermost, so a TP group is adjacent ranks (one node's fast links), and
the data-parallel rank is rank // tp_degree.

A stopped or hung rank is found without per-step work: when a collective breaks (a
timeout, a closed connection), each rank that sees it says so in the store and waits a
few seconds for the others to say so too; those that do not are named. Cost: nothing
per step; O(ranks) store look-ups once, after a failure.

Never: define or build the model (it arrives on the meta device), hold training state,
or read the config beyond the parallelism, precision, recompute and comm settings
(and, to refuse it with tensor parallelism, training.mask_document_boundaries).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config import ConfigError


@dataclass
class ParallelDims:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # A gloo group of its own for CPU-side work: checkpoint traffic and error agreement.
    # ``dcp.async_save`` on the default group deadlocks while training collectives run.
    cpu_group: object = field(default=None, repr=False)
    # Control traffic from the training thread (the stop agreement), apart from the
    # checkpoint group that a background save may be using at the same moment.
    control_group: object = field(default=None, repr=False)
    store: object = field(default=None, repr=False)  # the job's c10d store (torchrun), if any
    # The layout (set by ``apply_layout``); the data-parallel shard degree is the rest.
    tp: int = 1
    dp_replicate: int = 1
    pp: int = 1
    # dims ("dp_replicate", "dp_shard", "tp"), with "pp" first under pipeline
    # parallelism; None in one plain process.
    mesh: object = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: distinct batches per step (TP and PP peers share one)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return self.rank % (self.world_size // self.pp) // self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.world_size // self.pp)

    @property
    def dp_shard(self) -> int:
        return self.dp_world // self.dp_replicate

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


def init_distributed(timeout_s: int = 300) -> ParallelDims:
    """Start the process group when launched by torchrun; one plain process otherwise.
    Every group it makes waits ``timeout_s`` in a collective (``set_timeout`` changes it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type() == "cuda":
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ and not dist.is_initialized():
        # "cpu:gloo,cuda:nccl" lets CPU-side collectives (checkpoint planning, error
        # agreement) run next to NCCL on GPUs.
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(pg_backend, timeout=timedelta(seconds=timeout_s))
    if not dist.is_initialized():
        return ParallelDims(rank, world, local_rank, device, backend)
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    # Every rank has connected both groups before any goes on: a rank that then stops
    # at once (a bad config) and closes its sockets would otherwise break a slower
    # peer's connecting with "Connection closed by peer", not the one-line error.
    dist.barrier(group=control_group)
    return ParallelDims(rank, world, local_rank, device, backend, cpu_group=cpu_group,
                        control_group=control_group, store=_job_store())  # fmt: skip


def device_type() -> str:
    """Where training runs: "cuda" where torch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_config(cfg) -> None:
    """The rules between degrees that need no world size (`apply_layout` checks the
    rest, and tensor_parallel.check_fits the model's sizes), run by
    torchtitan.config.validate: one ConfigError for the first broken one."""
    p, data_parallel = cfg.parallelism, cfg.training.data_parallel
    if cfg.training.compile and p.tensor_parallel_degree > 1:
        # Measured with torch 2.13 on CPU: compiled TP blocks give another gradient than
        # eager ones (step-1 grad norm 0.50 against 0.64; FSDP alone agrees bit for bit).
        raise ConfigError(
            "training.compile with parallelism.tensor_parallel_degree "
            f"{p.tensor_parallel_degree}: compiled tensor-parallel blocks do not give the "
            "eager gradients (torch 2.13); turn off one of them"
        )
    if p.data_parallel_shard_degree == 0:
        raise ConfigError(
            "parallelism.data_parallel_shard_degree: 0 is out of range; use a positive "
            "degree, or -1 for the world size divided by the other degrees"
        )
    if data_parallel == "ddp" and p.tensor_parallel_degree > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree {p.tensor_parallel_degree} needs FSDP: DDP "
            "does not take tensor-parallel weights; use --training.data_parallel fsdp"
        )
    if data_parallel == "ddp" and p.data_parallel_replicate_degree > 1:
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree} "
            "is HSDP, an FSDP layout (DDP replicates over every rank already); use "
            "--training.data_parallel fsdp, or leave the replicate degree at 1"
        )
    if p.pipeline_parallel_degree > 1:
        check_pipeline_config(cfg)
    if cfg.training.mask_document_boundaries and p.tensor_parallel_degree > 1:
        # The label count behind the normalizer is summed over all ranks, and TP peers
        # hold the same labels: not combined yet.
        raise ConfigError(
            "training.mask_document_boundaries with parallelism.tensor_parallel_degree "
            f"{p.tensor_parallel_degree} is not supported yet; turn one of them off"
        )


def check_pipeline_config(cfg) -> None:
    """What pipeline parallelism cannot be combined with (yet), each refused with why."""
    p, t = cfg.parallelism, cfg.training
    refused = [
        (t.data_parallel == "ddp", "training.data_parallel ddp",
         "its stages are data-parallel with FSDP; use --training.data_parallel fsdp"),
        (cfg.validation.enable, "validation.enable",
         "the held-out pass has no forward-only schedule yet; turn validation off"),
        (cfg.model.attention_mask == "block_causal", "model.attention_mask block_causal",
         "the document ids and positions do not cross stages yet; use causal"),
        (p.tensor_parallel_degree > 1 and p.loss_parallel, "parallelism.loss_parallel",
         "the last stage computes the loss on whole logits; pass --parallelism.loss_parallel false"),
    ]  # fmt: skip
    for broken, key, why in refused:
        if broken:
            raise ConfigError(
                f"{key} with parallelism.pipeline_parallel_degree "
                f"{p.pipeline_parallel_degree}: {why}"
            )


MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
PP_MESH_DIMS = ("pp", *MESH_DIMS)


def apply_layout(dims: ParallelDims, cfg) -> ParallelDims:
    """``dims`` with the layout of ``parallelism.*`` and its ``DeviceMesh``.

    Raises a one-line ConfigError when the degrees do not make the world size, before
    anything is built. Cost: one process group per mesh dimension (a collective over
    all ranks each), at start-up only.
    """
    p, world = cfg.parallelism, dims.world_size
    replicate, shard, tp, pp = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    )
    others = replicate * tp * pp
    if shard == -1:
        if world % others:
            raise ConfigError(
                f"world size {world} is not a multiple of parallelism.data_parallel_replicate_degree "
                f"{replicate} x parallelism.tensor_parallel_degree {tp} x "
                f"parallelism.pipeline_parallel_degree {pp}; choose degrees whose product "
                f"divides {world}"
            )
        shard = world // others
    if shard * others != world:
        raise ConfigError(
            f"parallelism degrees {pp} (pipeline_parallel_degree) x {replicate} "
            f"(data_parallel_replicate_degree) x {shard} (data_parallel_shard_degree) x {tp} "
            f"(tensor_parallel_degree) = {shard * others}, not the world size {world}; make "
            f"them multiply to {world}, or set --parallelism.data_parallel_shard_degree -1 "
            "to fill the rest"
        )
    mesh = None
    # Plain FSDP and DDP need no mesh: they use every rank (as FSDP's default mesh does).
    if dist.is_initialized() and (tp > 1 or replicate > 1 or pp > 1):
        from torch.distributed.device_mesh import init_device_mesh

        if pp > 1:  # outermost: a pipeline's stages are data-parallel layouts of their own
            mesh = init_device_mesh(dims.device.type, (pp, replicate, shard, tp),
                                    mesh_dim_names=PP_MESH_DIMS)  # fmt: skip
        else:
            mesh = init_device_mesh(
                dims.device.type, (replicate, shard, tp), mesh_dim_names=MESH_DIMS
            )
        if tp > 1:
            # FSDP over TP puts parameters on (dp_shard, tp); with this flattened view a
            # reduction over both (the gradient norm) is one all-reduce, not two in a row.
            mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    dims = replace(dims, tp=tp, dp_replicate=replicate, pp=pp, mesh=mesh)
    set_timeout(dims, cfg.comm.init_timeout_seconds)  # torch gives new groups 30 minutes
    return dims


def process_groups(dims: ParallelDims) -> list:
    """Every process group this job made: the default one, the checkpoint and control
    groups, and the mesh's (one per dimension, and the flattened FSDP x TP one)."""
    if not dist.is_initialized():
        return []
    groups = [dist.group.WORLD, dims.cpu_group, dims.control_group]
    if dims.mesh is not None:
        groups += dims.mesh.get_all_groups()
        if dims.tp > 1:
            # (_flatten returns the view apply_layout made; slicing it by name is deprecated)
            groups.append(dims.mesh["dp_shard", "tp"]._flatten("dp_shard_tp").get_group())
    return [g for g in groups if g is not None]


def set_timeout(dims: ParallelDims, seconds: float):
    """How long a collective on any of the job's groups waits before it raises."""
    for group in process_groups(dims):
        group.set_timeout(timedelta(seconds=seconds))


def describe_layout(dims: ParallelDims) -> str:
    """e.g. '4 data-parallel (HSDP 2 x 2) x 1 tensor-parallel', for the log."""
    dp = f"{dims.dp_world} data-parallel"
    if dims.dp_replicate > 1:
        dp += f" (HSDP {dims.dp_replicate} x {dims.dp_shard})"
    pp = f"{dims.pp} pipeline x " if dims.pp > 1 else ""
    return f"{pp}{dp} x {dims.tp} tensor-parallel"


def _job_store():
    """A client of the rendezvous store torchrun started (MASTER_ADDR:MASTER_PORT)."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=30))  # fmt: skip
    except (KeyError, ValueError, RuntimeError):
        return None  # no store to share errors through: ranks then report only their own


def _attempt() -> str:
    # torchrun keeps its store across restarts of the worker group: keys are per attempt.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def torchrun_restart_problem() -> str | None:
    """One line when torchrun has restarted the job's processes (``--max-restarts``), else
    None. Not supported: on torch 2.13 with gloo, restarted ranks mostly fail to form
    their process group again after a rank was killed (they dial the dead attempt's
    addresses: "Connection refused"), or hang; see the README. The scheduler's requeue
    starts the job afresh and resumes it."""
    if _attempt() == "0":
        return None
    return (
        f"torchrun restarted the job (attempt {_attempt()}), which it cannot survive: its "
        "process groups do not form again in restarted processes; launch with "
        "--max-restarts 0 and let the scheduler requeue the job (it resumes from the last "
        "checkpoint)"
    )


def _failure_key() -> str:
    return f"torchtitan/first_failure/{_attempt()}"


def _broken_key(rank: int) -> str:
    return f"torchtitan/saw_collective_break/{_attempt()}/{rank}"


def report_failure(dims: ParallelDims, message: str):
    """Record that this rank failed, and why, for the other ranks (the first report wins)."""
    if dims.store is None:
        return
    try:
        dims.store.compare_set(_failure_key(), "", f"{dims.rank}\n{message}")
    except RuntimeError:
        pass  # the store is gone: the job is ending anyway


def _reported_failure(dims: ParallelDims) -> tuple[int, str] | None:
    if dims.store.check([_failure_key()]):
        rank, _, message = dims.store.get(_failure_key()).decode().partition("\n")
        return int(rank), message
    return None


def failed_peer(dims: ParallelDims) -> str | None:
    """'rank N failed: <its message>' if another rank reported a failure already (it
    reports before it exits, and its exit is what breaks this rank), else None."""
    try:
        failure = None if dims.store is None else _reported_failure(dims)
    except RuntimeError:
        return None  # the store is gone: the job is ending anyway
    if failure is None or failure[0] == dims.rank:
        return None
    return f"rank {failure[0]} failed: {failure[1]}"


def collective_broke(error: BaseException) -> bool:
    """True when ``error``, or an error it wraps, is a collective or store operation that
    timed out or lost its peer (gloo says so only in its message)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError) or "gloo/transport" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _gloo_reason(error: BaseException) -> str:
    """'Timed out waiting 10000ms for recv operation to complete', from gloo's message."""
    text = str(error)
    at = text.find("gloo/transport")
    line = text[at:].split("] ", 1)[-1] if at >= 0 else text
    return line.split(". This is typically")[0].splitlines()[0][:200]


def why_collective_broke(dims: ParallelDims, error: BaseException,
                         wait_s: float = 3.0) -> str | None:  # fmt: skip
    """Why a collective broke on this rank, in one line: another rank's reported failure,
    or the ranks that did not answer. None when every rank answered and none reported a
    failure (then the cause is this rank's own, and its traceback says more).

    Every rank whose collective breaks says so in the store; a rank that is stopped
    (SIGSTOP), hung, or dead never does, and after ``wait_s`` it is named. ``wait_s``
    covers ranks whose own wait ran out a little later; it is short because torchrun
    sends SIGTERM as soon as one rank exits. Cost: O(ranks) store look-ups per poll.
    """
    if dims.store is None:
        return None
    peers = [_broken_key(r) for r in range(dims.world_size) if r != dims.rank]
    deadline = time.monotonic() + wait_s
    try:
        dims.store.set(_broken_key(dims.rank), "1")
        while True:
            if dims.store.check([_failure_key()]):
                return failed_peer(dims)
            if dims.store.check(peers):
                return None
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        silent = [r for r in range(dims.world_size)
                  if r != dims.rank and not dims.store.check([_broken_key(r)])]  # fmt: skip
    except RuntimeError:
        return None  # the store is gone: the job is ending anyway
    if not silent:  # the last ones answered just now
        return None
    names = ", ".join(map(str, silent))
    return (
        f"rank{'s' if len(silent) > 1 else ''} {names} stopped answering: a collective "
        f"failed ({_gloo_reason(error)}) and {'they' if len(silent) > 1 else 'it'} did not "
        f"report it within {wait_s:.0f} s (stopped, hung or killed; see its log, and "
        "comm.train_timeout_seconds for how long a collective waits)"
    )


def destroy_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(value: torch.Tensor) -> float:
    """The global mean of a scalar over all ranks (gloo has no AVG, so SUM / world)."""
    if not dist.is_initialized():
        return value.item()
    t = value.detach().to(torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / dist.get_world_size()).item()


def sum_over_ranks(value: int) -> int:
    """The sum of an integer count over all ranks."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def any_rank(dims: ParallelDims, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (one small gloo all-reduce)."""
    if dims.control_group is None:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dims.control_group)
    return bool(t.item())


def gather_to_main(dims: ParallelDims, items: list) -> list:
    """Every rank's ``items``, concatenated on rank 0 (empty elsewhere); control group."""
    if dims.control_group is None:
        return list(items)
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(items, out, dst=0, group=dims.control_group)
    return [item for part in (out or []) for item in part]


def barrier(dims: ParallelDims):
    if dist.is_initialized():
        dist.barrier(group=dims.cpu_group)


def on_main(dims: ParallelDims, fn, *args):
    """``fn(*args)`` on rank 0 only; every rank returns its result, or raises its error
    (the same exception, so a user error stays one line on every rank). For work done
    once per job and moved as a value. Collective: every rank must call it."""
    outcome = None
    if dims.is_main:
        try:
            outcome = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            outcome = (False, e)
    ok, value = broadcast_from_main(dims, outcome)
    if not ok:
        raise value
    return value


def broadcast_from_main(dims: ParallelDims, obj):
    """Rank 0's ``obj`` on every rank (checkpoint group; pickled, for small objects)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=dims.cpu_group)
    return box[0]


def gather_objects(dims: ParallelDims, obj) -> list:
    """Every rank's ``obj`` on rank 0, in rank order (others get an empty list)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(obj, out, dst=0, group=dims.cpu_group)
    return out or []


def all_gather_objects(dims: ParallelDims, obj) -> list:
    """Every rank's ``obj`` on every rank, in rank order (checkpoint group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj, group=dims.cpu_group)
    return out


@dataclass
class JobRanks:
    """The job's ranks as the data plan uses them (``data.plan.Ranks``): rank 0 runs
    what is done once per job, every rank its share, over the checkpoint group."""

    dims: ParallelDims

    @property
    def rank(self) -> int:
        return self.dims.rank

    @property
    def world(self) -> int:
        return self.dims.world_size

    def on_main(self, fn, *args):
        return on_main(self.dims, fn, *args)

    def gather(self, obj) -> list:
        return gather_objects(self.dims, obj)


def parallelize(model: nn.Module, cfg, dims: ParallelDims, roots: list | None = None) -> nn.Module:
    """Turn a model built on the meta device into the training model on this rank:
    tensor parallel, activation checkpointing, compilation, FSDP2/HSDP (or DDP), then
    materialization.

    Each rank allocates and initializes only what it holds (``init_weights`` draws a
    shard exactly as the whole tensor would be drawn): O(own shard) memory and time
    per rank under FSDP and TP, and the same weights on any layout.

    ``roots``: under pipeline parallelism, the stage modules (pipeline.py) that share
    ``model``'s parts; each becomes the FSDP root over what it runs, and ``model`` holds
    them all (the names a checkpoint uses) without being wrapped itself.
    """
    if dims.tp > 1:
        from torchtitan import tensor_parallel

        p = cfg.parallelism
        tensor_parallel.apply(model, dims.mesh["tp"], p.sequence_parallel, p.loss_parallel)
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.selective_every)
    if cfg.training.compile:
        apply_compile(model)
    fsdp = uses_fsdp(cfg.training.data_parallel, dims)
    if fsdp:
        reduce_dtype = getattr(torch, cfg.training.mixed_precision_reduce)
        apply_fsdp(model, compute_dtype(cfg, dims.device), reduce_dtype, data_parallel_mesh(dims),
                   roots)  # fmt: skip
    model.to_empty(device=dims.device)
    model.init_weights(cfg.training.seed)
    return model if fsdp else apply_ddp(model, dims)


def data_parallel_mesh(dims: ParallelDims):
    """FSDP's mesh: the shard dimension, or (replicate, shard) for HSDP; None: all ranks."""
    if dims.mesh is None:
        return None
    return dims.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else dims.mesh["dp_shard"]


def compute_dtype(cfg, device: torch.device) -> torch.dtype:
    """The dtype of forward and backward compute (training.mixed_precision_param)."""
    name = cfg.training.mixed_precision_param
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def uses_fsdp(mode: str, dims: ParallelDims) -> bool:
    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"training.data_parallel {mode!r}: choose 'fsdp' or 'ddp'")
    return mode == "fsdp" and dist.is_initialized()


def apply_fsdp(model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype, mesh=None,
               roots: list | None = None):  # fmt: skip
    """Shard with FSDP2 per transformer block and at the root (or at each of ``roots``,
    the pipeline stages), in place (works on meta), over ``mesh`` (default: all ranks; a
    2-D (replicate, shard) mesh is HSDP).

    Parameters stay float32 and sharded; each block's are gathered in ``param_dtype``
    for compute, and gradients are reduce-scattered in ``reduce_dtype``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block's inputs arrive in param_dtype from the bf16 embedding already; casting them
    # would also cast the fp32 RoPE tables passed alongside, and RoPE rotates in fp32.
    block_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=block_policy)
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, mp_policy=policy)


def apply_ddp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Replicate with DDP (the parameters must be materialized); one process: unchanged."""
    if not dist.is_initialized() or dims.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [dims.device.index] if dims.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "reshard")  # what fully_shard adds to a module's class


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-batch's backward: DDP skips its all-reduce until the last
    one. FSDP reduce-scatters every micro-batch: holding unsharded gradients instead
    would cost O(model) memory per rank, the thing sharding is there to avoid."""
    if not enabled and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int):
    """Recompute the activations of every block (full) or of blocks 0, k, 2k, ...
    (selective, k = every) in the backward pass instead of keeping them."""
    if mode not in ("none", "full", "selective"):
        raise ConfigError(f"activation_checkpoint.mode {mode!r}: choose none, full or selective")
    for i, block in enumerate(model.layers.values()):
        block.recompute = mode == "full" or (mode == "selective" and i % every == 0)


def apply_compile(model: nn.Module):
    """torch.compile each block's computation (parameter names are unchanged, and FSDP's
    hooks stay outside the compiled region)."""
    for block in model.layers.values():
        block.compiled = torch.compile(block.compute)
