"""Where checkpoint files live: a local folder, or any fsspec URL (``s3://``, ``gs://``, ...).

Owns: the few file operations the checkpoint package needs (list a folder, test, read
and write small files, remove a tree, set a folder aside, a file's signature, DCP's
reader and writer), once for a local folder (``LocalStore``) and once for an object
store (``ObjectStore``), chosen by the path alone (``store_for``). The package's other
files call these and never ask which kind they have, except ``in_place`` (below).

A local folder keeps its scheme: a save is written into ``step-N.partial``, fsynced and
renamed. An object store has no rename (s3fs "renames" by copying every byte), so
``in_place`` is true there: a save is written into ``step-N/`` itself and is complete
only once ``manifest.json`` exists, which rank 0 writes last, after every rank's DCP
files and DCP's ``.metadata`` are uploaded. A PUT publishes an object whole, so a
``kill -9`` mid-upload leaves a ``step-N/`` without a manifest: never chosen.

A file's signature is its size and CRC32 on a local disk, and its size and ETag on a
store: the store checked the bytes on upload, and reading a shard back to checksum it
would double every save's and load's traffic. A store manifest that names CRC32s (a
local checkpoint copied to a bucket) is verified by reading the bytes.

Credentials and endpoint come only from the standard variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ... as botocore reads them), never from the config.

Cost: one request per call on a store (a listing page per 1,000 names), never a read of
a data file except ``signature``/``check`` of a local file or a CRC32-signed object.

``torchtitan.io.storage`` owns single objects (claims, leases, counts: conditional writes);
this module owns what a checkpoint needs on top: folders, DCP's reader and writer,
signatures. On ``s3://`` the reader and writer are the project's own (store_reader.py,
store_writer.py: each rank's bytes in parallel requests, bounded memory).

Never: decide what a name means (``folder``) or which checkpoint to use (``timeline``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from torchtitan.io import storage
from torchtitan.io.checksum import crc32

# Files are checksummed in chunks, in parallel threads (the CRC32 and file reads release
# the GIL): one CRC32 per 64 MiB, which also says where a file is damaged.
CHECKSUM_CHUNK = 64 << 20
# Files each rank writes to an object store other than S3 (gs://, ...: DCP's fsspec writer),
# uploaded in parallel (ObjectStore.writer); S3 has its own writer (store_writer.py).
WRITE_FILES = 4
_CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))

# Every write below asks the leased folder's write guard first (``storage.before_write``),
# as storage's own writes do.


def is_url(path: str) -> bool:
    """A URL names an fsspec file system (``s3://bucket/prefix``); anything else is local."""
    return storage.is_remote(str(path))


def join(folder: str, name: str) -> str:
    """``name`` under ``folder``; a URL ``name`` stands alone (``checkpoint.folder = s3://...``)."""
    return name if is_url(name) else storage.join(str(folder), name)


class GuardedFileSystem(FileSystem):
    """DCP's local file system, each write of it asking the write guard first (a file
    opened for writing, a folder made, a rename, a removal): an async save's write
    thread sends nothing once the lease has lapsed."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if set(mode) & set("wax+"):
            storage.before_write(str(path))
        with super().create_stream(path, mode) as stream:
            yield stream

    def rename(self, path, new_path):
        storage.before_write(str(path))
        storage.before_write(str(new_path))
        super().rename(path, new_path)

    def mkdir(self, path):
        storage.before_write(str(path))
        super().mkdir(path)

    def rm_file(self, path):
        storage.before_write(str(path))
        super().rm_file(path)


class LocalStore:
    """A POSIX folder: writes are fsynced, a folder is published by renaming it."""

    in_place = False

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path) if os.path.isdir(path) else []

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def open(self, path: str, mode: str = "rb"):
        return open(path, mode)

    def makedirs(self, path: str):
        storage.before_write(path)
        os.makedirs(path, exist_ok=True)

    def write_bytes(self, path: str, data: bytes):
        """Write and fsync (the caller fsyncs the folder where a name must be durable)."""
        storage.before_write(path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def remove(self, path: str):
        storage.before_write(path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def rmtree(self, path: str, first: str | None = None):
        """Remove a folder; ``first`` (its manifest) goes before the rest, so that a delete
        killed half-way leaves a folder no listing takes for complete."""
        if first is not None:
            self.remove(os.path.join(path, first))
        storage.before_write(path)
        shutil.rmtree(path, ignore_errors=True)

    def move_folder(self, src: str, dst: str, last: str):
        storage.before_write(src)
        storage.before_write(dst)
        os.replace(src, dst)

    def sync_files(self, folder: str, names: list[str]):
        """Flush the named files to stable storage. Cost: the bytes still dirty in the cache."""
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())

    def sync_dir(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def signature(self, path: str) -> dict:
        """Size and CRC32 per 64 MiB chunk. Cost: reads the file once (normally cached)."""
        return {"size": self.size(path), "crc32": crc32_chunks(self, path)}

    def check(self, path: str, want: dict) -> str | None:
        """None if the file is there with ``want``'s signature, else the problem."""
        if not self.isfile(path):
            return f"file {path} is missing"
        size = self.size(path)
        if size != want["size"]:
            return f"file {path} has {size} bytes, expected {want['size']} (truncated?)"
        if crc32_chunks(self, path) != want.get("crc32"):
            return f"file {path} fails its checksum (corrupted)"
        return None

    def reader(self, path: str, manifest: dict | None = None):
        """DCP's reader of the checkpoint at ``path`` (``manifest``: its manifest, whose
        signatures a store's reader checks on every read)."""
        return FileSystemReader(path)

    def writer(self, path: str):
        """DCP's writer, each file, folder and rename of it asking the write guard first."""
        writer = FileSystemWriter(path)
        writer.fs = GuardedFileSystem()
        return writer


class ObjectStore(LocalStore):
    """An fsspec file system (S3 and the like): no rename, no fsync, ETags."""

    in_place = True

    def __init__(self, url: str):
        from fsspec.core import url_to_fs

        # No listing cache: a listing taken before another rank's upload must not hide it.
        self.fs, _ = url_to_fs(url, use_listings_cache=False)

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def isdir(self, path: str) -> bool:
        return bool(self.listdir(path))  # a store has no empty folders

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(path)

    def size(self, path: str) -> int:
        return int(self.fs.info(path)["size"])

    def open(self, path: str, mode: str = "rb"):
        return self.fs.open(path, mode)

    def makedirs(self, path: str):
        """Nothing: a prefix needs no folder, and the bucket is the operator's to create
        (s3fs's makedirs would create a missing bucket)."""

    def write_bytes(self, path: str, data: bytes):
        storage.before_write(path)
        self.fs.pipe_file(path, data)  # one PUT: the object appears whole or not at all

    def remove(self, path: str):
        storage.before_write(path)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def rmtree(self, path: str, first: str | None = None):
        """As a local folder's; on S3 a killed save's incomplete multipart uploads under
        ``path`` are aborted too (they hold space, never a name), before its objects are
        deleted: a kill in between leaves the objects, so the folder is still listed
        (a partial step) and removed again at the next start, aborting what is left."""
        if first is not None:
            self.remove(join(path, first))
        if storage.on_s3(path):
            from torchtitan.checkpoint.store_writer import abort_uploads

            storage.before_write(path)
            with contextlib.suppress(Exception):  # best effort: a lifecycle rule is the net
                abort_uploads(path)
        storage.before_write(path)  # one request a 1,000 names: the lease asked before the batch
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def move_folder(self, src: str, dst: str, last: str):
        """Copy every object (server side) with ``last`` (the manifest) copied last, then
        delete the source manifest first: a kill between any two leaves at most one
        complete copy being deleted, never a torn one taken for complete. Cost: a
        server-side copy of the folder's bytes (rare: setting a timeline aside)."""
        names = sorted(self.listdir(src), key=lambda n: n == last)
        for name in names:
            # mutant store-copy-unguarded: `storage.before_write(join(dst, name))` -> `None`; test/checkpoint/test_store.py::test_every_write_request_under_a_guarded_folder_asks_its_guard_first
            storage.before_write(join(dst, name))
            self.fs.copy(join(src, name), join(dst, name))
        self.rmtree(src, first=last)

    def sync_files(self, folder: str, names: list[str]):
        """Nothing: an upload is durable once its PUT returns."""

    def sync_dir(self, path: str):
        """Nothing: a store has no folder entries to flush."""

    def signature(self, path: str) -> dict:
        """Size and ETag. Cost: one HEAD request, no data read."""
        info = self.fs.info(path)
        return {"size": int(info["size"]), "etag": _etag(info)}

    def check(self, path: str, want: dict) -> str | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return f"file {path} is missing"
        problem = mismatch(path, {"size": int(info["size"]), "etag": _etag(info)}, want)
        if problem or "etag" in want:
            return problem
        if crc32_chunks(self, path) != want.get("crc32"):
            return f"file {path} fails its checksum (corrupted)"
        return None

    def listed(self, path: str, prefix: str) -> dict[str, dict]:
        """{name: size and ETag} of the objects in ``path`` whose names begin with
        ``prefix``: one listing (ListObjectsV2, 1,000 names a request) where a HEAD each
        took a round trip per file. Cost: ceil(matches / 1,000) requests."""
        try:
            found = self.fs.find(path, prefix=prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {name.rstrip("/").rsplit("/", 1)[-1]: {"size": int(info["size"]), "etag": _etag(info)}
                for name, info in found.items()}  # fmt: skip

    def reader(self, path: str, manifest: dict | None = None):
        """On S3 the project's own reader (store_reader.py: each needed byte once, in
        parallel ranged GETs, each conditional on the manifest's ETag); DCP's fsspec
        reader on other stores."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        if storage.on_s3(path):
            from torchtitan.checkpoint.store_reader import StoreReader

            files = (manifest or {}).get("files") or {}
            etags = {name: sig["etag"] for name, sig in files.items() if sig.get("etag")}
            return StoreReader(path, etags)
        return FsspecReader(path, use_listings_cache=False)

    def writer(self, path: str):
        """On S3 the project's own writer (store_writer.py: objects of at most 64 MiB,
        up to 8 requests at once, parallel parts for a larger entry); DCP's fsspec writer
        on other stores."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        if storage.on_s3(path):
            from torchtitan.checkpoint.store_writer import StoreWriter

            return StoreWriter(path)
        # sync_files would call os.sync() (a store stream has no fileno): the whole
        # machine's dirty pages, for nothing: a PUT is durable when it returns.
        # WRITE_FILES files per rank, uploaded at once (DCP's threads, entries spread by
        # size): a stream's multipart parts go one after another, so one file per rank
        # would leave the link to a single connection. Memory: s3fs buffers a block
        # (50 MiB) per open file, WRITE_FILES x 50 MiB per rank.
        return FsspecWriter(path, sync_files=False, use_listings_cache=False,
                            thread_count=WRITE_FILES)  # fmt: skip


def mismatch(path: str, found: dict | None, want: dict) -> str | None:
    """What differs between a file's size and ETag as found (None: not there) and as its
    manifest names them, or None."""
    if found is None:
        return f"file {path} is missing"
    if found["size"] != want["size"]:
        return f"file {path} has {found['size']} bytes, expected {want['size']} (truncated?)"
    if "etag" in want and found.get("etag") != want["etag"]:
        return f"file {path} was replaced since it was written (its ETag changed)"
    return None


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or "").strip('"')


