"""Initial weights for a run that has no checkpoint of its own: ``checkpoint.initial_load_path``.

Owns: reading the model weights of another job's finished ``step-N`` folder (``dcp``;
a local path or a URL such as ``s3://bucket/run/step-N``, read through ``store``)
or of a Hugging Face ``LlamaForCausalLM`` folder (``hf``) into this run's (possibly
sharded) model, and refusing a bad one with the same one line on every rank.

Cost: ``dcp``: each rank verifies a share of the folder's files (O(checkpoint / ranks))
and reads its own shard of the model entries. ``hf``: rank 0 reads the folder (O(model))
while the others wait for as long as the folder's size says (``load_timeout_s``), and
torch's ``set_model_state_dict(broadcast_from_rank0)`` sends each rank its part.

Never: load optimizer, data or RNG state, or write into a checkpoint folder.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan import parallel
from torchtitan.checkpoint import compat, integrity
from torchtitan.checkpoint.entries import DataOnlyLoadPlanner
from torchtitan.checkpoint.folder import CheckpointError
from torchtitan.checkpoint.store import is_url, local_copy, store_for


def load_initial_weights(cfg, model: torch.nn.Module, dims):
    """Load ``checkpoint.initial_load_path`` into ``model``; nothing when it is unset."""
    path, fmt = cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_format
    if not path:
        return
    begin = time.perf_counter()
    if fmt == "dcp":
        _load_dcp(model, path, dims)
    else:
        _load_hf(model, path, dims)
    logging.getLogger("torchtitan").info(
        "no checkpoint of this run yet: model weights from %s (%s) in %.2fs",
        path, fmt, time.perf_counter() - begin,
    )  # fmt: skip


def _load_dcp(model: torch.nn.Module, path: str, dims):
    what = f"checkpoint.initial_load_path {path}"
    store = store_for(path)
    if store.isdir(path):
        mine = integrity.verify_share(path, dims.rank, dims.world_size)
        problems = [p for p in parallel.all_gather_objects(dims, mine) if p is not None]
        problem = problems[0] if problems else None
    else:
        problem = "it is not a folder"
    if problem:
        raise CheckpointError(f"{what}: {problem}; pass a complete step-N folder")
    problem = integrity.format_problem(path, weights_only=True)
    if problem:
        raise CheckpointError(
            f"{what} {problem}; convert it with the version that wrote it (e.g. to a HF folder)"
        )
    state = {"model": get_model_state_dict(model)}
    saved = store.reader(path).read_metadata().state_dict_metadata
    model_entries = {k.split(".", 1)[1]: md for k, md in saved.items() if k.startswith("model.")}
    problem = compat.model_mismatch(state["model"], model_entries)
    if problem:
        raise CheckpointError(
            f"{what}: {problem}; use the model.flavor and tokenizer of the job that wrote it"
        )
    dcp.load(state, checkpoint_id=path, storage_reader=store.reader(path),
             process_group=dims.cpu_group, planner=DataOnlyLoadPlanner(),
             no_dist=not dist.is_initialized())  # fmt: skip
    set_model_state_dict(model, state["model"])


# Rank 0 reads a Hugging Face folder while the others wait: they wait this long plus the
# folder's bytes at this rate (an 8B folder, 16 GB: 120 s + 640 s), not the process
# group's fixed timeout, and say so in one line if rank 0 is slower than that.
WAIT_BASE_S = 120.0
WAIT_MIN_BYTES_PER_S = 25e6


def folder_bytes(path: str) -> int:
    """Bytes of the files in a folder (not recursive; a URL's objects under it). Cost: one
    stat per file (a listing page per 1,000 objects)."""
    if is_url(path):
        store = store_for(path)
        return sum(int(e.get("size") or 0) for e in store.fs.ls(path, detail=True, refresh=True)
                   if e.get("type") == "file")  # fmt: skip
    if not os.path.isdir(path):
        return 0
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


def load_timeout_s(nbytes: int) -> float:
    """How long the other ranks wait for rank 0 to read ``nbytes`` of weights."""
    return WAIT_BASE_S + nbytes / WAIT_MIN_BYTES_PER_S


def _load_hf(model: torch.nn.Module, path: str, dims):
    """Rank 0 reads; the others wait in a broadcast on a gloo group whose timeout is sized
    from the folder (every rank stats the same files, so all agree on it)."""
    from torchtitan.hf import read_hf_folder

    nbytes = folder_bytes(path)
    timeout_s = load_timeout_s(nbytes)
    group = None
    if dist.is_initialized():
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    weights, problem = {}, None
    if dims.is_main:
        try:
            with local_copy(path) as folder:
                weights, _ = read_hf_folder(folder, getattr(model, "module", model).args)
        except Exception as e:  # noqa: BLE001 - whatever stops the read is the folder's
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    if group is not None:
        box = [problem]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except RuntimeError:  # the wait ran out (or rank 0 is gone): one line, every rank
            raise CheckpointError(
                f"checkpoint.initial_load_path {path}: rank 0 did not finish reading it "
                f"({nbytes / 1e9:.1f} GB) within {timeout_s:.0f} s, i.e. slower than "
                f"{WAIT_MIN_BYTES_PER_S / 1e6:.0f} MB/s; copy the folder to faster storage "
                "(local disk) or convert it once with the dcp format (each rank reads its shard)"
            ) from None
        problem = box[0]
        dist.destroy_process_group(group)
    if problem:  # every rank raises the same line
        raise CheckpointError(f"checkpoint.initial_load_path {path}: {problem}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    set_model_state_dict(model, weights, options=options)
