"""The ``Stateful`` adapters: what each checkpointed component saves and restores.

Owns: the model and optimizer through torch's distributed state-dict API (DTensors
under FSDP, HSDP and TP, so each rank saves and loads its own shard and DCP reshards
across layouts), the train state, which rank writes the loader's entry, and every RNG
a rank draws from.

Never: choose, write or verify checkpoints.
"""

from __future__ import annotations

import pickle
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


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

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
    layout that wrote them.
    """

    def __init__(self, loader, writes: bool):
        self.loader, self.writes = loader, writes

    def state_dict(self) -> dict:
        return self.loader.state_dict() if self.writes else {}

    def load_state_dict(self, state_dict: dict):
        self.loader.load_state_dict(state_dict)


class RNGState(Stateful):
    """Every RNG a rank draws from, under keys that say whose (DCP would merge equal keys
    across ranks).

    Torch's generators (dropout) are one stream per data-parallel rank, shared by its
    TP peers (tensor_parallel.py), written by the first of them as ``dp_rank_<d>``; so a
    resume on another layout can only hand a TP group one stream. Python's and numpy's
    are per rank, ``rank_<r>``. A checkpoint of an older version keeps all four under
    ``rank_<r>``, which loads as well.

    CUDA: only the current device's generator, so a rank that lands on another GPU
    index after a restart still continues its own stream.
    """

    def __init__(self, rank: int, dp_rank: int, tp_rank: int):
        self.rank_key = f"rank_{rank}"
        self.shared_key = f"dp_rank_{dp_rank}"
        self.writes_shared = tp_rank == 0

    def keys(self) -> list[str]:
        """The entries this rank loads, if the checkpoint has them."""
        return [self.shared_key, self.rank_key]

    def state_dict(self) -> dict:
        own = {"python": random.getstate(), "numpy": np.random.get_state()}
        state = {self.rank_key: pickle.dumps(own)}
        if self.writes_shared:
            shared = {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            }
            state[self.shared_key] = pickle.dumps(shared)
        return state

    def load_state_dict(self, state_dict: dict):
        for key in self.keys():
            if key in state_dict:
                _set_rng(pickle.loads(state_dict[key]))


def _set_rng(state: dict):
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