def store_for(path: str) -> LocalStore:
    """The store that holds ``path``: an ``ObjectStore`` for a URL, else the local one.

    Raises ``ImportError`` naming the missing package for a URL whose file system is not
    installed (``s3fs`` for ``s3://``)."""
    return ObjectStore(path) if is_url(path) else _LOCAL


_LOCAL = LocalStore()


def _crc32_range(store: LocalStore, path: str, offset: int) -> int:
    crc, left = 0, CHECKSUM_CHUNK
    with store.open(path, "rb") as f:
        f.seek(offset)
        while left > 0 and (block := f.read(min(left, 1 << 22))):
            crc = crc32(block, crc)
            left -= len(block)
    return crc


def crc32_chunks(store: LocalStore, path: str) -> list[int]:
    """CRC32 of each 64 MiB chunk of a file (one chunk for an empty file)."""
    offsets = range(0, max(1, store.size(path)), CHECKSUM_CHUNK)
    if len(offsets) == 1:
        return [_crc32_range(store, path, 0)]
    with ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="crc32") as pool:
        return list(pool.map(lambda offset: _crc32_range(store, path, offset), offsets))


def upload_folder(local: str, url: str, last: str):
    """Upload the files of a local folder (not recursive) under ``url``, ``last`` after
    the others. Cost: the folder's bytes, in multipart uploads for large files."""
    store = store_for(url)
    names = sorted((n for n in os.listdir(local) if os.path.isfile(os.path.join(local, n))),
                   key=lambda n: n == last)  # fmt: skip
    for name in names:
        storage.before_write(join(url, name))
        store.fs.put_file(os.path.join(local, name), join(url, name))


@contextlib.contextmanager
def local_copy(path: str):
    """A local folder holding ``path``'s files: ``path`` itself, or for a URL a temporary
    download of its objects (not recursive), removed afterwards. Cost: the folder's bytes."""
    if not is_url(path):
        yield path
        return
    import tempfile

    store = store_for(path)
    with tempfile.TemporaryDirectory(prefix="fetched-") as local:
        for entry in store.fs.ls(path, detail=True, refresh=True):
            if entry.get("type") == "file":
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                store.fs.get_file(entry["name"], os.path.join(local, name))
        yield local
