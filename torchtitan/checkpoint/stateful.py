"""The checkpoint adapters: what each checkpointed component saves, which entries it
expects from a given checkpoint, and how it loads them.

Owns: one ``Adapter`` per component, all with the same interface, and the list of what
a training checkpoint holds (``training_components``): the model and optimizer through
torch's distributed state-dict API (DTensors under FSDP, HSDP and TP, so each rank
saves and loads its own shard and DCP reshards across layouts), the LR schedule, the
train state, the loader's position (its entry and its checks are the data side's,
``data/state.py``; the adapter wraps it) and every RNG a rank draws from.

Adding a component is writing an adapter and listing it in ``training_components``;
the manager handles every adapter alike and names none.

Every entry of the project's own (``data_only``) is a tensor: the train state's
counters, the torch generators' states (uint8 tensors already), and JSON in a uint8
tensor for the Python and numpy RNG states (entries.py) and the loader position
(data/state.py).
Nothing here pickles.

Cost: building the load targets reads DCP's metadata only (O(entries)); the model's and
optimizer's are this rank's shard.

Never: choose, write or verify checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint.compat import model_mismatch, optimizer_mismatch
from torchtitan.checkpoint.entries import empty_like_saved, from_tensor, to_tensor
from torchtitan.checkpoint.folder import CheckpointError

logger = logging.getLogger("torchtitan")


@dataclass
class Saved:
    """What a checkpoint holds for one component, as its adapter sees it before loading:
    ``entries`` maps the component's keys (its name's prefix taken off) to DCP's metadata
    for them; ``manifest`` is the checkpoint's manifest."""

    path: str
    manifest: dict
    entries: dict = field(default_factory=dict)

    @property
    def config(self) -> dict:
        return self.manifest.get("config") or {}


class Adapter(Stateful):
    """A checkpointed component.

    - ``state_dict()``: what it saves (tensors, or DTensors of this rank's shard);
    - ``load_targets(saved)``: what it expects from the checkpoint ``saved`` describes,
      as the tensors for DCP to fill (keys as in ``state_dict``), or None to load
      nothing; it raises a one-line ``CheckpointError`` where the checkpoint does not
      fit this run;
    - ``load_state_dict(state)``: apply what DCP filled in;
    - ``not_loaded(saved)``: the checkpoint holds it but the user left it out.

    ``weights``: part of a weights-only checkpoint. ``data_only``: its entries are the
    project's own tensors, so one that is not a tensor is refused unread. ``resumes``:
    loading it continues a run, so the config's changes since are logged.
    """

    weights = False
    data_only = False
    resumes = False

    def load_targets(self, saved: Saved) -> dict | None:
        return self.state_dict()

    def not_loaded(self, saved: Saved):
        pass


class StatefulAdapter(Adapter):
    """Any object with torch's ``Stateful`` protocol (an LR scheduler), loaded as saved."""

    def __init__(self, component):
        self.component = component

    def state_dict(self) -> dict:
        return self.component.state_dict()

    def load_state_dict(self, state_dict: dict):
        self.component.load_state_dict(state_dict)


