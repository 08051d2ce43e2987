"""The Stateful token dataset: sources -> token buffers -> sequences, by virtual shard.

Owns: the fixed set of ``data_shards`` virtual shards (each a packer per source
and a seeded choice among sources), which of them one consumer (a data-parallel
rank, or one loader worker of it) owns, and the state of those shards.

The data order depends only on the number of virtual shards, never on the number
of ranks or workers: consumer ``c`` of ``P`` owns shards ``c, c+P, c+2P, ...`` and
visits them round-robin. Resuming on another layout hands every saved shard
state to its new owner, so each token is still read exactly once.

Every sample carries the state of its shard *after* that sample (a position: a
few numbers per source), so whoever receives the sample knows the shard's state
without asking the process that produced it.

Never: touch torch.distributed, the DataLoader or checkpoint files.
"""

from __future__ import annotations

import bisect
import logging
import random

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.data.packing import DocumentPacker, EmptyShard
from torchtitan.data.sources import DataError, SourceSpec, make_cursor, open_source

logger = logging.getLogger(__name__)

STATE_KIND = "token_dataset/v1"


class VirtualShard:
    """One virtual shard: a packer per source and a seeded, counter-based source choice."""

    def __init__(
        self, index: int, num_shards: int, sources, tokenizer, window: int, seed: int, bad_data: str
    ):
        self.index = index
        self.window = window
        self.seed = seed
        self.packers = [
            DocumentPacker(make_cursor(src, index, num_shards), tokenizer, src.spec.name, bad_data)
            for src in sources
        ]
        weights = np.array([src.spec.weight for src in sources], dtype=np.float64)
        self._cumulative = list(np.cumsum(weights / weights.sum()))
        self.emitted = 0

    def _choose_source(self) -> int:
        if len(self.packers) == 1:
            return 0
        # A counter-based draw: the state is just `emitted`, and it restores exactly.
        u = random.Random(f"mix/{self.seed}/{self.index}/{self.emitted}").random()
        return min(bisect.bisect_right(self._cumulative, u), len(self.packers) - 1)

    def next_sequence(self) -> tuple[np.ndarray, list[list], list[list]]:
        """The next window, its spans, and ``[shard, source, epoch]`` if it began an epoch."""
        packer = self.packers[self._choose_source()]
        tokens, spans = packer.take(self.window)
        self.emitted += 1
        started = packer.started_epoch
        return tokens, spans, ([[self.index, packer.source_name, started]] if started else [])

    @property
    def skipped(self) -> int:
        return sum(p.skipped for p in self.packers)

    def state_dict(self) -> dict:
        return {"emitted": self.emitted, "sources": [p.state_dict() for p in self.packers]}

    def load_state_dict(self, state: dict):
        if len(state["sources"]) != len(self.packers):
            raise DataError(
                f"saved data state has {len(state['sources'])} sources, the config has "
                f"{len(self.packers)}; resume with the original training.datasets"
            )
        self.emitted = int(state["emitted"])
        for packer, s in zip(self.packers, state["sources"]):
            packer.load_state_dict(s)


