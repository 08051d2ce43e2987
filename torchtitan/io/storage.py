"""Paths that may be a local file or an object in a store (any fsspec URL, ``s3://...``):
the few file operations the claims (claims.py) and the token counts (data/index.py) need.

Owns: telling a URL from a local path, and, for each, existing, reading, publishing a
whole file, removing; for an object on S3, the conditional requests claims are made of:
a put only if absent (``If-None-Match: *``), a put or a delete only if unchanged
(``If-Match: <ETag>``), and a read that returns the object's ETag, its LastModified and
the store's clock (the response's ``Date``). A store answers a failed condition with 412
(or 409 for two conditional writes racing): ``put_object`` returns None, ``delete_object``
False; "someone else won". The client (fsspec → s3fs → botocore) and its credentials and
endpoint come from the standard ``AWS_*`` variables (``AWS_ENDPOINT_URL``). A whole
object is read by one plain GET of a URL botocore signs (``_presigned_get``: about half
of s3fs's Python a request), falling back to s3fs, whose errors it keeps.

- **Whole or nothing.** A local file is written to a temporary name beside its own and
  renamed over it (``os.replace``); an object is one PUT, which a store makes visible
  whole or not at all. A kill -9 leaves at most a stray ``.<tmp>`` file locally, nothing
  in a store.
- **A request is retried by the client** (s3fs retries a dropped connection): a
  conditional put whose success was answered with a lost reply comes back as 412 on the
  retry. ``put_object`` then reads the object: holding exactly the bytes it sent (a claim
  record carries a token of its own, so no one else sends those bytes), it was this
  process's write, and it says so.

- **A retry changes no training state.** The waits between a request's tries are drawn
  from ``JITTER`` (the OS's entropy), never from the process's ``random``, which a
  checkpoint saves (checkpoint/stateful.py ``RNGState``): the project's own retries
  (store_reader, store_writer) draw from it, and so do botocore's and aiohttp's (their
  module-level draws pointed at it once they are imported: ``_draw_privately``).

Cost: each operation is one request on a store (``put_object`` two when its condition
fails: the look that tells a lost reply from a loss), one system call or two locally.

Never: decide what a file means, list a folder, or wait.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import importlib
import io
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URL (``s3://``, ``gs://``, ``hf://``...), read through fsspec."""
    return "://" in path


def on_s3(url: str) -> bool:
    """Whether ``url`` names an object on S3 (or an S3 API: ``AWS_ENDPOINT_URL``)."""
    return url.split("://", 1)[0].lower() in ("s3", "s3a")


def join(folder: str, *names: str) -> str:
    """``folder/name``: a URL's separator is ``/`` whatever the local one is."""
    if is_remote(folder):
        return "/".join([folder.rstrip("/"), *names])
    return os.path.join(folder, *names)


def dirname(path: str) -> str:
    return path.rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(path)


def _fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


# ---- the write guard: a leased folder is written only while its lease holds -------------
# Folders this process may write only while a check passes: the checkpoint folder whose
# lease it holds (``checkpoint.lease.Lease`` registers its ``check`` on acquiring, removes
# it on release). Asked right before every write this project sends, whatever module
# sends it: this module's own (``makedirs``, ``remove``, ``publish``: a rewind's record, a
# count), checkpoint/store.py's (a local write, remove or rename; a PUT, a delete, a
# copy, an abort) and the DCP writers' (each file a rank writes locally, each request to
# a store). So a write that waited behind a paused store's slow reads, or a record
# decided after the lease lapsed, is not sent. Not asked: the conditional requests of
# claims.py (``put_object``/``delete_object`` with a condition, a local link or ``utime``
# of the lease's own record), each conditional on the record its writer saw, so a holder
# that lost the lease cannot overwrite its taker's. ``test_store.py`` walks every write
# in the package to keep this list whole. Cost: a dict scan and a clock read under a lock
# per write.
_GUARDS: dict[str, Callable[[], None]] = {}


def guard_writes(folder: str, check: Callable[[], None]):
    """Before every write under ``folder`` (any store of this process), call ``check``,
    which raises where the write may not be sent; replaces an earlier guard of it."""
    _GUARDS[str(folder).rstrip("/")] = check


def unguard_writes(folder: str, check: Callable[[], None]):
    """Remove ``folder``'s guard if it is still ``check`` (a later job's stays)."""
    key = str(folder).rstrip("/")
    if _GUARDS.get(key) == check:
        _GUARDS.pop(key, None)