@dataclass
class TrainState(Adapter):
    step: int = 0
    tokens_seen: int = 0
    # The timeline this state is on: ``[branch, first step]`` segments, oldest first; a
    # branch begins where a run starts from a state (``branch``) and is adopted whole by
    # a replica group that heals from a peer. The records (metrics, provenance, a replica
    # group's tries) tag each line with its branch, so that a start keeps the lines of
    # its own timeline only (records.metrics.on_lineage): a replica group that loads a
    # peer's checkpoint of another branch drops its own lines of the abandoned one. Cost:
    # a segment per start (a few dozen bytes; thousands of restarts are kilobytes).
    lineage: list = field(default_factory=list)

    data_only = True
    resumes = True

    def state_dict(self) -> dict:
        # Tensors, not Python ints: DCP would pickle an int (torch.save).
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen),
                "lineage": to_tensor(self.lineage)}  # fmt: skip

    def load_targets(self, saved: Saved) -> dict:
        state = self.state_dict()
        if "lineage" in saved.entries:
            state["lineage"] = empty_like_saved(saved.entries["lineage"])
        else:  # a checkpoint from before lineages: its timeline is the records' as they are
            del state["lineage"]
        return state

    def load_state_dict(self, state_dict: dict):
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        lineage = state_dict.get("lineage")
        self.lineage = [] if lineage is None else [list(s) for s in from_tensor(lineage)]

    def branch(self):
        """Begin a branch at this state's step (a start from a checkpoint or from step 0,
        a rewind): ``[id, step + 1]`` appended, segments that begin after the step dropped.
        The id is a digest of the lineage kept and the step: the ranks of a run that start
        from the same state are on the same branch. Replica groups name it again at each
        quorum until its first step is committed (``name_branch``)."""
        kept = [s for s in self.lineage if s[1] <= self.step]
        self.lineage = [*kept, [_digest([kept, self.step]), self.step + 1]]

    def name_branch(self, quorum: str | None):
        """Fault tolerance, at each quorum, before its try: where this state's last
        segment begins at the step about to be tried (no step of it committed yet), its
        id becomes a digest of the lineage before it, the step and the ``quorum``'s key,
        the same in every group of the quorum (each names it alike, a group healed in it
        included) and in no quorum of another start. Not the start's digest alone: two
        lives of a job that start from the same state (a whole-job relaunch whose
        checkpoint never became durable starts from step 0 again) would share a branch,
        and a group that heals into the second would keep its lines of the first
        (trial 920008). Cost: one digest a quorum while the segment is unnamed."""
        if self.lineage and self.lineage[-1][1] == self.step + 1:
            kept = self.lineage[:-1]
            self.lineage[-1] = [_digest([kept, self.step, quorum]), self.step + 1]

    @property
    def current_branch(self) -> str:
        return self.lineage[-1][0] if self.lineage else ""


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]


