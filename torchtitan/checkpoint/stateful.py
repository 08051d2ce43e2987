"""The ``Stateful`` adapters: what each checkpointed component saves and restores.

Owns: the model and optimizer through torch's distributed state-dict API (sharded
under FSDP, so each rank saves and loads its own shard), the train state, and every
RNG a rank draws from.

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


class RNGState(Stateful):
    """Every RNG a rank draws from, keyed by rank (DCP would merge equal keys across ranks).

    CUDA: only the current device's generator, so a rank that lands on another GPU
    index after a restart still continues its own stream.
    """

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict:
        state = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        return {self.key: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict):
        state = pickle.loads(state_dict[self.key])
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
