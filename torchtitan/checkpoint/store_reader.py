"""DCP's reader for a checkpoint on S3: each rank fetches the byte ranges its load plan
names, once, in parallel ranged GETs, while the ranges already fetched are deserialized.

Owns: turning a rank's load plan into requests (``plan_requests``: the items' byte ranges
grouped per file, sorted by offset, coalesced across gaps of at most ``GAP`` bytes into
spans of at most a span size), fetching them (``SpanFetcher``: at most ``IN_FLIGHT``
ranged GETs at once, spans of several files interleaved), and handing each item's bytes
to DCP's planner in the order the spans arrive. DCP's ``FsspecReader`` (which it
replaces on ``s3://``) loads a file's entries in plan order through a read-ahead stream,
which fetched 3.3x the checkpoint's bytes (docs/benchmarks.md § 21).

- **Each byte once.** No read-ahead, no cache: bytes fetched = bytes the plan needs + the
  gaps coalesced; both are counted (``stats``) and logged in one line per load.
- **Received in place.** An entry that is a whole saved tensor of the dtype and shape
  of the tensor the plan loads it into (a contiguous CPU tensor; every entry of a
  resume at the layout it was saved at, bar those under ``IN_PLACE_MIN``) is received
  from the socket straight into that tensor (``SpanSink``): no buffer page touched for
  its values, no copy. Its record's first bytes are received first and say where the
  values lie (``torch_record.values_at``); its directory, at its end, confirms it once
  the record has arrived (``torch_record.confirms``), and a record that disagrees is
  fetched again whole and read as any other (``stats["again"]``). On the 1.6 GB resume
  of the 125M model: the client's CPU 1.0-1.1 s against 1.8 s, the load 1.35-1.6 s
  against 1.8-1.9 s (docs/benchmarks.md § 21).
- **Copied once otherwise.** Every other byte (a part of a saved tensor after a layout
  change, a small entry, another dtype, a GPU target) is received into a reusable
  buffer (``receive``: no bytes object per GET), its tensor read in place from it
  (``saved_tensor``) and copied into the model.
- **Bounded memory.** Spans are admitted while the buffers they hold (one per span,
  a span size each, reused once a span is loaded) stay under ``IN_FLIGHT x SPAN_MAX``
  (8 x 64 MiB = 512 MiB): at most that plus the largest span. An item larger than a
  span is a span of its own, in a buffer of its own, unmapped once it is loaded (its
  bytes are needed whole: ``torch.load`` reads one entry). The buffers are anonymous
  maps: of an entry received in place, only its record's first and last pages are
  touched, so a resume at its saved layout holds a few pages per entry, not the bound.
- **Verified.** Every GET carries ``If-Match: <ETag>`` from the manifest (the ETag the
  store gave the upload, which the start checked with a listing): a file replaced between
  the check and the read stops the load with one line, never a mix of two writes. A
  body the store sends with a checksum (``x-amz-checksum-*``) is checked against it,
  as botocore checks it.
- **Transient faults retried** (throttling, 5xx, a connection refused, dropped or timed
  out, a body cut short or failing its checksum): ``ATTEMPTS`` tries with full-jitter
  exponential backoff (``backoff``: drawn from the OS, so a retry changes no generator a
  checkpoint saves), at most 3.75 s of waiting per request; a fault that persists, or
  one that is not transient (credentials, a missing object), is one line naming the
  object.

The client is botocore's own (thread-safe, one per reader, a connection per in-flight
request): with parallel ranged GETs from threads it took 1.0-1.1x s3fs's async client's
throughput on the local server, and up to 1.5x on whole-object GETs (bodies are read
with the GIL released). Endpoint and credentials come from the standard ``AWS_*``
variables, as for s3fs.

Cost per rank and load: O(own shard) bytes (+ coalesced gaps: at most ``GAP`` per pair of
neighbouring items), in ceil(bytes / span) requests + one per item larger than a span;
nothing grows with the number of ranks (at 1,000 ranks and a 1 TB checkpoint: ~1 GB a
rank, ~16-64 requests a rank).

Never: write anything (a kill -9 mid-load leaves the store as it was), read a byte the
plan does not name beyond a coalesced gap, or decide which checkpoint to load.
"""

from __future__ import annotations

