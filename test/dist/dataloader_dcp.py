"""Scenarios of the 4-rank launch (parallel_layouts.py imports them): the dataloader
through real DCP into a never-iterated loader, and the log line's view of all ranks.

``save_and_restore``: iterate 3 steps, save, take 5 more as the reference; a fresh
loader given one entry from DCP (``entry_to_load``) must yield exactly those. Prints
one "restored exactly" line per rank and worker count.
"""

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan import parallel
from torchtitan.checkpoint.entries import empty_like_saved
from torchtitan.config import parse_args
from torchtitan.data import ParallelDataLoader, build_dataloader
from torchtitan.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchtitan.tools.launch import DEBUG_CONFIG


def loader(corpus: str, workers: int) -> ParallelDataLoader:
    cfg = parse_args(["--job.config_file", DEBUG_CONFIG, "--training.dataset_path", corpus,
                      "--training.seq_len", "32", "--training.batch_size", "2",
                      "--training.seed", "3", "--training.num_workers", str(workers)])  # fmt: skip
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    return build_dataloader(cfg, tokenizer, dist.get_rank(), dist.get_world_size())


def save_and_restore(corpus: str, ckpt: str, workers: int):
    first = loader(corpus, workers)
    for _ in range(3):
        first.next_step()
    dcp.save({"dataloader": first.state_dict()}, checkpoint_id=ckpt)
    reference = [next(first) for _ in range(5)]

    fresh = loader(corpus, workers)  # never iterated: it has no state for DCP to fill in place
    metadata = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith("dataloader.")]
    assert len(keys) == dist.get_world_size(), keys  # one entry per rank survived DCP
    key = fresh.entry_to_load([k.split(".", 1)[1] for k in keys])
    state = {"dataloader": {key: empty_like_saved(metadata[f"dataloader.{key}"])}}
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["dataloader"])
    for a, b in zip((next(fresh) for _ in range(5)), reference):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["label"], b["label"])
        assert a["spans"] == b["spans"]
    print(f"rank {dist.get_rank()}: dataloader with {workers} workers restored exactly", flush=True)


def across_ranks_names_the_slowest():
    """The log line's view of all ranks, from one real gather: rank r took 10 (r + 1) ms."""
    from torchtitan.records.metrics import across_ranks

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = parallel.ParallelDims(rank, world, 0, torch.device("cpu"), "gloo",
                                 control_group=dist.group.WORLD)  # fmt: skip
    got = across_ranks(dims, torch.tensor(rank + 1.0), 10.0 * (rank + 1), 3.0 * rank)
    if rank == 0:
        want = {"loss": (world + 1) / 2, "step_ms_median": 5.0 * (world + 1),
                "step_ms_max": 10.0 * world, "slowest_rank": world - 1,
                "data_wait_ms_max": 3.0 * (world - 1)}  # fmt: skip
        assert got == want, (got, want)
    else:
        assert got == {}
    # Under pipeline parallelism (2 stages, the outermost dimension) its stage too.
    staged = across_ranks(replace(dims, pp=2), torch.tensor(1.0), 10.0 * (rank + 1), 0.0)
    if rank == 0:
        assert staged["slowest_rank"] == world - 1 and staged["slowest_stage"] == 1, staged
        print("across ranks: the slowest rank named", flush=True)
