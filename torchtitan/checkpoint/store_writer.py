"""DCP's writer for a checkpoint on S3: each rank's entries packed into objects of at most
``OBJECT_MAX`` bytes (an entry larger than that alone), serialized on one thread while up
to ``IN_FLIGHT`` requests upload the objects already serialized (several objects at once,
each one PUT up to ``SINGLE_PUT_MAX``, an entry larger than that in parallel multipart
parts).

Owns: the order a rank's write items are written in (``small_first``: bytes entries and
small tensors together at the head, where another rank reads the replicated ones in one
GET), packing them into objects (``plan_objects``), the bytes of each
object (``ObjectStream``: DCP's own ``_write_item`` serializes into it, so the files are
the ones DCP's readers expect), and the requests (``Uploader``: a PUT per object, a
multipart upload of ``PART``-byte parts for an object that outgrows ``SINGLE_PUT_MAX``,
retried like the reader's GETs). ``.metadata`` is one PUT (DCP's fsspec writer wrote a
``.tmp``, then copied and deleted it: s3fs's rename).

- **Complete before it returns.** ``write_data`` returns only once every object of the
  rank is acknowledged (a multipart upload completed after all its parts); DCP writes
  ``.metadata`` after every rank's ``write_data``, and the finalizer writes the manifest
  after every rank's digest (lifecycle.py): manifest last. An object appears whole or
  not at all (a PUT, or a multipart upload completed), so a kill -9 mid-upload leaves a
  ``step-N/`` without a manifest, never chosen, and the incomplete multipart uploads
  of the entries larger than ``SINGLE_PUT_MAX`` begun and not yet completed (one per
  such entry, a few a rank), invisible to listings and reads; ``abort_uploads`` (called where a
  save's folder is removed: the next start removes the torn step, a re-save its step)
  drops them, and a bucket lifecycle rule (AbortIncompleteMultipartUpload) is the
  operator's net for a job that never starts again. A restart's save of the same step
  begins new uploads (new upload ids) into a folder emptied first: nothing of the
  killed one is in it (test_store_killed.py kills a real save between its parts).
- **Bounded memory.** At most ``IN_FLIGHT x OBJECT_MAX`` (8 x 64 MiB = 512 MiB) handed to
  requests and not yet acknowledged, plus the object being serialized (at most
  ``SINGLE_PUT_MAX``, 128 MiB: a single PUT up to there, or one entry's bytes for an
  entry larger than that: ``torch.save`` hands over a tensor's storage in one write). A rank's staged state
  (async) or its live tensors (sync) are DCP's, not counted here.
- **Verified.** botocore sends a CRC32 of every request's body (``x-amz-checksum-crc32``,
  its flexible checksums, on by default: seen on each PUT and part) and S3 refuses a
  body that does not match (the local server, moto, accepts a wrong one; test_store_writer.py
  reads every object's and part's stored CRC32 back). Not the project's own faster CRC32
  (io.checksum): a request holding its own checksum header makes botocore SHA-256 the
  whole body to sign it over https, where its own CRC32 goes unsigned in a trailer; a multipart upload
  is completed with the ETag of each of its parts, in part order; the finalizer records
  each object's size and ETag (a HEAD) in the manifest, and the reader's GETs are
  conditional on that ETag.
- **Faults.** Transient ones (throttling, 5xx, a dropped connection) are retried as the
  reader's are (``store_reader.ATTEMPTS`` tries, full-jitter backoff drawn from the OS:
  ``store_reader.backoff``, never the ``random`` a checkpoint saves; at most 3.75 s of
  waiting per request); one that persists or is not transient (no bucket, credentials)
  stops the save with one line naming the object and the fix (``StoreWriteError``); the
  manager keeps the previous checkpoint.

Why botocore and not s3fs: measured on the local server (harness/s3.py, 256 MiB, load
~6 on 2 cores): 16 single PUTs of 16 MiB from 16 threads took 4.0-6.1 s, 4 of 64 MiB
7.0-7.2 s, one multipart upload of 16 MiB parts from 8 threads 8.7-9.3 s (3.1-3.4 s of it
the server joining the parts, which moto does in Python; a real S3 joins them as
metadata), s3fs's ``pipe_file`` of the same bytes 9.4-12.8 s (its parts go one after
another). So objects of at most 64 MiB sent as single PUTs, many at once, with multipart
only for an entry larger than ``SINGLE_PUT_MAX``; botocore's client is thread-safe and
releases the GIL while a body is sent. Why 128 MiB and not ``OBJECT_MAX + PART`` (80
MiB, the bound before): an entry of 80-128 MiB (the 125M model's embedding, output layer
and their AdamW moments at 1 rank, 98 MB each) is one PUT, not 7 parts and a
completion; on the local server a 98 MB single PUT took 0.55 s against 0.42 s of parts
plus 0.37 s joining them, and the 1-rank save of the 125M model took 1.11-1.24 x a
parallel PUT of the same bytes in three runs (docs/benchmarks.md § 21; 1.32 before). On S3 a single PUT of up to
128 MiB is one connection's ~1 s, with 7 other requests in flight beside it; a larger
entry keeps parallel parts, where one connection would hold the save. The client, its retries and its one-line errors are
store_reader.py's.

Cost per rank and save: O(own shard) bytes, in about ceil(bytes / OBJECT_MAX) PUTs (+ 2
and one per ``PART`` for each entry larger than ``SINGLE_PUT_MAX``), at most ``IN_FLIGHT``
at once; nothing
grows with the number of ranks (at 1,000 ranks and a 1 TB checkpoint: ~1 GB and ~16 PUTs
a rank, 16,000 objects in all).

Never: write the manifest or decide when a checkpoint is complete (lifecycle.py), or
write anywhere but its own ``__<rank>_*`` objects and (rank 0) ``.metadata``.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.utils.serialization as serialization
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _item_size, _write_item
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from torchtitan.checkpoint import store_reader
from torchtitan.checkpoint.store_reader import ATTEMPTS, transient
from torchtitan.io import storage

logger = logging.getLogger("torchtitan")

# An object's size: large enough that a request's latency (~10-50 ms on S3) is a few
# percent of its transfer, small enough that IN_FLIGHT of them bound the memory and
# that a rank's shard makes several objects to send at once.
OBJECT_MAX = 64 << 20
PART = 16 << 20  # a multipart part (S3: at least 5 MiB, at most 10,000 parts)
# The largest object sent as one PUT (S3 takes up to 5 GiB); a larger one (an entry alone
# in its object) is a multipart upload.
SINGLE_PUT_MAX = 128 << 20
IN_FLIGHT = 8  # concurrent PUT / part requests per rank
SMALL = 64 << 10  # a tensor entry under this is written with the small ones (small_first)


class StoreWriteError(RuntimeError):
    """A write the store refused or could not finish: one line naming the object and the
    fix (the manager reports it as the save's error and keeps the previous checkpoint)."""


def small_first(items: list) -> list:
    """``items`` in the order they are written: bytes entries, then tensors under
    ``SMALL``, then the rest, each in plan order (a stable sort). The small ones sit
    together at the head of the rank's first object: a rank that loads another's
    replicated entries (DCP saves each once, balanced over the ranks: AdamW's ``step``
    of every parameter at FSDP) reads them in one ranged GET, where, spread between the
    large ones, they took one each (52 GETs, and 80 MB of gaps coalesced, for rank 0 of
    the 2-rank 125M resume). The async stager copies in the same order
    (staging.py), so that the first object's entries are copied first."""

    def key(item):
        if item.type == WriteItemType.BYTE_IO:
            return 0
        return 1 if _item_size(item) < SMALL else 2

    return sorted(items, key=key)


def plan_objects(items: list, sizes: list[int], object_max: int = OBJECT_MAX) -> list[list]:
    """``items`` packed, in order, into objects of at most ``object_max`` bytes (by their
    ``sizes``): an object is closed when the next item would take it past the bound; an
    item larger than the bound is an object of its own. Cost: O(items)."""
    objects: list[list] = []
    current: list = []
    filled = 0
    for item, size in zip(items, sizes, strict=True):
        if current and filled + size > object_max:
            objects.append(current)
            current, filled = [], 0
        current.append(item)
        filled += size
    if current:
        objects.append(current)
    return objects


def one_line(error: BaseException, url: str, bucket: str) -> str:
    """The line for a write of ``url`` that failed with ``error`` (after its retries)."""
    code = store_reader._code(error)
    if code == "NoSuchBucket":
        return (f"bucket {bucket} does not exist (writing {url}; a store restarted empty "
                "loses its buckets): create it, or set --checkpoint.folder to an existing "
                "one")  # fmt: skip
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return (f"the store refused to write {url} ({code}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY to credentials that may write it")  # fmt: skip
    text = (str(error).splitlines() or [type(error).__name__])[0]
    return (f"writing {url} failed ({ATTEMPTS} tries): {text}; check that the store is "
            "reachable (AWS_ENDPOINT_URL) and has room")  # fmt: skip


class Uploader:
    """The requests of one rank's save: at most ``in_flight`` at once and at most
    ``budget`` bytes handed to requests and not yet acknowledged (``submit`` waits)."""

    def __init__(self, client, bucket: str, prefix: str, in_flight: int = IN_FLIGHT,
                 budget: int = IN_FLIGHT * OBJECT_MAX, may_write=None):  # fmt: skip
        self.client, self.bucket, self.prefix = client, bucket, prefix
        # Raises where this job may no longer write the folder (the saver's lease check):
        # asked before every request and every retry, so a save that began in time sends
        # nothing once the lease may be another job's (a paused store's held uploads).
        self.may_write = may_write
        self.in_flight, self.budget = in_flight, budget
        self.pool = ThreadPoolExecutor(in_flight, thread_name_prefix="store-write")
        # Completions wait for their parts, so not on the pool the parts need; off the
        # serializer's thread, which goes on with the next object meanwhile.
        self.completer = ThreadPoolExecutor(2, thread_name_prefix="store-complete")
        self.room = threading.Condition()
        self.held = 0  # bytes submitted and not yet acknowledged
        self.peak = 0  # the most ever held (a test checks the bound)
        self.requests = self.sent = self.retries = 0
        self.failure: BaseException | None = None

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{name}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def call(self, name: str, method: str, **args):
        """One request, retried on a transient fault (store_reader.transient) with
        full-jitter backoff (store_reader.backoff); a fault that persists is a
        StoreWriteError naming ``name``."""
        for attempt in range(ATTEMPTS):
            try:
                # mutant store-writer-unguarded: `storage.before_write(self.url(name))` -> `None`; test/checkpoint/test_store.py::test_every_write_request_under_a_guarded_folder_asks_its_guard_first
                storage.before_write(self.url(name))  # the folder's lease, whoever writes
                if self.may_write is not None:
                    self.may_write()
            except Exception as e:  # noqa: BLE001 - the lease's own line, as the save's
                raise StoreWriteError(str(e)) from None
            try:
                reply = getattr(self.client, method)(Bucket=self.bucket, Key=self.key(name), **args)
                with self.room:
                    self.requests += 1
                return reply
            except Exception as e:  # noqa: BLE001 - a non-transient one is raised at once
                if attempt == ATTEMPTS - 1 or not transient(e):
                    raise StoreWriteError(one_line(e, self.url(name), self.bucket)) from None
                with self.room:
                    self.retries += 1
            time.sleep(store_reader.backoff(attempt))
        raise AssertionError("unreachable")

    def submit(self, size: int, fn, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` (a request carrying ``size`` bytes) on the pool once the bytes
        fit the budget (at once when nothing is held: an entry larger than the budget goes
        alone); after the first failure a submission is not sent, its future holds the
        failure (raising here, inside torch.save's write, would be masked by its own error)."""
        with self.room:
            while self.held and self.held + size > self.budget and self.failure is None:
                self.room.wait()
            if self.failure is not None:  # not raised here: torch.save is mid-write
                failed: Future = Future()
                failed.set_exception(self.failure)
                return failed
            self.held += size
            self.peak = max(self.peak, self.held)
        future = self.pool.submit(fn, *args, **kwargs)
        future.add_done_callback(lambda f: self._release(size, f))
        return future

    def _release(self, size: int, future: Future):
        with self.room:
            self.held -= size
            if future.cancelled():  # close() after a failure: never sent
                pass
            elif future.exception() is not None:
                self.failure = self.failure or future.exception()
            else:
                self.sent += size
            self.room.notify_all()

    def put(self, name: str, body: bytes | bytearray) -> Future:
        return self.submit(len(body), self.call, name, "put_object", Body=body)

    def close(self):
        self.completer.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True, cancel_futures=True)


class ObjectStream(io.RawIOBase):
    """The bytes of one object as DCP serializes them: a single PUT when they fit in
    ``single_max`` (sent at ``finish``), else a multipart upload begun as they outgrow it,
    ``part``-byte parts submitted as they fill, completed at ``finish`` once every part
    is acknowledged."""

    def __init__(self, uploader: Uploader, name: str, single_max: int = SINGLE_PUT_MAX,
                 part: int = PART):  # fmt: skip
        self.uploader, self.name = uploader, name
        self.single_max, self.part = single_max, part
        self.buffer = bytearray()
        self.written = 0
        self.upload_id: str | None = None
        self.parts: list[tuple[int, Future]] = []  # (number, request)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.written

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        self.buffer += data
        self.written += n
        # A single PUT up to single_max (at least OBJECT_MAX + PART: the slack for
        # torch.save's headers over the sizes the objects were packed by).
        if self.upload_id is None and len(self.buffer) > self.single_max:
            reply = self.uploader.call(self.name, "create_multipart_upload")
            self.upload_id = reply["UploadId"]
        if self.upload_id is not None:
            while len(self.buffer) >= self.part:
                self._send_part(self.buffer[: self.part])  # a copy (a bytearray's slice)
                del self.buffer[: self.part]
        return n

    def _send_part(self, body: bytearray):
        number = len(self.parts) + 1
        future = self.uploader.submit(len(body), self._upload_part, number, body)
        self.parts.append((number, future))

    def _upload_part(self, number: int, body: bytearray) -> str:
        reply = self.uploader.call(self.name, "upload_part", UploadId=self.upload_id,
                                   PartNumber=number, Body=body)  # fmt: skip
        return reply["ETag"]

    def finish(self) -> Future:
        """Send what is left: the object's one PUT, or the last part and then (on the
        completer, once every part is acknowledged) the completion; the future of either."""
        if self.upload_id is None:  # the buffer itself is the body: no copy
            body, self.buffer = self.buffer, bytearray()
            return self.uploader.put(self.name, body)
        if self.buffer or not self.parts:
            self._send_part(self.buffer)
            self.buffer = bytearray()
        return self.uploader.completer.submit(self._complete)

    def _complete(self):
        try:
            etags = [(number, future.result()) for number, future in self.parts]
        except BaseException:
            self.abort()
            raise
        parts = [{"PartNumber": number, "ETag": etag} for number, etag in etags]
        self.uploader.call(self.name, "complete_multipart_upload", UploadId=self.upload_id,
                           MultipartUpload={"Parts": parts})  # fmt: skip

    def abort(self):
        """Drop the multipart upload (best effort: a kill leaves it to abort_uploads)."""
        if self.upload_id is not None:
            try:
                self.uploader.client.abort_multipart_upload(
                    Bucket=self.uploader.bucket, Key=self.uploader.key(self.name),
                    UploadId=self.upload_id)  # fmt: skip
            except Exception:  # noqa: BLE001 - the save's own error is the one to report
                logger.debug("could not abort the upload of %s", self.name, exc_info=True)


class _Prefix(FileSystem):
    """DCP's fsspec file system without ``mkdir`` (s3fs's makedirs creates a missing
    bucket: a store restarted empty must be an error, not a new empty bucket)."""

    def mkdir(self, path) -> None:
        pass


class StoreWriter(FsspecWriter):
    """DCP's writer for a checkpoint folder on S3 (``s3://bucket/prefix``): DCP's planning,
    the data and ``.metadata`` written by ``Uploader`` (module docstring)."""

    def __init__(self, path: str, object_max: int = OBJECT_MAX, part: int = PART,
                 in_flight: int = IN_FLIGHT, single_max: int | None = None):  # fmt: skip
        super().__init__(path, sync_files=False, use_listings_cache=False)
        self.fs = _Prefix()
        self.path = self.fs.init_path(path, use_listings_cache=False)
        self._locate(path)
        self.object_max, self.part, self.in_flight = object_max, part, in_flight
        # read at construction (not bound as a default): a benchmark may set the module's
        self.single_max = SINGLE_PUT_MAX if single_max is None else single_max
        self.stats: dict = {}
        # an async save's stager (staging.PipelinedStager), set by the saver: an entry is
        # serialized once its copy is done, while later entries are still being copied
        self.staging = None
        self.may_write = None  # the saver's lease check (Uploader.may_write)

    def _locate(self, path):
        bucket, _, prefix = str(path).split("://", 1)[1].partition("/")
        self.bucket, self.prefix = bucket, prefix.rstrip("/")

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._locate(checkpoint_id)

    def uploader(self) -> Uploader:
        return Uploader(store_reader._s3_client(), self.bucket, self.prefix, self.in_flight,
                        self.in_flight * self.object_max, self.may_write)  # fmt: skip

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        """Serialize and upload this rank's items; returns once every object is stored.
        Cost: O(own shard) bytes in ceil(bytes / OBJECT_MAX) PUTs (module docstring)."""
        begin = time.perf_counter()
        items = small_first(plan.items)
        objects = plan_objects(items, [_item_size(i) if i.type != WriteItemType.BYTE_IO else 0
                                       for i in items], self.object_max)  # fmt: skip
        prefix = plan.storage_data.prefix
        uploader = self.uploader()
        results: list[WriteResult] = []
        puts: list[Future] = []
        streams: list[ObjectStream] = []
        try:
            # torch.save's zip records carry a CRC32 of each tensor's bytes that no reader
            # checks (torch.load does not): 0.45 s of this thread's CPU per 1.6 GB, where
            # botocore's CRC32 of each body, which S3 does check, already covers the bytes.
            # The switch is torch's, for the serializing only: this thread's in torch 2.13
            # (a context variable); in an older torch, process-wide, so that a torch.save
            # elsewhere meanwhile writes records without it too, which every reader takes.
            with serialization.config.patch({"save.compute_crc32": False}):
                for number, object_items in enumerate(objects):
                    name = f"{prefix}{number}{DEFAULT_SUFFIX}"
                    stream = ObjectStream(uploader, name, self.single_max, self.part)
                    streams.append(stream)
                    for item in object_items:
                        data = planner.resolve_data(item)
                        if item.type != WriteItemType.BYTE_IO:
                            if self.staging is not None:
                                self.staging.wait_for(data)
                            data = data.detach().cpu()  # staged already on CPU (async)
                        results.append(_write_item(self.transforms, stream, data, item, name,
                                                   self.serialization_format))  # fmt: skip
                        if uploader.failure is not None:  # stop at the first failed request
                            raise uploader.failure
                    puts.append(stream.finish())
            for put in puts:
                put.result()
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        finally:
            uploader.close()
        seconds = time.perf_counter() - begin
        self.stats = {"objects": len(objects), "bytes": uploader.sent,
                      "requests": uploader.requests, "retries": uploader.retries,
                      "peak_held": uploader.peak, "seconds": seconds}  # fmt: skip
        logger.info("wrote %s: %d items, %.1f MB in %d objects, %d requests, %.2f s", self.path,
                    len(items), uploader.sent / 1e6, len(objects), uploader.requests,
                    seconds)  # fmt: skip
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``.metadata``, one PUT (coordinator only, after every rank's write_data)."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        name = (
            ".metadata" if self.use_collectives or self.rank is None else f"__{self.rank}.metadata"
        )
        uploader = Uploader(store_reader._s3_client(), self.bucket, self.prefix, 1,
                            may_write=self.may_write)  # fmt: skip
        try:
            uploader.call(name, "put_object", Body=pickle.dumps(metadata))
        finally:
            uploader.close()


def abort_uploads(url: str, page_size: int = 1000) -> int:
    """Abort the incomplete multipart uploads under ``url`` (a kill -9 mid-save leaves
    those of its large entries begun and not completed, a few a rank): their parts hold
    space, never a name. Cost: one listing request per 1,000 uploads and one request per
    upload aborted (at 1,000 ranks, a few thousand uploads: a few listings). An upload
    another rank aborted first is passed over. Returns how many this call aborted."""
    bucket, _, prefix = str(url).split("://", 1)[1].partition("/")
    client = store_reader._s3_client()
    page = {"Bucket": bucket, "Prefix": prefix.rstrip("/") + "/", "MaxUploads": page_size}
    aborted = 0
    while True:
        reply = client.list_multipart_uploads(**page)
        for upload in reply.get("Uploads") or []:
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                              UploadId=upload["UploadId"])  # fmt: skip
            except Exception as e:  # noqa: BLE001 - another rank removing the folder was first
                if getattr(e, "response", {}).get("Error", {}).get("Code") != "NoSuchUpload":
                    raise
                continue
            aborted += 1
        if not reply.get("IsTruncated"):
            return aborted
        page.update(KeyMarker=reply["NextKeyMarker"], UploadIdMarker=reply["NextUploadIdMarker"])