import base64
import http.client
import io
import logging
import mmap
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from torchtitan.checkpoint import torch_record
from torchtitan.checkpoint.torch_record import saved_tensor
from torchtitan.io import storage
from torchtitan.io.checksum import crc32

logger = logging.getLogger("torchtitan")

# Coalescing threshold. A ranged GET on a real S3 costs ~10-50 ms to its first byte, and
# one connection carries ~100 MB/s: a gap under ~1-5 MB is cheaper fetched than skipped.
# On the local server (moto) a ranged GET costs ~7 ms plus ~0.5 ms per MiB of the WHOLE
# object (it reads the object to slice it), so fewer requests win there too. 4 MiB keeps
# bytes fetched / bytes needed near 1 (DCP's items within a file are contiguous except
# where another rank's share sits between them).
GAP = 4 << 20
# A span (one GET) is at least SPAN_MIN (a request's latency amortized over >= 0.16 s
# of transfer on a 100 MB/s connection) and at most SPAN_MAX (the memory bound below);
# between them, a rank's bytes / IN_FLIGHT, so that every connection stays busy.
SPAN_MIN = 16 << 20
SPAN_MAX = 64 << 20
IN_FLIGHT = 8  # concurrent ranged GETs per rank
IN_PLACE_MIN = 64 << 10  # an entry this large is received straight into its tensor
CHUNK = 8 << 20  # a body is received (and its checksum updated) this many bytes at a time
ATTEMPTS = 5  # tries per request (1 + 4 retries of a transient fault)
BACKOFF = 0.25  # seconds: the first retry's wait is uniform(0, BACKOFF), doubling per try
# What a store answers when it is busy or briefly failing, rather than refusing.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}  # fmt: skip


class StoreReadError(RuntimeError):
    """A read the store refused or could not finish: one line naming the object and the
    fix (the manager reports it as the checkpoint's error)."""


@dataclass
class Span:
    """One ranged GET: ``[start, end)`` of ``file``, holding ``items`` (storage index,
    offset, length) in offset order; ``needed`` counts each item's bytes once."""

    file: str
    start: int
    end: int
    items: list = field(default_factory=list)
    needed: int = 0

    @property
    def size(self) -> int:
        return self.end - self.start


def plan_requests(ranges: dict, gap: int = GAP, span_max: int = SPAN_MAX) -> list[Span]:
    """The GETs for ``ranges`` ({storage index: (file, offset, length)}): per file, sorted
    by offset, neighbours joined across gaps of at most ``gap`` bytes, the smallest gaps
    first, while all the gaps joined stay within a tenth of the bytes needed (bytes
    fetched / needed <= 1.1) and each span within ``span_max`` (an item larger than that
    is a span of its own). Spans of different files are interleaved (round robin), so
    that parallel requests go to several objects at once. Cost: O(items log items)."""
    per_file: dict[str, list] = {}
    for index, (file, offset, length) in ranges.items():
        per_file.setdefault(file, []).append((offset, length, index))
    needed = sum(length for _, _, length in ranges.values())
    groups: dict[str, list[Span]] = {}
    candidates = []  # (gap, file, position of the left item)
    for file, items in per_file.items():
        items.sort(key=lambda x: (x[0], x[1]))
        groups[file] = [Span(file, o, o + n, [(i, o, n)], n) for o, n, i in items]
        for k in range(len(items) - 1):
            between = items[k + 1][0] - (items[k][0] + items[k][1])
            if between <= gap:
                candidates.append((max(0, between), file, k))
    # Join across the smallest gaps first; a group is a run of neighbouring items, known
    # by its leftmost item (leader) and where it ends.
    leader = {file: list(range(len(g))) for file, g in groups.items()}

    def find(file, k):
        while leader[file][k] != k:
            leader[file][k] = leader[file][leader[file][k]]
            k = leader[file][k]
        return k

    waste = 0
    for between, file, k in sorted(candidates):
        left, right = find(file, k), find(file, k + 1)
        a, b = groups[file][left], groups[file][right]
        size = max(a.end, b.end) - a.start
        if size > span_max or (waste + between) * 10 > needed:
            continue
        waste += between
        a.end, a.items, a.needed = max(a.end, b.end), a.items + b.items, a.needed + b.needed
        leader[file][right] = left
    spans_per_file = [[g for k, g in enumerate(groups[f]) if find(f, k) == k] for f in groups]
    interleaved = []
    for i in range(max((len(s) for s in spans_per_file), default=0)):
        interleaved.extend(s[i] for s in spans_per_file if i < len(s))
    return interleaved