def before_write(path: str):
    """Raise (the guard's error) where ``path`` lies in a guarded folder whose check fails."""
    path = str(path)
    for folder, check in list(_GUARDS.items()):
        if path == folder or path.startswith(folder + "/"):
            check()


def makedirs(folder: str):
    """A local folder and its parents; nothing in a store (a key needs no folder)."""
    if not is_remote(folder):
        before_write(folder)
        os.makedirs(folder, exist_ok=True)


def exists(path: str) -> bool:
    """Whether the file or object exists (a store: one HEAD request)."""
    if not is_remote(path):
        return os.path.exists(path)
    if on_s3(path):  # one HEAD (fsspec's exists lists the prefix when the key is absent)
        fs, bucket, key = _s3(path)
        try:
            fs.call_s3("head_object", Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            return False
    fs, inner = _fs(path)
    fs.invalidate_cache(inner)  # another process may have written it since a listing
    return fs.exists(inner)


def read_bytes(path: str) -> bytes:
    """The whole file; FileNotFoundError where there is none (a store: one GET)."""
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    if on_s3(path):  # one GET (fsspec's cat asks for the size first)
        body = _presigned_get(path)
        if body is not None:
            return body
        found = get_object(path)
        if found is None:
            raise FileNotFoundError(path)
        return found.body
    fs, inner = _fs(path)
    return fs.cat_file(inner)


def remove(path: str):
    """Remove the file if it is there (errors ignored: a later writer replaces it)."""
    before_write(path)
    with contextlib.suppress(OSError):
        if is_remote(path):
            fs, inner = _fs(path)
            fs.rm_file(inner)
        else:
            os.remove(path)


def publish(path: str, write):
    """Make ``path`` a whole file written by ``write(f)`` (f: a binary file object), never
    a partial one. Locally: written to ``.<random><suffix>`` beside it, then renamed over
    it. On S3: one PUT, created only if absent (``If-None-Match: *``): a file someone
    published first is kept, theirs and this one holding the same thing by construction
    (a count file's name is the key of what it holds). Elsewhere (another fsspec store):
    one plain put. Raises OSError where it cannot be written, and the guard's error where
    ``path`` is in a leased folder this job may no longer write (``before_write``)."""
    # mutant storage-publish-unguarded: `before_write(path)` -> `None`; test/checkpoint/test_store.py::test_every_write_request_under_a_guarded_folder_asks_its_guard_first
    before_write(path)
    if not is_remote(path):
        folder, name = os.path.split(path)
        suffix = os.path.splitext(name)[1]
        # A unique name: writers on other hosts sharing the folder never meet.
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=suffix, dir=folder or ".")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
        return
    buffer = io.BytesIO()
    write(buffer)
    if on_s3(path):
        put_object(path, buffer.getvalue(), absent=True)  # None: another's stands
    else:
        fs, inner = _fs(path)
        fs.pipe_file(inner, buffer.getvalue())


# ---- retry waits drawn off the process's generators -------------------------------------
# The OS's entropy (os.urandom, ~1 us a draw), for the random waits between the tries of a
# request: it has no state, so a retry changes nothing a checkpoint saves, a forked
# process does not wait exactly as its parent does, and no seed puts ranks' retries in step.
JITTER = random.SystemRandom()

# The libraries on a store's path whose draws took the process's ``random``: botocore's
# legacy retries (``retryhandler.delay_exponential``), its standard and adaptive ones
# (``ExponentialBackoff``'s default ``random``), its refresh of instance credentials
# (``utils``) and aiohttp's choice of the host a freed connection goes to (``connector``,
# s3fs's pool, with several hosts waiting: a bucket each on AWS).
_DRAWING = ("botocore.retryhandler", "botocore.retries.standard", "botocore.utils",
            "aiohttp.connector")  # fmt: skip


def _draw_privately(module) -> None:
    """Point ``module``'s draws at ``JITTER``: the same functions (``random()``,
    ``randint``, ``shuffle``), so the same waits in distribution.

    Why here, for the whole process, and not per client: s3fs's clients are built by
    fsspec wherever a module opens an ``s3://`` URL (the corpus, the counts, the
    checkpoint folder, the claims), with the caller's options; no one place sees them
    all. Why not botocore's retries off (``max_attempts`` 1) with the project's own
    retrying instead, as store_reader and store_writer do for their own client: s3fs's
    loop retries only throttling and dropped connections, so a 500 on a lease's heartbeat
    or a count file would stop a run that botocore's retries carry through today. A
    module whose draws moved elsewhere (another release) is left as it is: the test of
    the generators after retries (test_store_faults.py) then fails."""
    if module.__name__ == "botocore.retries.standard":
        init = module.ExponentialBackoff.__init__
        init.__defaults__ = tuple(JITTER.random if d == random.random else d
                                  for d in init.__defaults__ or ())  # fmt: skip
    elif getattr(module, "random", None) is random:
        module.random = JITTER