class TokenDataset(IterableDataset, Stateful):
    """Endless stream of ``{"input", "label", "spans"}`` for one data-parallel rank.

    Each sample is a window of ``seq_len + 1`` tokens: ``input = window[:-1]`` and
    ``label = window[1:]``. ``spans`` lists where the window's tokens came from.
    """

    def __init__(
        self,
        sources: list[SourceSpec],
        tokenizer,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world: int = 1,
        data_shards: int = 64,
        seed: int = 0,
        shuffle: bool = True,
        streaming: bool = False,
        text_field: str = "text",
        id_field: str = "id",
        bad_data: str = "skip",
    ):
        if not sources:
            raise DataError(
                "no data source configured; set training.dataset or training.dataset_path"
            )
        # A source may come opened already (tests share one across many datasets);
        # its order must then be the one this dataset would have opened.
        self.sources = [
            open_source(s, text_field, id_field, seed, shuffle, streaming)
            if isinstance(s, SourceSpec)
            else _check_opened(s, seed, shuffle, streaming, text_field)
            for s in sources
        ]
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.data_shards = data_shards
        self.seed = seed
        self.bad_data = bad_data
        for src in self.sources:
            if not src.streaming and len(src) < data_shards:
                raise DataError(
                    f"dataset {src.spec.where!r} has {len(src)} documents, fewer than "
                    f"training.data_shards={data_shards}; lower training.data_shards"
                )
        self._shards: dict[int, VirtualShard] | None = None
        self._pending: dict[int, dict] = {}  # shard states to apply when shards are built
        self._next = 0  # round-robin position among owned shards
        self._next_by_consumer: dict[int, int] = {}  # restored round-robin positions
        # Worker w of a rank plays consumer (w + worker_rotation) % workers: a loader
        # resumed after k batches starts with the worker whose turn it was.
        self.worker_rotation = 0

    # ---- layout -------------------------------------------------------------------
    def consumer(self) -> tuple[int, int]:
        """(this consumer's index, number of consumers) over ranks x workers."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        worker = (worker + self.worker_rotation) % workers
        return self.dp_rank * workers + worker, self.dp_world * workers

    def rank_shards(self, num_workers: int) -> list[int]:
        """Every virtual shard owned by one of this rank's ``num_workers`` consumers."""
        workers = max(1, num_workers)
        consumers = self.dp_world * workers
        first = self.dp_rank * workers
        return sorted(
            v for c in range(first, first + workers) for v in range(c, self.data_shards, consumers)
        )

    def initial_shard_state(self) -> dict:
        """The state of a shard that has emitted nothing (the same for every shard)."""
        shard = VirtualShard(0, self.data_shards, self.sources, self.tokenizer, self.seq_len + 1,
                             self.seed, self.bad_data)  # fmt: skip
        return shard.state_dict()

    def owned_shards(self) -> list[int]:
        c, n = self.consumer()
        if n > self.data_shards:
            raise DataError(
                f"{n} data consumers (ranks x workers) but only training.data_shards="
                f"{self.data_shards} virtual shards; raise training.data_shards to at least {n}"
            )
        return list(range(c, self.data_shards, n))

    def _build_shards(self) -> dict[int, VirtualShard]:
        if self._shards is None:
            window = self.seq_len + 1
            self._shards = {}
            for v in self.owned_shards():
                shard = VirtualShard(
                    v,
                    self.data_shards,
                    self.sources,
                    self.tokenizer,
                    window,
                    self.seed,
                    self.bad_data,
                )
                if v in self._pending:
                    shard.load_state_dict(self._pending.pop(v))
                self._shards[v] = shard
        return self._shards

    # ---- iteration ----------------------------------------------------------------
    def __iter__(self):
        shards = self._build_shards()
        order = sorted(shards)
        consumer = self.consumer()[0]
        self._next = self._next_by_consumer.pop(consumer, self._next)
        # Running total of skipped documents, kept in O(1) per sample.
        seen = {v: shards[v].skipped for v in order}
        skipped = sum(seen.values())
        # Shards with no usable document are skipped at their turn: which ones is a fact
        # of the data, so a resumed run finds the same ones at the same turns.
        empty: set[int] = set()
        while True:
            v = order[self._next]
            self._next = (self._next + 1) % len(order)
            if v in empty:
                continue
            try:
                tokens, spans, epoch_starts = shards[v].next_sequence()
            except EmptyShard as e:
                empty.add(v)
                logger.warning("skipping virtual shard %d: %s", v, e)
                if len(empty) == len(order):
                    raise DataError(
                        f"no usable document in any of the virtual shards {order} of consumer "
                        f"{consumer}; add usable documents, or use fewer shards (training.data_shards)"
                    ) from e
                continue
            now = shards[v].skipped
            skipped, seen[v] = skipped + now - seen[v], now
            window = tokens.astype(np.int64)
            tensor = torch.from_numpy(window)  # input and label are views of it
            yield {
                "input": tensor[:-1],
                "label": tensor[1:],
                "window": window,
                "spans": spans,
                "consumer": consumer,
                "skipped": skipped,
                "shard": v,
                "shard_state": shards[v].state_dict(),
                "next": self._next,
                "epoch_starts": epoch_starts,
            }

    # ---- state ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        c, n = self.consumer()
        shards = self._build_shards()
        return {
            "kind": STATE_KIND,
            "consumer": c,
            "consumers": n,
            "data_shards": self.data_shards,
            "next": self._next,
            "shards": {v: s.state_dict() for v, s in shards.items()},
        }

    def load_state_dict(self, state: dict):
        c, n = self.consumer()
        if state.get("kind") != STATE_KIND:
            raise DataError(f"data state of kind {state.get('kind')!r} is not a {STATE_KIND} state")
        if (state["consumer"], state["consumers"], state["data_shards"]) != (
            c,
            n,
            self.data_shards,
        ):
            raise DataError(
                f"data state saved for consumer {state['consumer']} of {state['consumers']} with "
                f"{state['data_shards']} shards cannot load into consumer {c} of {n} with "
                f"{self.data_shards} shards directly; it must be resharded"
            )
        self.load_shard_states(state["shards"], next_index=state["next"])

    def load_shard_states(
        self,
        shard_states: dict[int, dict],
        next_index: int = 0,
        next_by_consumer: dict[int, int] | None = None,
    ):
        """Set the state of virtual shards by index (this consumer takes the ones it owns).

        Any consumer layout can load any shard states; ``next_by_consumer`` restores
        the round-robin position of each consumer when the layout is unchanged.
        """
        self._pending = {int(v): s for v, s in shard_states.items()}
        self._shards = None
        self._next = next_index
        self._next_by_consumer = {int(c): int(i) for c, i in (next_by_consumer or {}).items()}

    def __getstate__(self):
        # Workers get shard *states*, not live shards (a streaming iterator does not pickle).
        state = self.__dict__.copy()
        if self._shards is not None:
            pending = dict(self._pending)
            pending.update({v: s.state_dict() for v, s in self._shards.items()})
            state["_pending"], state["_shards"] = pending, None
        return state