def span_size(needed: int) -> int:
    """The span size for a rank that needs ``needed`` bytes: its bytes spread over the
    connections, within [SPAN_MIN, SPAN_MAX]."""
    return max(SPAN_MIN, min(SPAN_MAX, -(-needed // IN_FLIGHT)))


def _s3_client():
    """This process's botocore client for the ``AWS_*`` variables, with a connection per
    request in flight (``storage.botocore_client``: made once)."""
    return storage.botocore_client(
        max_pool_connections=IN_FLIGHT,
        retries={"total_max_attempts": 1},  # retried by SpanFetcher, with its bound
        connect_timeout=10,
        read_timeout=120,
    )


def backoff(attempt: int) -> float:
    """Seconds to wait after try ``attempt`` (0-based) failed: full jitter, uniform(0,
    BACKOFF x 2^attempt), drawn from the OS (``storage.JITTER``), never from the process's
    ``random``: a checkpoint saves that generator's state, which a retry must not move.
    Cost: one ~1 us draw."""
    return storage.JITTER.uniform(0, BACKOFF * 2**attempt)


def transient(error: BaseException) -> bool:
    """Throttling, a 5xx answer, or a connection that failed, dropped or timed out (before
    or during the body): worth another try. Wrong credentials, a missing bucket or object,
    a failed condition are not."""
    from botocore.exceptions import (
        ClientError,
        FlexibleChecksumError,
        HTTPClientError,
        IncompleteReadError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(error, ClientError):
        response = error.response or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    # HTTPClientError: closed, read timed out, a body cut short (ResponseStreamingError);
    # FlexibleChecksumError: a body that fails its checksum (damaged on the way)
    return isinstance(error, (BotoConnectionError, HTTPClientError, IncompleteReadError,
                              FlexibleChecksumError, ConnectionError, TimeoutError,
                              http.client.HTTPException))  # fmt: skip


def _code(error: BaseException) -> str:
    response = getattr(error, "response", None) or {}
    code = response.get("Error", {}).get("Code") or ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return "PreconditionFailed" if status == 412 else code


def receive(reply: dict, into: memoryview | SpanSink) -> bool:
    """Read the body of a GET (botocore's ``get_object`` reply) into ``into``, whose
    length is the body's (a buffer, or a ``SpanSink``, whose views it fills in turn);
    True where it came straight from the socket.

    botocore's ``read()`` (and urllib3's ``readinto``, which reads into a new bytes
    object and copies it) made a fresh bytes object per GET: on a 1.6 GB load, 1.1-1.4 s
    of CPU against 0.46 s for the same bytes received into reused buffers (in parallel
    with 8 threads, the local server in its own process), the page faults of each new
    64 MiB object and its copy. So the body is read by ``readinto`` of the HTTP response
    under urllib3's (``http.client``'s, which receives into the buffer given), in
    ``CHUNK`` steps. A CRC32 checksum the store sent is checked here, on the bytes as they
    arrive (as botocore's own body does); a body with another checksum, or where the
    response is not what this expects (another urllib3), is read through botocore's
    ``readinto``, which checks it. Raises IncompleteReadError for a body cut short and
    FlexibleChecksumError for one that fails its checksum (both transient). Cost: O(body)
    in the kernel's copy from the socket, plus the CRC32 where the store sent one."""
    from botocore.exceptions import FlexibleChecksumError, IncompleteReadError

    body = reply["Body"]
    stream = socket_stream(body)
    checked = hasattr(body, "checksum")  # botocore checks this body (the store sent one)
    checksums = {k: v for k, v in reply.items() if k.startswith("Checksum") and k != "ChecksumType"}
    want = checksums.get("ChecksumCRC32") or ""
    if stream is None or (checked and (set(checksums) != {"ChecksumCRC32"} or "-" in want)):
        stream, checked = None, False  # botocore's readinto, which checks the body
    read = body.readinto if stream is None else stream.readinto
    n, crc = 0, 0
    for view in [into] if isinstance(into, memoryview) else into.views():
        filled = 0
        while filled < len(view):
            got = read(view[filled : filled + CHUNK])
            if not got:
                raise IncompleteReadError(actual_bytes=n, expected_bytes=len(into))
            if checked:
                crc = crc32(view[filled : filled + got], crc)
            filled += got
            n += got
    if n < len(into):  # a sink that ended early
        raise IncompleteReadError(actual_bytes=n, expected_bytes=len(into))
    if checked and base64.b64encode(crc.to_bytes(4, "big")).decode() != want:
        raise FlexibleChecksumError(error_msg=f"the body's CRC32 is not the {want} the store sent")
    if stream is None:
        if body.readinto(bytearray(1)):  # its end, where botocore checks the checksum
            raise IncompleteReadError(actual_bytes=n + 1, expected_bytes=len(into))
        return False
    if not stream.isclosed() and stream.readinto(bytearray(1)):  # a body sent in chunks
        raise IncompleteReadError(actual_bytes=n + 1, expected_bytes=len(into))
    if stream.isclosed():  # read to its end: the connection can serve another request
        body._raw_stream.release_conn()
    return True


def socket_stream(body) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under botocore's streaming body (botocore's
    ``_raw_stream``, urllib3's ``_fp``: private, so None where they are not what this
    expects), whose ``readinto`` receives into the buffer it is given."""
    stream = getattr(getattr(body, "_raw_stream", None), "_fp", None)
    return stream if isinstance(stream, http.client.HTTPResponse) else None


@dataclass
class Place:
    """Where an entry's values go straight from the socket: ``target``, the tensor the
    load plan names for the whole saved tensor (contiguous, on the CPU), and its bytes."""

    target: torch.Tensor
    bytes: memoryview

    @classmethod
    def of(cls, target: torch.Tensor) -> Place | None:
        if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
            return None
        try:
            return cls(target, memoryview(target.reshape(-1).view(torch.uint8).numpy()))
        except (RuntimeError, TypeError):  # a conjugate or negative bit, a tensor subclass
            return None

    def fits(self, layout: torch_record.Layout) -> tuple[int, int] | None:
        """The record's bytes that are this target's values, where the record holds a
        tensor of its dtype and shape as one run of bytes; else None."""
        where = layout.located
        if where.dtype != self.target.dtype or where.size != tuple(self.target.size()):
            return None
        return layout.values()


class SpanSink:
    """The views one span's body is received into, in order (``receive``): the bytes of
    an entry with a ``Place`` go into its tensor, the record's first bytes
    (``torch_record.PREFIX``, read first: where the values lie, ``values_at``) and its
    end into the span's buffer, at their place; every other byte (other entries, the
    gaps) into the buffer. ``layouts`` names the entries received in place; an entry
    whose record does not say where its values are is received whole into the buffer.
    A retried GET starts over (``views`` again)."""

    def __init__(self, span: Span, buffer: memoryview, places: dict):
        self.span, self.buffer, self.places = span, buffer, places
        self.layouts: dict = {}  # storage index: (layout, its values [begin, end) in the record)

    def __len__(self) -> int:
        return self.span.size

    def views(self):
        self.layouts = {}
        at = 0  # bytes of the span handed out
        for index, offset, length in self.span.items:
            begin = offset - self.span.start
            if begin > at:
                yield self.buffer[at:begin]  # a gap coalesced
            place = self.places.get(index)
            if place is None or begin < at:
                if begin + length > at:
                    yield self.buffer[max(at, begin) : begin + length]
            else:
                yield from self._in_place(index, begin, length, place)
            at = max(at, begin + length)
        if at < self.span.size:
            yield self.buffer[at:]

    def _in_place(self, index, begin: int, length: int, place: Place):
        record = self.buffer[begin : begin + length]
        head = min(length, torch_record.PREFIX)
        yield record[:head]
        layout = torch_record.values_at(record[:head])
        values = place.fits(layout) if layout is not None else None
        if values is None or values[1] > length or values[1] - values[0] != len(place.bytes):
            if head < length:
                yield record[head:]  # the whole record into the buffer: read as any other
            return
        first, last = values
        if first > head:
            yield record[head:first]
        inside = max(0, min(head, last) - first)  # values among the first bytes (tiny)
        if inside:
            place.bytes[:inside] = record[first : first + inside]
        if first + inside < last:
            yield place.bytes[inside:]
        end = max(head, last)
        if end < length:
            yield record[end:]
        self.layouts[index] = (layout, (first, last))


class SpanFetcher:
    """Fetches spans with at most ``IN_FLIGHT`` GETs at once, each into a buffer of its
    own, yielding ``(span, memoryview)`` in the order of ``spans``; the buffer is reused
    for a later span once the consumer asks for the next one (it must then hold nothing
    of it). Spans are admitted while the buffers in use stay under ``budget`` bytes:
    at most budget + the largest span of them (``Buffers``; the module docstring)."""

    def __init__(self, client, bucket: str, prefix: str, etags: dict[str, str],
                 budget: int = IN_FLIGHT * SPAN_MAX):  # fmt: skip
        self.client, self.bucket, self.prefix, self.etags = client, bucket, prefix, etags
        self.budget = budget
        self.requests = 0
        self.fetched = 0
        self.retries = 0
        self.direct = 0  # bodies received straight from the socket (``receive``)
        self.buffers = 0  # buffers made
        self.lock = threading.Lock()

    def url(self, file: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{file}"

    def get(self, span: Span, into: memoryview | SpanSink):
        """One ranged GET into ``into`` (the span's length), conditional on the
        manifest's ETag where it names one."""
        from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError

        args = {"Bucket": self.bucket, "Key": f"{self.prefix}/{span.file}",
                "Range": f"bytes={span.start}-{span.end - 1}"}  # fmt: skip
        etag = self.etags.get(span.file)
        if etag:
            args["IfMatch"] = f'"{etag}"'
        url = self.url(span.file)
        try:
            self._get_with_retries(args, into)
        except StoreReadError:
            raise
        except ClientError as e:
            code = _code(e)
            if code == "PreconditionFailed":
                raise StoreReadError(
                    f"file {url} was replaced since it was written (its ETag changed); "
                    "restore it, or resume from another checkpoint with --checkpoint.load_step"
                ) from None
            if code in ("NoSuchKey", "404"):
                raise StoreReadError(f"file {url} is missing; resume from another "
                                      "checkpoint with --checkpoint.load_step") from None  # fmt: skip
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise StoreReadError(
                    f"the store refused to read {url} ({code}): set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY to credentials that may read it"
                ) from None
            if code == "NoSuchBucket":
                raise StoreReadError(f"bucket {self.bucket} does not exist (reading {url}): "
                                      "check the URL and AWS_ENDPOINT_URL") from None  # fmt: skip
            raise StoreReadError(f"reading {url} failed ({ATTEMPTS} tries): {e}") from None
        except FlexibleChecksumError as e:
            raise StoreReadError(
                f"file {url} failed its checksum on each of {ATTEMPTS} tries ({e}): its bytes "
                "in the store are damaged (restore it, or resume from another checkpoint with "
                "--checkpoint.load_step), or the store sends the whole object's checksum for "
                "a range (set AWS_RESPONSE_CHECKSUM_VALIDATION=when_required)"
            ) from None
        except (BotoCoreError, OSError, http.client.HTTPException) as e:
            # OSError, HTTPException: a connection reset or timed out while its body was
            # received from the socket (``receive``), where botocore does not wrap them
            raise StoreReadError(
                f"reading {url} failed ({ATTEMPTS} tries): {e!r}; check that the store is "
                "reachable (AWS_ENDPOINT_URL) and the credentials (AWS_ACCESS_KEY_ID)"
            ) from None
        with self.lock:
            self.requests += 1
            self.fetched += len(into)

    def _get_with_retries(self, args: dict, into: memoryview | SpanSink):
        """One GET into ``into``, retried on a transient fault (``transient``) up to
        ``ATTEMPTS`` tries with full-jitter backoff (a try waits uniform(0, BACKOFF x
        2^try) s: at most 0.25 + 0.5 + 1 + 2 = 3.75 s in all); the last fault is raised.
        A body of another length than asked (a store that ignored the range) is an error."""
        for attempt in range(ATTEMPTS):
            try:
                reply = self.client.get_object(**args)
                try:
                    length = reply.get("ContentLength")  # None: a body sent in chunks
                    if length is not None and length != len(into):
                        url = f"s3://{args['Bucket']}/{args['Key']}"
                        raise StoreReadError(
                            f"file {url} gave {length} bytes for {args['Range']} (a store "
                            "that ignores ranges, or the object changed); check "
                            "AWS_ENDPOINT_URL names an S3 API that answers ranged GETs"
                        )
                    if receive(reply, into):
                        with self.lock:
                            self.direct += 1
                    return
                finally:
                    reply["Body"].close()
            except StoreReadError:
                raise
            except Exception as e:  # noqa: BLE001 - a non-transient one is raised at once
                if attempt == ATTEMPTS - 1 or not transient(e):
                    raise
                with self.lock:
                    self.retries += 1
            time.sleep(backoff(attempt))
        raise AssertionError("unreachable")

    def fetch(self, spans: list[Span], unit: int, places: dict | None = None):
        """Yield ``(span, its buffer's view, its SpanSink or None)`` in span order; an
        entry of ``places`` (storage index: ``Place``) is received into its tensor where
        its record allows (``SpanSink``)."""
        places = places or {}
        pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="store-read")
        pending: deque[tuple[Span, mmap.mmap, Future, SpanSink | None]] = deque()
        buffers = Buffers(unit)
        held = 0  # bytes of the buffers of the spans submitted and not yet consumed
        todo = iter(spans)
        try:
            while True:
                while not pending or held < self.budget:
                    span = next(todo, None)
                    if span is None:
                        break
                    buffer = buffers.take(span.size)
                    into = memoryview(buffer)[: span.size]
                    own = {i: places[i] for i, _, _ in span.items if i in places}
                    sink = SpanSink(span, into, own) if own else None
                    future = pool.submit(self.get, span, into if sink is None else sink)
                    pending.append((span, buffer, future, sink))
                    held += len(buffer)
                if not pending:
                    return
                span, buffer, future, sink = pending.popleft()
                future.result()
                yield span, memoryview(buffer)[: span.size], sink
                held -= len(buffer)
                buffers.give(buffer)
        finally:
            self.buffers = buffers.made
            pool.shutdown(wait=True, cancel_futures=True)


class Buffers:
    """Receive buffers of ``unit`` bytes (the span size), reused: anonymous memory maps
    (pages the kernel maps at their first write, not zeroed by Python: a ``bytearray``
    of 64 MiB wrote each of its bytes once more). A span larger than a unit (one large
    item) gets a buffer of its own, dropped once it is loaded: kept, it would be handed
    to later spans and count its whole size against the budget, holding fewer GETs in
    flight."""

    def __init__(self, unit: int):
        self.unit, self.free, self.made = unit, [], 0

    def take(self, size: int) -> mmap.mmap:
        if size <= self.unit and self.free:
            return self.free.pop()
        self.made += 1
        return mmap.mmap(-1, max(1, self.unit, size))  # an anonymous map has a byte at least

    def give(self, buffer: mmap.mmap):
        if len(buffer) == max(1, self.unit):
            self.free.append(buffer)


class StoreReader(FsspecReader):
    """DCP's reader for a checkpoint folder on S3 (``s3://bucket/prefix``): the planning
    and metadata of ``FsspecReader``, the data read by ``SpanFetcher`` (module docstring).
    ``etags``: {file name: ETag} of the manifest, checked on every GET."""

    def __init__(self, path: str, etags: dict[str, str] | None = None):
        super().__init__(path, use_listings_cache=False)
        bucket, _, prefix = str(path).split("://", 1)[1].partition("/")
        self.bucket, self.prefix = bucket, prefix.rstrip("/")
        self.etags = dict(etags or {})
        self.stats: dict = {}
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        """``.metadata``, fetched once per folder: the manager reads it before DCP's load,
        which reads it again (a GET each, ~20-50 ms on a store)."""
        key = (str(self.path), kwargs.get("rank"))
        if self._metadata is None or self._metadata[0] != key:
            self._metadata = (key, super().read_metadata(*args, **kwargs))
        metadata = self._metadata[1]
        metadata.storage_meta.load_id = self.load_id  # this load's (reset draws a new one)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """Fetch and load this rank's items. Cost: O(own shard) bytes (+ gaps), in
        ceil(bytes / span) GETs, at most IN_FLIGHT at once; memory: at most
        IN_FLIGHT x SPAN_MAX bytes of buffers, plus the largest span (module docstring)."""
        begin = time.perf_counter()
        by_index: dict = {}
        for item in plan.items:
            by_index.setdefault(item.storage_index, []).append(item)
        ranges = {}
        for index in by_index:
            info = self.storage_data[index]
            ranges[index] = (info.relative_path, info.offset, info.length)
        needed = sum(length for _, _, length in ranges.values())
        unit = span_size(needed)
        spans = plan_requests(ranges, gap=GAP, span_max=unit)
        places = self._places(by_index, planner)
        fetcher = SpanFetcher(_s3_client(), self.bucket, self.prefix, self.etags)
        in_place = again = 0
        for span, view, sink in fetcher.fetch(spans, unit, places):
            for index, offset, length in span.items:
                at = offset - span.start
                record = view[at : at + length]
                received = sink.layouts.get(index) if sink is not None else None
                if received is not None:
                    (layout, hole), (item,) = received, by_index[index]
                    if torch_record.confirms(record, layout, hole):
                        planner.commit_tensor(item, places[index].target)
                        in_place += len(places[index].bytes)
                        continue
                    # the record is not what its first bytes said: its values, written
                    # into the tensor, are read again whole and loaded as any other's
                    record = self._fetch_whole(fetcher, span.file, offset, length)
                    again += 1
                for item in by_index[index]:
                    self._load_item(item, record, planner)
            del view, record
        seconds = time.perf_counter() - begin
        self.stats = {"needed": needed, "fetched": fetcher.fetched, "requests": fetcher.requests,
                      "retries": fetcher.retries, "direct": fetcher.direct,
                      "buffers": fetcher.buffers, "in_place": in_place, "again": again,
                      "spans": [(s.file, s.start, s.end) for s in spans], "files": len({r[0] for r in ranges.values()}), "seconds": seconds}  # fmt: skip
        logger.info("read %s: %d items, %.1f MB needed, %.1f MB fetched (%.3fx) in %d ranged "
                    "GETs of %d files, %.1f MB received in place, %.2f s", self.path,
                    len(plan.items), needed / 1e6, fetcher.fetched / 1e6,
                    fetcher.fetched / max(1, needed), fetcher.requests, self.stats["files"],
                    in_place / 1e6, seconds)  # fmt: skip
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _places(self, by_index: dict, planner: LoadPlanner) -> dict:
        """{storage index: ``Place``} for the entries whose values can be received
        straight into their tensor: one read item loading a whole saved tensor (not a
        part of it: a layout change), at least ``IN_PLACE_MIN`` bytes, no transform,
        into a contiguous CPU tensor; the dtype and shape are checked against the record
        as it arrives (``SpanSink``)."""
        places = {}
        for index, items in by_index.items():
            if len(items) != 1 or items[0].type == LoadItemType.BYTE_IO:
                continue
            item, info = items[0], self.storage_data[index]
            if info.transform_descriptors or info.length < IN_PLACE_MIN:
                continue
            if any(item.storage_offsets):  # a part of a saved tensor
                continue
            target = planner.resolve_tensor(item).detach()
            if tuple(target.size()) != tuple(item.lengths):
                continue
            place = Place.of(target)
            if place is not None:
                places[index] = place
        return places

    def _fetch_whole(self, fetcher: SpanFetcher, file: str, offset: int, length: int):
        """An entry's bytes, fetched again into bytes of their own (one GET)."""
        whole = memoryview(bytearray(length))
        fetcher.get(Span(file, offset, offset + length), whole)
        return whole

    def _load_item(self, item: ReadItem, data: memoryview, planner: LoadPlanner):
        descriptors = self.storage_data[item.storage_index].transform_descriptors or ()
        if item.type == LoadItemType.BYTE_IO or descriptors:
            raw = io.BytesIO(data)  # one copy of the item's bytes
            if descriptors:
                stream = self.transforms.transform_load_stream(item, descriptors, raw)
                raw = io.BytesIO(stream.read(-1))
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, raw)
                return
            tensor = cast(torch.Tensor, torch.load(raw, map_location="cpu", weights_only=True))
        else:
            tensor = saved_tensor(data)  # the fetched bytes themselves: copied once, below
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise StoreReadError(f"entry {item.storage_index} has shape {tuple(tensor.size())}, "
                                  f"this run expects {tuple(target.size())}")  # fmt: skip
        target.copy_(tensor)
        planner.commit_tensor(item, target)