def _draw_privately_once_imported() -> None:
    """``_draw_privately`` on each of ``_DRAWING`` as soon as it is imported (at once if
    it is): wrapt's post-import hooks (wrapt comes with aiobotocore, the s3 extra). Cost:
    wrapt's import (~20 ms) where it is installed; without it, botocore's modules are
    imported here (~60 ms, where botocore is installed) and aiohttp's are left alone."""
    try:
        from wrapt import register_post_import_hook
    except ImportError:
        for name in _DRAWING[:3]:
            try:
                _draw_privately(importlib.import_module(name))
            except ImportError:
                return
        return
    for name in _DRAWING:
        register_post_import_hook(_draw_privately, name)


_draw_privately_once_imported()


# ---- a whole object in one presigned GET ------------------------------------------------
# Failed presigned GETs after which a process reads through s3fs alone: a store that
# answers s3fs but not a plain GET (a proxy only botocore's own config files name) costs
# this many wasted requests in a row, not one per read.
PRESIGNED_FAILURES = 3
_presigned_failed = [0]  # this process's presigned GETs failed in a row (a fact of its store)
_CLIENT_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_CA_BUNDLE")  # fmt: skip
_PROXY_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
               "all_proxy", "NO_PROXY", "no_proxy")  # fmt: skip
_CLIENTS: dict = {}  # (what, process, its variables) -> a botocore client, an HTTP pool, a lock


def botocore_client(**config):
    """A botocore S3 client for the endpoint and credentials of the ``AWS_*`` variables
    (with ``config``: ``botocore.config.Config``'s arguments), made once per process and
    variables (a client takes ~0.1-0.3 s to build); thread-safe."""
    key = ("client", os.getpid(), tuple(os.environ.get(v) for v in _CLIENT_VARS), repr(config))
    if key not in _CLIENTS:
        with _building():  # threads asking at once build one (~0.1 s, not 0.75 s for five)
            if key not in _CLIENTS:
                import botocore.config
                import botocore.session

                session = botocore.session.get_session()
                loaded = _models_loaded()
                if loaded is not None:
                    session.register_component("data_loader", loaded)
                config = botocore.config.Config(**config)
                _CLIENTS[key] = session.create_client("s3", config=config)
    return _CLIENTS[key]


def _models_loaded():
    """The loader of botocore's endpoint and service models that s3fs's session has filled
    where this process reached S3 through it already (a client then builds in ~0.01 s,
    not ~0.2 s parsing the same JSON again); None otherwise."""
    try:
        import fsspec

        fs = fsspec.filesystem("s3")  # fsspec keeps one instance per options: s3fs's own
        session = getattr(fs, "session", None)
        return session.get_component("data_loader") if session is not None else None
    except Exception:  # noqa: BLE001 - no s3fs, or another: the client loads its own models
        return None


def _building():
    """This process's lock for building a client (a forked child's own: a lock copied
    while a parent's thread held it would never be released)."""
    return _CLIENTS.setdefault(("lock", os.getpid()), threading.Lock())


def _http_pool():
    """This process's pool of plain HTTP(S) connections for presigned GETs (a forked
    process makes its own: its parent's sockets are not its), verifying TLS against the
    bundle botocore uses (``AWS_CA_BUNDLE``, else certifi's); None where the environment
    sets a proxy (botocore's proxy rules, not urllib3's, apply to the store)."""
    ca = os.environ.get("AWS_CA_BUNDLE")
    key = ("pool", os.getpid(), ca, *(os.environ.get(v) for v in _PROXY_VARS))
    if key not in _CLIENTS:
        import urllib.request

        import urllib3
        from botocore.httpsession import get_cert_path

        with _building():
            proxies = {k for k in urllib.request.getproxies() if k != "no"}  # NO_PROXY alone: none
            if key not in _CLIENTS and proxies:
                _CLIENTS[key] = None
            elif key not in _CLIENTS:
                _CLIENTS[key] = urllib3.PoolManager(maxsize=16, ca_certs=ca or get_cert_path(True))
    return _CLIENTS[key]


