"""The data-parallel-aware loader: torchdata's StatefulDataLoader over a TokenDataset.

Owns: batching, worker processes, and the loader state as checkpointed: one entry
per data-parallel rank (``dp_rank_<r>``, since DCP de-duplicates equal keys across
ranks) holding the pickled StatefulDataLoader state and the layout it was saved
at. Pickled bytes, because a fresh StatefulDataLoader has no state of its own that
DCP could load into in place.

On a layout change (ranks, workers) it reads *every* old rank's entry and hands
the virtual-shard states to the dataset, which gives each to its new owner.

Never: decide which data a shard reads (dataset.py) or touch checkpoint files.
"""

from __future__ import annotations

import logging
import pickle
import time

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.data.dataset import STATE_KIND, TokenDataset, collate
from torchtitan.data.sources import DataError

logger = logging.getLogger(__name__)

KEY_PREFIX = "dp_rank_"


class ParallelDataLoader(Stateful):
    """Batches for one data-parallel rank, with a per-rank checkpoint entry."""

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        snapshot_every_n_steps: int = 1,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.dp_rank, self.dp_world = dataset.dp_rank, dataset.dp_world
        # The loader's own generator: its iterator draws a base seed when it starts, and
        # from the global RNG that draw would shift dropout masks after a resume.
        generator = torch.Generator().manual_seed(dataset.seed + dataset.dp_rank)
        # Snapshots only where checkpoints are taken: a snapshot costs a state
        # round-trip from every worker, and state_dict() at a snapshot step needs no replay.
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate,
            snapshot_every_n_steps=snapshot_every_n_steps,
            prefetch_factor=4
            if num_workers
            else None,  # keeps both workers busy with in-order delivery
            persistent_workers=num_workers > 0,
            generator=generator,
        )
        self._iter = None
        self._skipped: dict[int, int] = {}
        self.last_wait_s = 0.0

    def layout(self) -> dict:
        return {
            "dp_world": self.dp_world,
            "num_workers": self.num_workers,
            "data_shards": self.dataset.data_shards,
            "batch_size": self.batch_size,
            "seq_len": self.dataset.seq_len,
        }

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        if self._iter is None:
            self._iter = iter(self.loader)
        batch = next(self._iter)
        self.last_wait_s = time.perf_counter() - start
        self._skipped[batch["consumer"]] = batch["skipped"]
        return batch

    def skipped_documents(self) -> int:
        """Documents dropped by the bad-data policy on this rank, as of the last batch."""
        return sum(self._skipped.values())

    # ---- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        entry = {"layout": self.layout(), "loader": self.loader.state_dict()}
        return {f"{KEY_PREFIX}{self.dp_rank}": pickle.dumps(entry)}

    def load_state_dict(self, state_dict: dict):
        """Load from the entries of one or all old ranks (all are needed to reshard)."""
        entries = {
            int(k[len(KEY_PREFIX) :]): pickle.loads(v)
            for k, v in state_dict.items()
            if k.startswith(KEY_PREFIX) and v
        }
        if not entries:
            raise DataError("the checkpoint holds no dataloader entry (dp_rank_<r>)")
        old = next(iter(entries.values()))["layout"]
        new = self.layout()
        _check_compatible(old, new)
        if (old["dp_world"], old["num_workers"]) == (new["dp_world"], new["num_workers"]):
            if self.dp_rank not in entries:
                raise DataError(
                    f"the checkpoint has no dataloader entry for dp_rank_{self.dp_rank} "
                    f"(it has {sorted(entries)}); was it written by another job?"
                )
            self.loader.load_state_dict(entries[self.dp_rank]["loader"])
        else:
            self._reshard(entries, old, new)
        self._iter = None

    def _reshard(self, entries: dict[int, dict], old: dict, new: dict):
        missing = sorted(set(range(old["dp_world"])) - set(entries))
        if missing:
            raise DataError(
                f"cannot reshard data state: entries of old ranks {missing} are missing"
            )
        shard_states: dict[int, dict] = {}
        for rank in sorted(entries):
            loader_state = entries[rank]["loader"]
            if loader_state.get("_steps_since_snapshot", 0):
                raise DataError(
                    f"cannot reshard data state of old rank {rank}: it was saved "
                    f"{loader_state['_steps_since_snapshot']} batches after the loader's last "
                    "snapshot; resume at the old layout once, or from a checkpoint at an interval step"
                )
            for state in _dataset_states(loader_state):
                for v, s in state["shards"].items():
                    if int(v) in shard_states:
                        raise DataError(f"virtual shard {v} appears twice in the saved data state")
                    shard_states[int(v)] = s
        logger.info(
            "resharding data state from %dx%d to %dx%d (ranks x workers; %d virtual shards)",
            old["dp_world"],
            old["num_workers"],
            new["dp_world"],
            new["num_workers"],
            len(shard_states),
        )
        # Shards never iterated before the save carry their initial state; any shard
        # absent here would silently restart, so insist on all of them.
        absent = sorted(set(range(new["data_shards"])) - set(shard_states))
        if absent:
            raise DataError(
                f"cannot reshard data state: virtual shards {absent[:10]} have no saved state"
            )
        self.dataset.load_shard_states(shard_states)


def _check_compatible(old: dict, new: dict):
    if old["data_shards"] != new["data_shards"]:
        raise DataError(
            f"the checkpoint's data state has {old['data_shards']} virtual shards, the config "
            f"{new['data_shards']}; resume with --training.data_shards {old['data_shards']}"
        )
    if old["seq_len"] != new["seq_len"]:
        raise DataError(
            f"the checkpoint was trained at seq_len {old['seq_len']}, the config has "
            f"{new['seq_len']}; resume with --training.seq_len {old['seq_len']}"
        )
    old_global = old["dp_world"] * old["batch_size"]
    new_global = new["dp_world"] * new["batch_size"]
    if old_global != new_global:
        fits = [w for w in range(1, old_global + 1) if old_global % w == 0]
        hint = (
            f"use --training.batch_size {old_global // new['dp_world']}"
            if old_global % new["dp_world"] == 0
            else f"{old_global} does not split over {new['dp_world']} ranks; rank counts that work: {fits}"
        )
        raise DataError(
            f"global batch size changed from {old_global} ({old['dp_world']} ranks x "
            f"{old['batch_size']}) to {new_global} ({new['dp_world']} x {new['batch_size']}); {hint}"
        )


def _dataset_states(obj) -> list[dict]:
    """Every TokenDataset state inside a StatefulDataLoader state (main process or workers)."""
    if isinstance(obj, dict):
        if obj.get("kind") == STATE_KIND:
            return [obj]
        return [s for v in obj.values() for s in _dataset_states(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _dataset_states(v)]
    return []