def _check_opened(source, seed: int, shuffle: bool, streaming: bool, text_field: str):
    opened_as = (source.seed, source.shuffle, source.streaming, source.text_field)
    if opened_as != (seed, shuffle, streaming, text_field):
        raise DataError(
            f"source {source.spec.name!r} was opened as (seed, shuffle, streaming, text_field)="
            f"{opened_as}; the dataset wants {(seed, shuffle, streaming, text_field)}"
        )
    return source


def document_positions(spans: list[list], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per input token: its position in its document within this sequence (0 at every
    document start, and at the sequence start for a document continued from the
    previous one), and the index of its document in the sequence. From the spans alone:
    no tokenization. Positions stay below ``length``, whatever the document's size."""
    sizes = [end - start for _, _, start, end, *_ in spans]
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])[:length]
    document_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[:length]
    return positions, document_ids


def collate(samples: list[dict], document_layout: bool = False, transfer: bool = False) -> dict:
    """Stack inputs and labels; keep the ragged provenance spans as a list per sample.

    With ``document_layout`` (``model.attention_mask = "block_causal"`` or
    ``training.mask_document_boundaries``), also ``positions`` and ``document_ids``
    [B, T] of the inputs and ``label_document_ids`` [B, T] of the labels (views of one
    array over the window, as input and label are), from the spans; without it a batch
    carries no such tensors (no work, and nothing more for a worker to send).

    With ``transfer`` (in a loader worker) the arrays stay numpy arrays, under
    ``windows`` (inputs and labels in one), for ``as_tensors`` to turn into tensors in
    the main process without a copy. They then cross in the batch's one pickled message;
    a tensor would cross through shared memory, a file descriptor per tensor, which
    costs more than the tokens themselves for short sequences (seq_len 128, batch 8:
    0.55 M tokens/s with 2 workers as tensors, 1.06 M as arrays; 0 workers: 0.72 M).
    """
    windows = np.stack([s["window"] for s in samples])
    # input and label are views of one array: half the memory, and one transfer.
    batch = {"windows": windows}
    if document_layout:
        length = windows.shape[1] - 1
        layouts = [document_positions(s["spans"], length + 1) for s in samples]
        batch["positions"] = np.stack([p[:length] for p, _ in layouts])
        batch["window_document_ids"] = np.stack([d for _, d in layouts])
    if not transfer:
        batch = as_tensors(batch)
    return {
        **batch,
        "spans": [s["spans"] for s in samples],
        "consumer": samples[-1]["consumer"],
        "skipped": samples[-1]["skipped"],
        # Where each shard stands after this batch: the loader's checkpoint state.
        "shard_states": {s["shard"]: s["shard_state"] for s in samples},
        "next": samples[-1]["next"],
        "epoch_starts": [e for s in samples for e in s["epoch_starts"]],
    }


def as_tensors(batch: dict) -> dict:
    """A collated batch's arrays as tensors (no copy): ``windows`` becomes ``input`` and
    ``label``, and ``window_document_ids`` ``document_ids`` and ``label_document_ids``,
    each pair views of one tensor."""
    if "windows" in batch:
        windows = torch.from_numpy(batch.pop("windows"))
        batch["input"], batch["label"] = windows[:, :-1], windows[:, 1:]
    if "window_document_ids" in batch:
        ids = torch.from_numpy(batch.pop("window_document_ids"))
        batch["document_ids"], batch["label_document_ids"] = ids[:, :-1], ids[:, 1:]
    if "positions" in batch:
        batch["positions"] = torch.from_numpy(batch["positions"])
    return batch
