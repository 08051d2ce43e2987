"""The data-parallel-aware loader: a torch DataLoader over a TokenDataset, with its own state.

Owns: batching, worker processes, and the loader state as checkpointed: one entry
per data-parallel rank (``dp_rank_<r>``, since DCP de-duplicates equal keys across
ranks) holding the layout it was saved at, the state of every virtual shard the
rank owns, each consumer's round-robin position and which worker's batch is next.

The state is *owned here*, not read out of a DataLoader: every batch carries the
post-batch state of the shards it came from (see dataset.py), and the loader
keeps the latest one per shard as batches are handed to the trainer. So a
checkpoint holds exactly what was consumed, whatever workers have prefetched;
saving costs no round-trip to the workers and no replay; and resuming, on the
same layout or another one, is the same path: give each shard state to its owner.

A worker sends its batches in *groups* (enough batches for ``GROUP_TOKENS`` tokens)
as numpy arrays in one message: a message costs both sides more than making a small
batch does. This process keeps one received group per worker and hands their batches
out round-robin, one worker at a time as without groups, so neither the order nor
the equal pace of the shards depends on the group size, and the state stays "whose
batch is next".

Never: decide which data a shard reads (dataset.py) or touch checkpoint files.
"""

from __future__ import annotations

import functools
import logging
import pickle
import signal
import time

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.data.dataset import TokenDataset, as_tensors, collate
from torchtitan.data.sources import DataError

logger = logging.getLogger(__name__)

KEY_PREFIX = "dp_rank_"
STATE_VERSION = 3  # 3: streaming positions are (epoch, unit, at)
# Tokens a worker sends per message at least (in whole batches, at most MAX_GROUP): a
# message costs ~0.5 ms between pickling, queueing and polling, more than a batch of
# 8 x 128 tokens takes to make, and nothing next to one of 8 x 2048.
GROUP_TOKENS = 16_384
MAX_GROUP = 64


