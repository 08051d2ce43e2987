"""Integrity of a checkpoint's bytes: digests, fsync, verification, the format check.

Owns: which files of a DCP folder a rank wrote, their size + CRC32 digests (written into
the manifest when a save is finalized), verifying files against those digests, whether
a ``.partial`` holds every byte its DCP metadata names, and whether this version can
read a checkpoint's format.

Cost: every function reads only the files it is given; the job splits a folder's files
over its ranks, so each rank pays O(own shard) (see ``CheckpointManager``).

Never: rename, delete or choose checkpoints; use a process group.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch.distributed.checkpoint as dcp

from torchtitan.checkpoint.folder import (
    FORMAT_VERSION,
    MANIFEST,
    PENDING,
    WEIGHTS_FORMATS,
    read_manifest,
)

# Files are checksummed in chunks, in parallel threads (zlib and file reads release the
# GIL): one CRC32 per 64 MiB, which also says where a file is damaged.
CHECKSUM_CHUNK = 64 << 20
_CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))


def _crc32_range(path: str, offset: int) -> int:
    crc, left = 0, CHECKSUM_CHUNK
    with open(path, "rb") as f:
        f.seek(offset)
        while left > 0 and (block := f.read(min(left, 1 << 22))):
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def _crc32_file(path: str) -> list[int]:
    """CRC32 of each 64 MiB chunk of a file (one chunk for an empty file)."""
    offsets = range(0, max(1, os.path.getsize(path)), CHECKSUM_CHUNK)
    if len(offsets) == 1:
        return [_crc32_range(path, 0)]
    with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="crc32") as pool:
        return list(pool.map(lambda offset: _crc32_range(path, offset), offsets))


def own_files(path: str, rank: int) -> list[str]:
    """The files of a DCP checkpoint that ``rank`` wrote: its ``__<rank>_*.distcp`` data
    files, and DCP's ``.metadata`` for rank 0 (DCP's coordinator)."""
    names = sorted(n for n in os.listdir(path) if n.startswith(f"__{rank}_"))
    return [*names, ".metadata"] if rank == 0 else names


def data_files(path: str) -> list[str]:
    """Every file of a checkpoint folder that the manifest digests (all but the manifests)."""
    return sorted(n for n in os.listdir(path) if n not in (MANIFEST, PENDING))


def digest(path: str, names: list[str]) -> dict[str, dict]:
    """Size and CRC32 of the named files.

    Cost: reads those files once (normally still in the page cache): O(own bytes),
    spread over up to 8 threads.
    """
    return {
        name: {"size": os.path.getsize(os.path.join(path, name)),
               "crc32": _crc32_file(os.path.join(path, name))}
        for name in names
    }  # fmt: skip


def fsync_files(path: str, names: list[str]):
    """Flush the named files to stable storage. Cost: the bytes still dirty in the cache."""
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            os.fsync(f.fileno())


def verify_files(path: str, expected: dict[str, dict]) -> str | None:
    """None if every named file is present with its size and CRC32, else the problem."""
    for name, want in sorted(expected.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"file {full} is missing"
        size = os.path.getsize(full)
        if size != want["size"]:
            return f"file {full} has {size} bytes, expected {want['size']} (truncated?)"
        if _crc32_file(full) != want["crc32"]:
            return f"file {full} fails its checksum (corrupted)"
    return None


def verify_share(path: str, rank: int, world_size: int) -> str | None:
    """This rank's share of verifying a checkpoint: every ``world_size``-th file of its
    manifest, from ``rank``. Cost: O(total bytes / ranks)."""
    try:
        files = read_manifest(path).get("files", {})
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    names = sorted(files)[rank::world_size]
    return verify_files(path, {n: files[n] for n in names})


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
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception:  # noqa: BLE001 - no or unreadable metadata: not complete
        return False
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    for name, end in needed.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.getsize(full) < end:
            return False
    return True
