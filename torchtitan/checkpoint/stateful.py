"""The ``Stateful`` adapters: what each checkpointed component saves and restores.

Owns: the model and optimizer through torch's distributed state-dict API (DTensors
under FSDP, HSDP and TP, so each rank saves and loads its own shard and DCP reshards
across layouts), the train state, which rank writes the loader's entry, and every RNG
a rank draws from.

Every entry of the project's own is a tensor: the train state's counters, the torch
generators' states (uint8 tensors already), and JSON in a uint8 tensor for the loader
position and the Python and numpy RNG states (entries.py). Nothing here pickles.

Never: choose, write or verify checkpoints.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint.entries import empty_like_saved, from_tensor, to_tensor


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        # Tensors, not Python ints: DCP would pickle an int (torch.save).
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict):
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict):
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's moments come from the checkpoint; its hyperparameters (lr, betas,
    weight decay, eps) stay those of the config this run was built from."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict):
        configured = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, hyper in zip(self.optimizer.param_groups, configured):
            group.update(hyper)


class DataLoaderState(Stateful):
    """The loader's ``dp_rank_<d>`` entry, written by the first rank of its TP group only.

    TP peers build the same loader and consume the same batches (test_parallel checks a
    digest of them), so one writer per data-parallel rank keeps the checkpoint at one
    entry per DP rank without leaning on DCP's merging of equal keys. Every entry holds
    the same global position, so a rank loads one (``entry_to_load``), whatever the
    layout that wrote them. The entry is JSON in a uint8 tensor (the loader's own).
    """

    def __init__(self, loader, writes: bool):
        self.loader, self.writes = loader, writes

    def state_dict(self) -> dict:
        return self.loader.state_dict() if self.writes else {}

    def targets(self, saved: dict) -> dict:
        """The one entry this rank loads, as an empty tensor of the saved size for DCP to
        fill (``saved``: DCP's ``state_dict_metadata``)."""
        entries = [k.split(".", 1)[1] for k in saved if k.startswith("dataloader.")]
        key = self.loader.entry_to_load(entries)
        return {key: empty_like_saved(saved[f"dataloader.{key}"])}

    def load_state_dict(self, state_dict: dict):
        self.loader.load_state_dict(state_dict)


class RNGState(Stateful):
    """Every RNG a rank draws from, under keys that say whose (DCP would merge equal keys
    across ranks).

    Torch's generators (dropout) are one stream per data-parallel rank, shared by its
    TP peers (tensor_parallel.py), written by the first of them as ``dp_rank_<d>`` (and
    ``cuda_dp_rank_<d>``): the generators' own uint8 state tensors; so a resume on
    another layout can only hand a TP group one stream. Python's and numpy's are per
    rank, ``rank_<r>``, as JSON in a uint8 tensor.

    CUDA: only the current device's generator, so a rank that lands on another GPU
    index after a restart still continues its own stream.
    """

    def __init__(self, rank: int, dp_rank: int, tp_rank: int):
        self.rank_key = f"rank_{rank}"
        self.shared_key = f"dp_rank_{dp_rank}"
        self.cuda_key = f"cuda_dp_rank_{dp_rank}"
        self.writes_shared = tp_rank == 0

    def targets(self, saved: dict) -> tuple[dict, list[str]]:
        """Empty tensors of the saved sizes for the entries this rank loads, and those of
        them the checkpoint lacks (``saved``: DCP's ``state_dict_metadata``)."""
        wanted = [self.shared_key, self.rank_key]
        if torch.cuda.is_available():
            wanted.append(self.cuda_key)
        found = {k: empty_like_saved(saved[f"rng.{k}"]) for k in wanted if f"rng.{k}" in saved}
        return found, [k for k in wanted[:2] if k not in found]

    def state_dict(self) -> dict:
        py_version, py_state, py_gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        own = {"python": [py_version, list(py_state), py_gauss],
               "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}  # fmt: skip
        state = {self.rank_key: to_tensor(own)}
        if self.writes_shared:
            state[self.shared_key] = torch.get_rng_state()
            if torch.cuda.is_available():
                state[self.cuda_key] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict):
        if self.shared_key in state_dict:
            torch.set_rng_state(state_dict[self.shared_key])
        if self.cuda_key in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict[self.cuda_key])
        if self.rank_key in state_dict:
            own = from_tensor(state_dict[self.rank_key])
            py_version, py_state, py_gauss = own["python"]
            random.setstate((py_version, tuple(py_state), py_gauss))
            name, keys, pos, has_gauss, cached = own["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