def group_size(batch_size: int, seq_len: int, num_workers: int) -> int:
    """Batches per worker message: 1 without workers."""
    if not num_workers:
        return 1
    return min(MAX_GROUP, -(-GROUP_TOKENS // (batch_size * (seq_len + 1))))


class WorkerGroups(IterableDataset):
    """What one loader worker yields: lists of ``group`` collated batches of its consumer."""

    def __init__(self, dataset: TokenDataset, batch_size: int, collate, group: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate
        self.group = group

    def __iter__(self):
        samples = iter(self.dataset)
        while True:
            yield [
                self.collate([next(samples) for _ in range(self.batch_size)])
                for _ in range(self.group)
            ]


# Signals that ask a job to stop (schedulers send SIGTERM or SIGUSR1 to the whole
# process group, workers included). The rank decides when to stop and shuts its
# workers down; a worker killed by one would instead break the rank's next batch and
# the save it was about to make. Workers still exit with their parent.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def _leave_stop_signals_to_the_rank(worker_id: int):
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _as_is(group: list[dict]) -> list[dict]:
    return group


class ParallelDataLoader(Stateful):
    """Batches for one data-parallel rank, with a per-rank checkpoint entry."""

    def __init__(
        self,
        dataset: TokenDataset,
        batch_size: int,
        *,
        num_workers: int = 0,
        auto_shards: bool = False,
        document_layout: bool = False,
        accumulation: int = 1,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.accumulation = accumulation  # micro-batches per optimizer step (layout only)
        self.num_workers = num_workers
        self.dp_rank, self.dp_world = dataset.dp_rank, dataset.dp_world
        # The shard count was chosen for this run (training.data_shards = 0): a resume
        # adopts the checkpoint's instead.
        self.auto_shards = auto_shards
        # Batches carry per-document positions and ids only for a model that uses them.
        # A worker's batches cross to this process as arrays (see collate).
        self.collate = functools.partial(
            collate, document_layout=document_layout, transfer=num_workers > 0
        )
        check_equal_rates(dataset.data_shards, self.dp_world, num_workers)
        self._loader: DataLoader | None = None
        self._iter = None
        # The consumed position: shard -> state after the last batch it gave the trainer
        # (shards absent here have emitted nothing since the start or the load).
        self._shard_states: dict[int, dict] = {}
        self._next: dict[int, int] = {}  # consumer -> round-robin position among its shards
        self._turn = 0  # index (among this rank's workers) of the consumer whose batch is next
        self.group = group_size(batch_size, dataset.seq_len, num_workers)
        # Per worker (by its id in the running DataLoader): the rest of its last group.
        self._held: list[list[dict]] = []
        self._slot = 0  # id of the worker whose batch is next
        self._skipped: dict[int, int] = {}
        self.last_wait_s = 0.0

    def layout(self) -> dict:
        return {
            "dp_world": self.dp_world,
            "num_workers": self.num_workers,
            "data_shards": self.dataset.data_shards,
            "batch_size": self.batch_size,
            "accumulation": self.accumulation,
            "seq_len": self.dataset.seq_len,
        }

    def _start(self):
        # The loader's own generator: with workers the iterator draws a base seed when
        # it starts, and from the global RNG that draw would shift dropout masks after
        # a resume.
        generator = torch.Generator().manual_seed(self.dataset.seed + self.dp_rank)
        self.dataset.worker_rotation = self._turn
        workers = self.num_workers
        if workers:
            groups = WorkerGroups(self.dataset, self.batch_size, self.collate, self.group)
            self._loader = DataLoader(
                groups,
                batch_size=None,
                num_workers=workers,
                collate_fn=_as_is,
                prefetch_factor=4 if self.group == 1 else 2,  # keeps every worker busy
                persistent_workers=True,
                generator=generator,
                worker_init_fn=_leave_stop_signals_to_the_rank,
            )
        else:
            self._loader = DataLoader(
                self.dataset,
                batch_size=self.batch_size,
                collate_fn=self.collate,
                generator=generator,
            )
        self._held, self._slot = [[] for _ in range(workers)], 0
        self._iter = iter(self._loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        if self._iter is None:
            self._start()
        if self.num_workers:
            held = self._held[self._slot]
            if not held:
                # Groups are all one size and handed out round-robin, so the worker whose
                # group ran out is the one the DataLoader (in order) sends next.
                held[:] = next(self._iter)[::-1]  # popped from the end
            batch = as_tensors(held.pop())
            self._slot = (self._slot + 1) % self.num_workers
            self._turn = (self._turn + 1) % self.num_workers
        else:
            batch = next(self._iter)
        self.last_wait_s = time.perf_counter() - start
        self._shard_states.update(batch["shard_states"])
        self._next[batch["consumer"]] = batch["next"]
        self._skipped[batch["consumer"]] = batch["skipped"]
        return batch

    def skipped_documents(self) -> int:
        """Documents dropped by the bad-data policy on this rank, as of the last batch."""
        return sum(self._skipped.values())

    # ---- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's entry. Cost: O(shards this rank owns), no worker round-trip."""
        initial = None
        shards = {}
        for v in self.dataset.rank_shards(self.num_workers):
            if v not in self._shard_states and initial is None:
                initial = self.dataset.initial_shard_state()
            shards[v] = self._shard_states.get(v, initial)
        entry = {
            "version": STATE_VERSION,
            "layout": self.layout(),
            "shards": shards,
            "next": dict(self._next),
            "turn": self._turn,
        }
        return {f"{KEY_PREFIX}{self.dp_rank}": pickle.dumps(entry)}

    def seek(self, shard_states: dict[int, dict]):
        """Place this rank's shards at the given states, as if trained to them (for tools and
        benchmarks that need a far-along state without the hours of training)."""
        owned = set(self.dataset.rank_shards(self.num_workers))
        self._shard_states = {int(v): s for v, s in shard_states.items() if int(v) in owned}
        self._next, self._turn = {}, 0
        self.dataset.load_shard_states(self._shard_states)
        self._loader = self._iter = None

    def load_state_dict(self, state_dict: dict):
        """Load from the entries of one or all old ranks (all are needed to reshard).

        Cost: unpickling the entries given (a few KB per old rank); the shards'
        documents are read lazily by their new owners, one per shard and source.
        """
        entries = {
            int(k[len(KEY_PREFIX) :]): pickle.loads(v)
            for k, v in state_dict.items()
            if k.startswith(KEY_PREFIX) and v
        }
        if not entries:
            raise DataError("the checkpoint holds no dataloader entry (dp_rank_<r>)")
        versions = {e.get("version") for e in entries.values()}
        if versions != {STATE_VERSION}:
            raise DataError(
                f"the checkpoint's dataloader state has format {sorted(map(str, versions))}, this "
                f"version reads {STATE_VERSION}; resume with the version that wrote it, or pass "
                "--checkpoint.exclude_from_loading dataloader to restart the data"
            )
        old = next(iter(entries.values()))["layout"]
        if self.auto_shards and old["data_shards"] != self.dataset.data_shards:
            check_equal_rates(old["data_shards"], self.dp_world, self.num_workers)
            logger.info(
                "virtual shards: %d, as the checkpoint was started with (training.data_shards = 0)",
                old["data_shards"],
            )
            self.dataset.data_shards = old["data_shards"]
        new = self.layout()
        _check_compatible(old, new)
        if (old["dp_world"], old["num_workers"]) == (new["dp_world"], new["num_workers"]):
            if self.dp_rank not in entries:
                raise DataError(
                    f"the checkpoint has no dataloader entry for dp_rank_{self.dp_rank} "
                    f"(it has {sorted(entries)}); was it written by another job?"
                )
            mine = entries[self.dp_rank]
            shard_states, self._next, self._turn = mine["shards"], mine["next"], mine["turn"]
        else:
            shard_states = _all_shard_states(entries, old, new)
            self._next, self._turn = {}, 0
        owned = set(self.dataset.rank_shards(self.num_workers))
        self._shard_states = {v: s for v, s in shard_states.items() if v in owned}
        self.dataset.load_shard_states(shard_states, next_by_consumer=self._next)
        self._loader = self._iter = None  # workers must start from the loaded state


def check_equal_rates(data_shards: int, dp_world: int, num_workers: int):
    """Refuse a layout whose consumers would own unequal numbers of shards.

    Consumers visit their shards round-robin, so a consumer with fewer shards would read
    each of them faster: parts of the corpus would start a new epoch while others are
    still unread. With ``consumers | data_shards`` every shard advances at the same rate.
    """
    consumers = dp_world * max(1, num_workers)
    if data_shards % consumers == 0:
        return
    fits = [c for c in range(1, data_shards + 1) if data_shards % c == 0]
    raise DataError(
        f"{consumers} data consumers ({dp_world} ranks x {max(1, num_workers)}) do not divide "
        f"training.data_shards={data_shards}, so some shards would be read faster than others; "
        f"use a ranks x max(1, workers) count among {fits}, or data_shards a multiple of "
        f"{consumers} (0 chooses one at the start of a run)"
    )


def _all_shard_states(entries: dict[int, dict], old: dict, new: dict) -> dict[int, dict]:
    """The union of every old rank's shard states; each shard exactly once."""
    missing = sorted(set(range(old["dp_world"])) - set(entries))
    if missing:
        raise DataError(f"cannot reshard data state: entries of old ranks {missing} are missing")
    shard_states: dict[int, dict] = {}
    for rank in sorted(entries):
        for v, s in entries[rank]["shards"].items():
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
    # A shard absent here would silently restart from its beginning: insist on all.
    absent = sorted(set(range(new["data_shards"])) - set(shard_states))
    if absent:
        raise DataError(
            f"cannot reshard data state: virtual shards {absent[:10]} have no saved state"
        )
    return shard_states


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
    old_global = _global_batch(old)
    new_global = _global_batch(new)
    if old_global != new_global:
        per_pass = new["dp_world"] * new["batch_size"]
        hint = (
            f"keep it with --training.global_batch_size {old_global}"
            if old_global % per_pass == 0
            else f"{old_global} is not a multiple of {new['dp_world']} ranks x micro-batch "
            f"{new['batch_size']}; choose a micro-batch (training.batch_size) that divides "
            f"{old_global // new['dp_world'] if old_global % new['dp_world'] == 0 else old_global}"
        )
        raise DataError(
            f"global batch size changed from {old_global} ({_batch_text(old)}) to {new_global} "
            f"({_batch_text(new)}); {hint}"
        )


def _global_batch(layout: dict) -> int:
    return layout["dp_world"] * layout["batch_size"] * layout.get("accumulation", 1)


def _batch_text(layout: dict) -> str:
    return (
        f"{layout['dp_world']} ranks x {layout['batch_size']} x "
        f"{layout.get('accumulation', 1)} micro-batches"
    )
