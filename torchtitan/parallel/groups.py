"""Device and process-group setup and the layout of the ranks.

Owns: choosing the device and backend from what is present (``device_type``), the
parallel settings' own rules for a config (``check_config``), initializing and tearing
down the default process group and the two gloo groups for CPU-side work (checkpoint
traffic; control: the per-step stop agreement), the job's c10d store client, the
layout (``apply_layout``: one ``DeviceMesh``; which data-parallel, tensor-parallel and
pipeline rank this rank is) and the timeout of every process group.

Never: run collectives for the trainer (collectives.py), diagnose failures
(diagnosis.py) or touch a model (wrapping.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

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
    ep: int = 1  # expert parallel: the experts are sharded over the dp_shard ranks
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
    replicate, shard, tp, pp, ep = (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.expert_parallel_degree,
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
    if ep > 1 and ep != shard:
        raise ConfigError(
            f"parallelism.expert_parallel_degree {ep} is not the data-parallel shard degree "
            f"{shard}: experts are sharded over the FSDP ranks (for now); set "
            f"--parallelism.expert_parallel_degree {shard} or run on {ep} ranks"
        )
    mesh = None
    # Plain FSDP and DDP need no mesh: they use every rank (as FSDP's default mesh does).
    # Expert parallelism shards the experts over FSDP's own mesh dimension ("dp_shard"),
    # so that a gradient norm over all parameters is over one mesh.
    if dist.is_initialized() and (tp > 1 or replicate > 1 or pp > 1 or ep > 1):
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
    dims = replace(dims, tp=tp, dp_replicate=replicate, pp=pp, ep=ep, mesh=mesh)
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
    ep = f" ({dims.ep} expert-parallel)" if dims.ep > 1 else ""
    return f"{pp}{dp}{ep} x {dims.tp} tensor-parallel"


def _job_store():
    """A client of the rendezvous store torchrun started (MASTER_ADDR:MASTER_PORT)."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=30))  # fmt: skip
    except (KeyError, ValueError, RuntimeError):
        return None  # no store to share errors through: ranks then report only their own


def destroy_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()