def _presigned_get(url: str) -> bytes | None:
    """The bytes of the object at ``url`` by one plain GET of a URL signed here (SigV4 in
    the query, by botocore: its endpoint, region, addressing and credentials, session
    tokens included); FileNotFoundError where the bucket holds no such key; None where
    this way did not work (any other answer, a connection refused or dropped): the caller
    then reads through s3fs, which retries and names the fault, and so every error a read
    can raise is the one it raised before.

    Why: small objects read often (a token-count file per unit of the order, ~1-4 KB) cost
    their client's Python more than their bytes, and that Python holds the GIL the
    loader's main thread tokenizes under. Measured on the local S3 server (4 KB objects,
    user CPU per GET): s3fs 2.1 ms, botocore's ``get_object`` 1.6 ms (its event hooks and
    the parsing of the reply into a modeled dict), this way 1.2 ms (signing 0.3 ms, one
    urllib3 GET). Each process that walks the order reads a count file per unit: at c4's
    ~1.4 M units a pass, ~28 min of Python a pass against ~49 min through s3fs; at
    FineWeb's ~90 M units, ~30 h against ~52 h, over a pass of weeks.

    Off for the process after ``PRESIGNED_FAILURES`` failures in a row (logged once; an
    answer of the store's, 200 or NoSuchKey, ends a row; a 5xx, throttling or the store's
    own fault, is not counted: s3fs meets it too and retries it), where a proxy is set in
    the environment (``_http_pool``), and where fsspec's configuration sets anything for
    s3 (an endpoint, ``anon``, client arguments: s3fs's store may not be the one the
    ``AWS_*`` variables name). Cost: one GET, no retry."""
    import fsspec
    import urllib3

    pool = _http_pool()
    if _presigned_failed[0] >= PRESIGNED_FAILURES or pool is None or fsspec.config.conf.get("s3"):
        return None
    bucket, _, key = url.split("://", 1)[1].partition("/")
    try:
        signed = botocore_client(signature_version="s3v4").generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=900
        )
        # The stored bytes as they are: no retry (s3fs's), and no decoding of a
        # Content-Encoding the writer set (botocore and s3fs hand the bytes undecoded).
        reply = pool.request("GET", signed, retries=False, decode_content=False,
                             timeout=urllib3.Timeout(connect=10, read=60))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any failure here is s3fs's to retry and name
        return _presigned_failure(url, repr(e))
    if reply.status == 200 or (reply.status == 404 and b"<Code>NoSuchKey</Code>" in reply.data):
        _presigned_failed[0] = 0  # the store answered this way: a row of failures ends
        if reply.status == 404:
            raise FileNotFoundError(url)
        return reply.data
    if reply.status >= 500:  # throttled, or the store's own fault: s3fs retries it
        return None
    return _presigned_failure(url, f"HTTP {reply.status}")


def _presigned_failure(url: str, why: str) -> None:
    _presigned_failed[0] += 1
    if _presigned_failed[0] == PRESIGNED_FAILURES:
        logger.warning(
            "a presigned GET of %s failed (%s), the %d-th in a row in this process: small "
            "objects are read through s3fs from now on", url, why, PRESIGNED_FAILURES)  # fmt: skip
    return None


# ---- faults of the store, said in one line ----------------------------------------------
_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                "ExpiredToken", "InvalidToken"}  # fmt: skip


def store_fault(error: BaseException) -> str | None:
    """One line naming a fault of the object store behind ``error`` (anywhere in its
    chain of causes) and its fix: the store unreachable (no ``AWS_ENDPOINT_URL``, or
    nobody listening there), no or wrong credentials, a bucket that does not exist (a
    local server restarted empty); failing those, a local file this process may not
    open (a PermissionError naming it: the file's mode or owner). None for anything
    else. The client (s3fs, botocore) has retried a transient fault already: s3fs's and
    botocore's retries, 5 tries each with exponential backoff, before an error reaches
    here. Cost: none (no request)."""
    line = _store_line(error)
    if line is not None:
        return line
    for cause in _chain(error):
        if isinstance(cause, PermissionError) and cause.filename:
            return (f"permission denied on {cause.filename} ({cause.strerror}): give the "
                    "job's user access to it (chmod / chown), or point the run at files it "
                    "may read and folders it may write")  # fmt: skip
    return None


