"""Pipeline parallelism: the model split into stages by layers, and the schedule that runs
a step's micro-batches through them.

Owns: which layers each stage holds (an even split, or
``parallelism.pipeline_parallel_split_points``), which stages a rank holds (one, or
two for an interleaved schedule: stage ``s`` on pipeline rank ``s % pp``), cutting a
rank's part out of the whole model built on meta, the schedule (GPipe, 1F1B,
Interleaved1F1B of ``torch.distributed.pipelining``), and the step under it
(``PipelineStep``): the first stage's batch cut into the schedule's micro-batches, the
labels sent to the last stage, the loss computed there and given to every stage, the
gradient norm over all stages, the optimizer step.

Names do not change: a rank's part is the whole model with the other stages' modules
removed, so its parameters keep their unsplit names ("layers.5.attention.wq.weight")
and a checkpoint written at any pipeline degree loads at any other (DCP finds each
name in whatever files hold it), the HF export included.

Data: the data-parallel rank's loader is pulled on the first stage only (the inputs);
the labels (one [B, T] integer tensor a step) go to the last stage point to point, and
the middle stages read nothing. Every stage keeps the loader's position and checks the
data fingerprint on resume; the first stage of the first tensor-parallel rank writes
the loader entry and the provenance, once per data-parallel rank.

Cost per step: the schedule's activations between stages, one labels tensor to the
last stage, one scalar (the loss) back over the pipeline group, one scalar (the squared
gradient norm) summed over it. Memory: the rank's stages only.

Never: read data, choose the layout (parallel.py) or save checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config import ConfigError
from torchtitan.models.llama import Transformer

logger = logging.getLogger("torchtitan")

# Stages a rank holds under each schedule: the interleaved one loops twice over the ranks.
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}


def schedule_class(name: str):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    return {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B,
            "Interleaved1F1B": ScheduleInterleaved1F1B}[name]  # fmt: skip


def parse_split_points(text: str) -> list[int]:
    """``"2,5"`` -> [2, 5]: the first layer of every stage after the first."""
    if not text.strip():
        return []
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ConfigError(
            f"parallelism.pipeline_parallel_split_points {text!r}: give the first layer of "
            "each stage after the first, as increasing integers (e.g. 2,5)"
        )
    return [int(p) for p in parts]


def stage_layers(n_layers: int, stages: int, split_points: list[int], flavor: str) -> list[range]:
    """The layers of each of ``stages`` stages: at the split points, else an even split.
    Raises a one-line ConfigError for a split that cannot be."""
    if split_points:
        if len(split_points) != stages - 1:
            raise ConfigError(
                f"parallelism.pipeline_parallel_split_points has {len(split_points)} points "
                f"for {stages} stages; give {stages - 1}"
            )
        if (
            split_points != sorted(set(split_points))
            or not 0 < split_points[0]
            or (split_points[-1] >= n_layers)
        ):
            raise ConfigError(
                f"parallelism.pipeline_parallel_split_points {split_points} must increase "
                f"strictly between 1 and {n_layers - 1} (model flavor {flavor!r} has "
                f"{n_layers} layers)"
            )
        bounds = [0, *split_points, n_layers]
    else:
        if n_layers % stages:
            raise ConfigError(
                f"model flavor {flavor!r} has {n_layers} layers, not divisible into {stages} "
                "pipeline stages; change parallelism.pipeline_parallel_degree (or the "
                "schedule's stages per rank), or set parallelism.pipeline_parallel_split_points"
            )
        per = n_layers // stages
        bounds = [i * per for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def micro_batches(sequences: int, size: int, stages: int, schedule: str) -> int:
    """Pipeline micro-batches of a data-parallel rank's ``sequences`` in one step.
    Raises a one-line ConfigError where they cannot fill the pipeline."""
    if sequences % size:
        raise ConfigError(
            f"{sequences} sequences per data-parallel rank a step do not split into pipeline "
            f"micro-batches of parallelism.pipeline_parallel_microbatch_size {size}; make "
            "the global batch a multiple of the data-parallel ranks x the micro-batch size"
        )
    count = sequences // size
    pp = stages // SCHEDULES[schedule]
    if count < pp or (schedule == "Interleaved1F1B" and count % pp):
        need = "a multiple of" if schedule == "Interleaved1F1B" else "at least"
        raise ConfigError(
            f"{count} pipeline micro-batches a step for {pp} pipeline ranks "
            f"({schedule}): need {need} {pp}; raise training.global_batch_size or lower "
            "parallelism.pipeline_parallel_microbatch_size"
        )
    return count


def check_batches(schedule, pipeline: Pipeline, dp_world: int) -> None:
    """Every global batch of the batch-size schedule fills the pipeline: split evenly
    over the data-parallel ranks (the stages of every rank run the same micro-batches)
    into enough micro-batches. Checked at the start, not at the step that needs it."""
    stages = len(pipeline.stages) * pipeline.pp
    for _, size in schedule.points:
        if size % dp_world:
            raise ConfigError(
                f"a global batch of {size} sequences does not split evenly over {dp_world} "
                "data-parallel ranks, which pipeline parallelism needs (each rank's stages "
                "run the same micro-batches); make it a multiple of "
                f"{dp_world * pipeline.microbatch_size}"
            )
        micro_batches(size // dp_world, pipeline.microbatch_size, stages, pipeline.schedule)


class StageModule(Transformer):
    """One stage's view of the rank's part of the model: the same modules (so the
    rank's part holds their parameters and its names), its own layers, the embeddings
    on the first stage, the norm and output on the last."""

    def __init__(self, part: Transformer, layers: range, first: bool, last: bool):
        nn.Module.__init__(self)
        self.args = part.args
        self.tok_embeddings = part.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in layers})
        self.norm = part.norm if last else None
        self.output = part.output if last else None
        # The RoPE tables stay the part's (materialized with it), read through it.
        self.__dict__["_part"] = part

    @property
    def seq_shards(self) -> int:
        return self._part.seq_shards

    @property
    def rope_cos(self):
        return self._part.rope_cos

    @property
    def rope_sin(self):
        return self._part.rope_sin


def cut_part(model: Transformer, layers: list[range], stages: list[int]) -> Transformer:
    """``model`` (on meta) reduced, in place, to the modules of ``stages``: their
    layers, the embeddings if it holds the first stage, the norm and output if the last."""
    keep = {str(i) for s in stages for i in layers[s]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if 0 not in stages:
        model.tok_embeddings = None
    if len(layers) - 1 not in stages:
        model.norm = None
        model.output = None
    return model


@dataclass
class Pipeline:
    """A rank's stages and the schedules that run them (one per micro-batch count)."""

    stages: list  # torch.distributed.pipelining.PipelineStage, in stage order
    schedule: str
    microbatch_size: int
    group: object
    pp: int
    pp_rank: int
    _schedules: dict = field(default_factory=dict)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    def runner(self, count: int, loss_fn):
        """The schedule for ``count`` micro-batches a step (built once per count)."""
        if count not in self._schedules:
            cls = schedule_class(self.schedule)
            stages = self.stages if SCHEDULES[self.schedule] > 1 else self.stages[0]
            self._schedules[count] = cls(stages, count, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[count]


def build_pipeline(model: Transformer, cfg, dims, wrap) -> tuple[Transformer, Pipeline]:
    """The rank's part of ``model`` (built whole on meta) and its pipeline stages.

    ``wrap(part, modules)`` applies TP, recompute, compile and FSDP and materializes the
    part (parallel.py); each stage module is then its own FSDP root over the blocks it
    holds. Cost: O(the rank's layers) memory; the other stages are never materialized."""
    from torch.distributed.pipelining import PipelineStage

    p = cfg.parallelism
    per_rank = SCHEDULES[p.pipeline_parallel_schedule]
    total = dims.pp * per_rank
    layers = stage_layers(model.args.n_layers, total,
                          parse_split_points(p.pipeline_parallel_split_points),
                          cfg.model.flavor)  # fmt: skip
    mine = [dims.pp_rank + k * dims.pp for k in range(per_rank)]
    part = cut_part(model, layers, mine)
    modules = [StageModule(part, layers[s], s == 0, s == total - 1) for s in mine]
    part = wrap(part, modules)
    group = dims.mesh["pp"].get_group()
    stages = [PipelineStage(m, s, total, dims.device, group=group) for m, s in zip(modules, mine)]
    logger.info(
        "pipeline: %d stages (%s) of layers %s; this rank holds stage%s %s",
        total, p.pipeline_parallel_schedule, [f"{r.start}-{r.stop - 1}" for r in layers],
        "s" if per_rank > 1 else "", ", ".join(map(str, mine)),
    )  # fmt: skip
    return part, Pipeline(stages, p.pipeline_parallel_schedule,
                          p.pipeline_parallel_microbatch_size, group, dims.pp, dims.pp_rank)  # fmt: skip


class StageFeed:
    """What a stage after the first takes from its data-parallel rank's loader: nothing
    but the size of each step (the schedule's global batch). The loader itself is never
    pulled there, so no document is read; its position, which the first stage advances
    and saves, is only what a resume loads (and checks) on every stage."""

    def __init__(self, loader):
        self.loader, self.schedule = loader, loader.schedule
        self.step = loader.step
        self.last_global_batch = 0

    def next_step(self) -> list[dict]:
        self.last_global_batch = self.schedule.global_batch(self.step)
        self.step += 1
        return []

    def take_epoch_starts(self) -> list:
        return []

    def tokens_by_source(self) -> dict:
        return {}

    def mix_by_source(self) -> dict:
        return {}

    def passes_by_source(self) -> dict:
        return {}

    def skipped_documents(self) -> int:
        return 0


def send_to_last(pipeline: Pipeline, tensor: torch.Tensor | None, shape, dtype) -> torch.Tensor:
    """``tensor`` from the first pipeline rank to the last (both call it); others: None."""
    if pipeline.first:
        dist.send(tensor.contiguous(), group=pipeline.group, group_dst=pipeline.pp - 1)
        return tensor
    if pipeline.last:
        out = torch.empty(shape, dtype=dtype)
        dist.recv(out, group=pipeline.group, group_src=0)
        return out
    return None


def from_last(pipeline: Pipeline, value: torch.Tensor) -> torch.Tensor:
    """The last pipeline rank's ``value`` on every rank of the pipeline group."""
    value = value.detach().float().reshape(1).cpu()
    dist.broadcast(value, group=pipeline.group, group_src=pipeline.pp - 1)
    return value[0]


def clip_grad_norm(parameters: list, max_norm: float, pipeline: Pipeline) -> torch.Tensor:
    """Clip the gradients of every stage together: the norm over all the model's
    parameters, each stage's squared norm summed over the pipeline group."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP / TP
        norm = norm.full_tensor()
    squared = (norm.float() ** 2).reshape(1).cpu()
    dist.all_reduce(squared, group=pipeline.group)
    total = squared[0].sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total.to(norm.device), foreach=True)
    return total
