"""Integrity of a checkpoint's bytes: digests, fsync, verification, the format check.

Owns: which files of a DCP folder a rank wrote, their signatures (size + CRC32 on a
local disk, size + ETag on an object store: ``store``), written into the manifest when
a save is finalized, verifying files against them, whether a save being written holds
every byte its DCP metadata names, and whether this version can read a checkpoint's
format.

Cost: every function reads only the files it is given; the job splits a folder's files
over its ranks, so each rank pays O(own shard) (see ``CheckpointManager``).

Never: rename, delete or choose checkpoints; use a process group.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from torchtitan.checkpoint.folder import (
    FORMAT_VERSION,
    MANIFEST,
    PENDING,
    WEIGHTS_FORMATS,
    read_manifest,
)
from torchtitan.checkpoint.store import join, mismatch, store_for
from torchtitan.io import storage


def own_files(path: str, rank: int) -> list[str]:
    """The files of a DCP checkpoint that ``rank`` wrote: its ``__<rank>_*.distcp`` data
    files, and DCP's ``.metadata`` for rank 0 (DCP's coordinator). Cost: one listing."""
    names = sorted(n for n in store_for(path).listdir(path) if n.startswith(f"__{rank}_"))
    return [*names, ".metadata"] if rank == 0 else names


def data_files(path: str) -> list[str]:
    """Every file of a checkpoint folder that the manifest digests (all but the manifests)."""
    return sorted(n for n in store_for(path).listdir(path) if n not in (MANIFEST, PENDING))


def digest(path: str, names: list[str]) -> dict[str, dict]:
    """The signature of each named file (``store``: size and CRC32 locally, size and
    ETag on an object store).

    Cost: locally, reads those files once (normally still in the page cache): O(own
    bytes), spread over up to 8 threads; on a store, one HEAD request per file, 8 at a
    time (a round trip each: a 125M save's 26 one after another took ~0.1-0.2 s of its
    durable time on the local server; ~16 a rank at 1,000 ranks).
    """
    store = store_for(path)
    signatures = _each(store, lambda name: store.signature(join(path, name)), names)
    return dict(zip(names, signatures))


def fsync_files(path: str, names: list[str]):
    """Flush the named files to stable storage (nothing on a store: a PUT is durable)."""
    store_for(path).sync_files(path, names)


def verify_files(path: str, expected: dict[str, dict]) -> str | None:
    """None if every named file is present with its signature, else the problem (the
    first in name order). On an object store the checks (a HEAD each, a round trip) run
    8 at a time: one after another they took 0.15 s of a 125M resume's 2 s on the local
    server, and at 100 ms a round trip a rank's ~16 files at 1,000 ranks would take
    1.6 s. Locally each file's CRC32 is already spread over threads (``store``)."""
    store = store_for(path)
    names = sorted(expected)
    # a CRC32 is checked by reading the file, already over threads (``crc32_chunks``)
    heads = all("etag" in expected[n] for n in names)
    problems = _each(store, lambda name: store.check(join(path, name), expected[name]), names,
                     at_once=heads)  # fmt: skip
    return next((p for p in problems if p), None)


def _each(store, fn, names: list[str], at_once: bool = True):
    """``fn`` of each name, in order, lazily: on an object store 8 at a time where
    ``at_once`` (each a HEAD, a round trip), else one after another."""
    if not (at_once and store.in_place) or len(names) < 2:
        yield from map(fn, names)
        return
    with ThreadPoolExecutor(min(8, len(names)), thread_name_prefix="store-check") as pool:
        yield from pool.map(fn, names)


def manifest_or_problem(path: str) -> tuple[dict | None, str | None]:
    """A checkpoint's manifest, or the problem that names why it cannot be read."""
    try:
        return read_manifest(path), None
    except (OSError, ValueError) as e:
        return None, f"unreadable {MANIFEST} ({e})"


def verify_share(path: str, rank: int, world_size: int, manifest: dict | None = None
                 ) -> str | None:  # fmt: skip
    """This rank's share of verifying a checkpoint. Locally (CRC32s): every
    ``world_size``-th file of its manifest, from ``rank``: O(total bytes / ranks). On a
    store (ETags): the files of the writers ``listing_share`` gives it, each writer's in
    one listing, and rank 0 the rest (DCP's ``.metadata``) by HEAD: about one request a
    rank where there were O(files / ranks) HEADs (~16 a rank at 1,000 ranks: 16,000
    requests on one prefix at every start, which S3 serves at ~5,500 a second).
    ``manifest``: the checkpoint's, read once for the job (the manager's), else read here."""
    if manifest is None:
        manifest, problem = manifest_or_problem(path)
        if problem is not None:
            return problem
    files = manifest.get("files", {})
    store = store_for(path)
    listing = storage.on_s3(path)  # s3fs lists by prefix; other stores' HEADs as before
    if not (listing and files and all("etag" in sig for sig in files.values())):
        names = sorted(files)[rank::world_size]
        return verify_files(path, {n: files[n] for n in names})
    writers, others = listing_share(sorted(files), rank, world_size)
    for writer, names in writers.items():
        found = store.listed(path, f"__{writer}_")
        problem = next((p for n in names if (p := mismatch(join(path, n), found.get(n), files[n]))), None)  # fmt: skip
        if problem:
            return problem
    return verify_files(path, {n: files[n] for n in others})


def listing_share(names: list[str], rank: int, world_size: int) -> tuple[dict, list[str]]:
    """Which files of a checkpoint on a store ``rank`` verifies: ({writer: its files},
    the others). DCP names each data file after the rank that wrote it
    (``__<writer>_<i>.distcp``), so a listing of ``__<writer>_`` returns one writer's
    files alone; writer w goes to rank w % world_size (any layout, any rank count), the
    files of no writer to rank 0. Every file to exactly one rank. Cost: O(names)."""
    writers: dict[int, list[str]] = {}
    others = []
    for name in names:
        found = _WRITER.match(name)
        if found is None:
            if rank == 0:
                others.append(name)
        elif int(found.group(1)) % world_size == rank:
            writers.setdefault(int(found.group(1)), []).append(name)
    return writers, others


_WRITER = re.compile(r"__(\d+)_")


def verify_checkpoint(path: str) -> str | None:
    """Whole-folder verification in one process (tools and tests; jobs split it by rank)."""
    return verify_share(path, 0, 1)


def format_problem(
    path: str, manifest: dict | None = None, weights_only: bool = False
) -> str | None:
    """Why this version cannot read the checkpoint at ``path`` (its format), or None.

    ``weights_only``: only the model's tensors are read (initial weights), which every
    format in ``WEIGHTS_FORMATS`` stores alike.
    """
    version = (manifest if manifest is not None else read_manifest(path)).get("format_version")
    if version == FORMAT_VERSION or (weights_only and version in WEIGHTS_FORMATS):
        return None
    if version == 2:
        return (
            "has format 2, this version reads 3 (format 2 stores the loader and RNG entries "
            "as pickles, which this version never executes)"
        )
    return f"has format {version}, this version reads {FORMAT_VERSION}"


def dcp_data_complete(path: str) -> bool:
    """Whether a DCP folder holds its metadata and every byte range the metadata names.

    Cost: reads the metadata and stats each data file (no data bytes are read).
    """
    store = store_for(path)
    try:
        metadata = store.reader(path).read_metadata()
    except Exception:  # noqa: BLE001 - no or unreadable metadata: not complete
        return False
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, end in needed.items():
        full = join(path, name)
        if not store.isfile(full) or store.size(full) < end:
            return False
    return True