def _chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and its causes (or contexts), outermost first, each once."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _store_line(error: BaseException) -> str | None:
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    where = f"AWS_ENDPOINT_URL={endpoint}" if endpoint else "AWS_ENDPOINT_URL is not set: AWS"
    for cause in _chain(error):
        name, text = type(cause).__name__, str(cause).splitlines()[0] if str(cause) else ""
        code, _ = _answer(cause) if hasattr(cause, "response") else (None, None)
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError"):
            return (f"the object store cannot be reached ({text}; {where}): set "
                    "AWS_ENDPOINT_URL to the store's address and check that it is up")  # fmt: skip
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return ("the object store needs credentials and none are set: set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")  # fmt: skip
        if code in _CREDENTIALS:
            return (f"the object store refused the credentials ({code}: {text}; {where}): set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to ones that may use it")  # fmt: skip
        if code == "NoSuchBucket" or "bucket does not exist" in text.lower():
            return (f"the bucket does not exist ({text}; {where}): create it, or point the "
                    "URL at an existing one (a local server restarted empty loses its "
                    "buckets)")  # fmt: skip
    return None


# ---- conditional requests on S3 (the claims) -------------------------------------------
@dataclass
class Object:
    """An object as read: its bytes, its ETag, when it was last written (LastModified)
    and the store's clock when it answered (``Date``; None where the reply has none), as
    seconds since the epoch, both at the store's one-second resolution."""

    body: bytes
    etag: str
    modified: float
    now: float | None

    @property
    def age(self) -> float:
        """Seconds since the object was written, by the store's clock where it gave its
        own (no skew between this machine and the writer's or the store's), else by this
        machine's (off by the skew between the two clocks). To a second either way."""
        return max(0.0, (self.now if self.now is not None else time.time()) - self.modified)


def _s3(url: str):
    """(file system, bucket, key) of an ``s3://`` URL; OSError for another store."""
    if not on_s3(url):
        raise OSError(errno.ENOTSUP, f"{url}: claims need conditional writes, which this "
                      "project makes on S3 only (s3://, or an S3 API via AWS_ENDPOINT_URL)")  # fmt: skip
    fs, inner = _fs(url)
    bucket, key, _ = fs.split_path(inner)
    return fs, bucket, key


def _answer(error: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a store's refusal: s3fs raises it as an OSError
    (FileExistsError, OSError(EINVAL) for a 412...), its cause the client's error."""
    response = getattr(error.__cause__ or error, "response", None) or {}
    return response.get("Error", {}).get("Code"), response.get("ResponseMetadata", {}).get(
        "HTTPStatusCode"
    )


def _condition_failed(error: BaseException) -> bool:
    """412 PreconditionFailed, or 409 ConditionalRequestConflict (a concurrent conditional
    write won)."""
    code, status = _answer(error)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _not_implemented(error: BaseException) -> bool:
    code, status = _answer(error)
    return code == "NotImplemented" or status == 501


def get_object(url: str) -> Object | None:
    """The object at ``url`` (None: there is none). One GET."""
    from fsspec.asyn import sync

    fs, bucket, key = _s3(url)

    async def call_and_read():
        reply = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            return reply, await reply["Body"].read()
        finally:
            reply["Body"].close()

    try:
        reply, body = sync(fs.loop, call_and_read)
    except FileNotFoundError:
        return None
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else None
    return Object(body, reply["ETag"], reply["LastModified"].timestamp(), now)


def put_object(url: str, body: bytes, absent: bool = False, etag: str | None = None):
    """Write ``body`` at ``url`` if the condition holds: ``absent``, only if there is no
    object (``If-None-Match: *``); ``etag``, only if the object is still that one
    (``If-Match``). Returns the new ETag, or None when the condition failed (another
    process's write came first). One PUT (and one GET when the condition failed)."""
    fs, bucket, key = _s3(url)
    condition = {"IfNoneMatch": "*"} if absent else {"IfMatch": etag} if etag else {}
    try:
        return fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **condition)["ETag"]
    except OSError as e:  # If-Match on an absent object: 404
        if _not_implemented(e) and condition:
            raise OSError(errno.ENOSYS, f"{url}: this store does not take conditional writes "
                          f"({next(iter(condition))}), which claims need: {e}") from e  # fmt: skip
        if not (isinstance(e, FileNotFoundError) and etag) and not _condition_failed(e):
            raise
    now = get_object(url)  # a retried request whose first try won: these very bytes
    return now.etag if now is not None and now.body == body else None


def delete_object(url: str, etag: str) -> bool:
    """Delete the object only if it is still ``etag`` (``If-Match`` on DeleteObject: S3
    and its usual look-alikes honour it); False when it changed or is gone. A store that
    refuses the condition (501 NotImplemented) gets a plain delete. One DELETE."""
    fs, bucket, key = _s3(url)
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if _condition_failed(e):
            return False
        if not _not_implemented(e):
            raise
    fs.call_s3("delete_object", Bucket=bucket, Key=key)
    return True
