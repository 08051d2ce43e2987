"""Device and process-group setup, the layout of the ranks, and wrapping a model in it.

One module per job, all re-exported here (``parallel.X``): ``groups`` (device, process
groups, layout, timeouts), ``diagnosis`` (which rank failed and why), ``collectives``
(the trainer's small collectives, ``JobRanks``) and ``wrapping`` (parallelism applied
to a model).

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

from torchtitan.parallel.collectives import (  # noqa: F401
    JobRanks,
    all_gather_objects,
    any_rank,
    barrier,
    broadcast_from_main,
    gather_objects,
    gather_to_main,
    mean_on_control,
    mean_over_ranks,
    on_main,
    sum_over_ranks,
    sum_tensor_over_ranks,
)
from torchtitan.parallel.diagnosis import (  # noqa: F401
    collective_broke,
    failed_peer,
    report_failure,
    torchrun_restart_problem,
    why_collective_broke,
)
from torchtitan.parallel.groups import (  # noqa: F401
    MESH_DIMS,
    PP_MESH_DIMS,
    ParallelDims,
    apply_layout,
    check_config,
    check_pipeline_config,
    describe_layout,
    destroy_distributed,
    device_type,
    init_distributed,
    process_groups,
    set_timeout,
)
from torchtitan.parallel.wrapping import (  # noqa: F401
    apply_activation_checkpointing,
    apply_compile,
    apply_ddp,
    apply_fsdp,
    compute_dtype,
    data_parallel_mesh,
    gradient_sync,
    is_fsdp,
    parallelize,
    uses_fsdp,
)