class ModelState(Adapter):
    """This rank's shard of the weights, refused in one line where a weight's shape
    differs from the checkpoint's (before any tensor is read)."""

    weights = True

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_targets(self, saved: Saved) -> dict:
        state = self.state_dict()
        problem = model_mismatch(state, saved.entries)
        if problem:
            flavor = (saved.config.get("model") or {}).get("flavor")
            raise CheckpointError(
                f"checkpoint {saved.path} does not fit this model: {problem}; resume with the "
                f"model.flavor ({flavor!r}) and tokenizer of the run that wrote it"
            )
        return state

    def load_state_dict(self, state_dict: dict):
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Adapter):
    """The optimizer's moments come from the checkpoint; its hyperparameters (lr, betas,
    weight decay, eps) stay those of the config this run was built from."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_targets(self, saved: Saved) -> dict:
        state = self.state_dict()
        problem = optimizer_mismatch(state, saved.entries, saved.config)
        if problem:
            old = (saved.config.get("optimizer") or {}).get("name", "of the run that wrote it")
            new = type(self.optimizer).__name__  # the config's name (AdamW, Muon, ...)
            raise CheckpointError(
                f"checkpoint {saved.path}: {problem} ({new}); resume with --optimizer.name {old}, "
                f"or start {new}'s state afresh with --checkpoint.exclude_from_loading optimizer"
            )
        return state

    def load_state_dict(self, state_dict: dict):
        configured = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        for group, hyper in zip(self.optimizer.param_groups, configured):
            group.update(hyper)


class DataLoaderState(Adapter):
    """The loader's entry, as the data side keeps it (``data.state.LoaderState``: its
    key and format, which rank writes it, which entry a rank loads, and the refusal of a
    position saved in other data): the adapter moves it between the loader and DCP."""

    data_only = True

    def __init__(self, state):
        self.state = state

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def own_state(self) -> dict:
        """This rank's loader position whether or not it writes the checkpoint's entry
        (a heal reaches every rank, a checkpoint one rank of each TP group)."""
        return self.state.loader.state_dict()

    def load_targets(self, saved: Saved) -> dict:
        """The one entry this rank loads, as an empty tensor of the saved size for DCP to fill."""
        fingerprint = saved.manifest.get("data_fingerprint") or {}
        key = self.state.entry_to_load(list(saved.entries), fingerprint, saved.path)
        return {key: empty_like_saved(saved.entries[key])}

    def not_loaded(self, saved: Saved):
        self.state.not_loaded(saved.manifest.get("data_fingerprint") or {}, saved.path)

    def load_state_dict(self, state_dict: dict):
        self.state.load_state_dict(state_dict)


class RNGState(Adapter):
    """Every RNG a rank draws from, under keys that say whose (DCP would merge equal keys
    across ranks).

    Torch's generators (dropout) are one stream per data-parallel rank and pipeline
    stage, shared by its TP peers (tensor_parallel.py), written by the first of them as
    ``dp_rank_<d>`` (``pp_rank_<p>_dp_rank_<d>`` for a later stage; and ``cuda_...``):
    the generators' own uint8 state tensors; so a resume on another layout can only
    hand a TP group one stream. Python's and numpy's are per
    rank, ``rank_<r>``, as JSON in a uint8 tensor.

    CUDA: only the current device's generator, so a rank that lands on another GPU
    index after a restart still continues its own stream.
    """

    data_only = True

    def __init__(self, rank: int, dp_rank: int, tp_rank: int, pp_rank: int = 0):
        self.rank_key = f"rank_{rank}"
        # Pipeline stages draw their own dropout masks: a stream each, the first stage's
        # under the name it has without a pipeline.
        stage = f"pp_rank_{pp_rank}_" if pp_rank else ""
        self.shared_key = f"{stage}dp_rank_{dp_rank}"
        self.cuda_key = f"cuda_{stage}dp_rank_{dp_rank}"
        self.writes_shared = tp_rank == 0

    def load_targets(self, saved: Saved) -> dict | None:
        """Empty tensors of the saved sizes for the entries this rank loads; those the
        checkpoint lacks (written at another layout) keep their seeded generators."""
        wanted = [self.shared_key, self.rank_key]
        if torch.cuda.is_available():
            wanted.append(self.cuda_key)
        found = {k: empty_like_saved(saved.entries[k]) for k in wanted if k in saved.entries}
        missing = [k for k in wanted[:2] if k not in found]
        if missing:
            logger.warning(
                "checkpoint has no RNG entry %s (written at another layout): this rank keeps "
                "its seeded generators for it",
                ", ".join(missing),
            )
        return found or None

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


def training_components(cfg, dims, *, model, optimizer, lr_scheduler=None, dataloader=None,
                        train_state: TrainState, fingerprint: dict,
                        guard: Adapter | None = None) -> dict[str, Adapter]:  # fmt: skip
    """What a training checkpoint holds, in load order (the model is checked against
    the checkpoint before the optimizer's state is built), each under its adapter.
    ``lr_scheduler`` and ``dataloader`` may be None (a seed checkpoint, a benchmark);
    ``guard``: the spike check's window and counters (spikes.SpikeGuard), saved as
    ``spikes`` (a checkpoint without it leaves the guard empty)."""
    components: dict[str, Adapter] = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
    }
    if lr_scheduler is not None:
        components["lr_scheduler"] = StatefulAdapter(lr_scheduler)
    if dataloader is not None:
        components["dataloader"] = DataLoaderState(
            dataloader.checkpoint_state(dims, fingerprint, cfg.checkpoint.accept_data_change)
        )
    components["train_state"] = train_state
    if guard is not None:
        components["spikes"] = guard
    components["rng"] = RNGState(dims.rank, dims.dp_rank, dims.tp_rank, dims.pp_rank)
    return components
