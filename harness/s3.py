"""A real S3 API on 127.0.0.1 for tests and benchmarks: moto's server mode.

``local_s3()`` starts ``moto.server.ThreadedMotoServer`` on a free port, points the
standard variables at it (``AWS_ENDPOINT_URL``, dummy ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) so that the product's own client stack
(fsspec → s3fs → aiobotocore/botocore, over HTTP) reaches it as it would reach a bucket,
creates a bucket and yields its name. The server enforces conditional writes
(``If-None-Match: *``, ``If-Match: <etag>``) and gives ETags. The variables are restored
and fsspec's cached file systems dropped at the end.

``local_s3(traffic=Traffic())`` puts a WSGI layer in front of the server that counts what
it answered (requests and body bytes by method, ranged GETs apart: the independent count a
reader's own figures are checked against) and answers the first ``traffic.fail_next``
requests of ``traffic.fail_kinds`` with ``traffic.fail_status`` (503 SlowDown: throttling;
403 InvalidAccessKeyId: wrong credentials, which moto's server does not check itself; 404
NoSuchBucket: a server restarted empty, for the objects under ``traffic.fail_within`` only) or by closing the connection unanswered (``status`` 0: a dropped
connection), to test a client's retries; ``traffic.damage_next`` GETs it answers damaged
on the way (``damage``: a wrong CRC32 header, or a body cut short).

``missing()`` says why the server cannot run here (moto or s3fs not installed: the
``s3`` and ``dev`` extras), or None; a test skips with that reason.

Never: mock the client. Nothing in ``torchtitan/`` imports this.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def missing() -> str | None:
    for module, extra in (("moto", "moto[s3] (the dev extra)"), ("s3fs", "s3fs (the s3 extra)"),
                          ("flask", "flask (the dev extra)")):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            return f"no local S3 server: {module} is not installed (pip install {extra})"
    return None


def _drop_cached_filesystems():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


# What the server says with each injected status.
_FAULTS = {503: ("SlowDown", "Please reduce your request rate."),
           403: ("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist "
                 "in our records."),
           404: ("NoSuchBucket", "The specified bucket does not exist")}  # fmt: skip


@dataclass
class Traffic:
    """What the server answered (filled as it answers) and the faults it injects."""

    requests: dict[str, int] = field(default_factory=dict)  # "GET", "GET range", "PUT"...
    body_bytes: dict[str, int] = field(default_factory=dict)  # bytes of the bodies sent
    by_name: dict[str, int] = field(default_factory=dict)  # GET body bytes per object name
    log: list | None = None  # a list: (time.time() at the end, kind, path, body bytes) each
    ranges: list | None = None  # a list: (path, Range header) of each ranged GET asked
    fail_next: int = 0  # how many more requests to fail
    fail_kinds: tuple = ("GET", "GET range")
    fail_suffix: str = ""  # only objects whose name ends so
    fail_within: str = ""  # only objects whose path holds this (``/step-4/``)
    fail_status: int = 503  # 0: drop the connection without an answer
    failed: int = 0
    damage_next: int = 0  # how many more GETs (of ``fail_suffix`` objects) to damage
    damage: str = "checksum"  # "checksum": a wrong x-amz-checksum-crc32; "cut": half a body
    damaged: int = 0
    presigned: int = 0  # requests answered that were signed in their URL (query string)
    # (what, until time.monotonic()): every request meanwhile held to ``until`` ("pause":
    # a store that stops answering), delayed 0.3 s ("slow"), or its connection dropped
    # unanswered ("restart": a server coming back with its data kept). The campaign's.
    hold: tuple | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self):
        with self.lock:
            self.requests, self.body_bytes, self.by_name, self.failed = {}, {}, {}, 0
            self.presigned = self.damaged = 0

    def wrap(self, app):
        def counted(environ, start_response):
            held = self.hold
            if held is not None and time.monotonic() < held[1]:
                if held[0] == "restart":
                    return self._drop(environ, start_response)
                time.sleep(max(0.0, held[1] - time.monotonic()) if held[0] == "pause" else 0.3)
            kind = environ["REQUEST_METHOD"] + (" range" if environ.get("HTTP_RANGE") else "")
            with self.lock:
                name = environ.get("PATH_INFO", "").rstrip("/").rsplit("/", 1)[-1]
                fail = (self.fail_next > 0 and kind in self.fail_kinds
                        and name.endswith(self.fail_suffix)
                        and self.fail_within in environ.get("PATH_INFO", ""))  # fmt: skip
                damage = (not fail and self.damage_next > 0 and kind.startswith("GET")
                          and name.endswith(self.fail_suffix))  # fmt: skip
                if damage:
                    self.damage_next -= 1
                    self.damaged += 1
                if fail:
                    self.fail_next -= 1
                    self.failed += 1
                else:
                    self.requests[kind] = self.requests.get(kind, 0) + 1
                    self.presigned += "X-Amz-Signature=" in environ.get("QUERY_STRING", "")
            if fail:
                return self._fail(environ, start_response)
            path = environ.get("PATH_INFO", "")
            if self.ranges is not None and kind == "GET range":
                with self.lock:
                    self.ranges.append((path, environ["HTTP_RANGE"]))
            if damage:
                return self._count(kind, name, path, self._damaged(environ, start_response, app))
            return self._count(kind, name, path, app(environ, start_response))

        return counted

    def _count(self, kind: str, name: str, path: str, body):
        sent = 0
        for chunk in body:
            sent += len(chunk)
            yield chunk
        with self.lock:
            self.body_bytes[kind] = self.body_bytes.get(kind, 0) + sent
            if kind.startswith("GET"):
                self.by_name[name] = self.by_name.get(name, 0) + sent
            if self.log is not None:
                self.log.append((time.time(), kind, path, sent))

    def sent(self, begin: float, end: float, kinds=("GET", "GET range")) -> tuple[int, int]:
        """(requests, body bytes) of the ``kinds`` answered between two ``time.time()``s."""
        with self.lock:
            hits = [n for t, k, _, n in self.log or [] if begin <= t <= end and k in kinds]
        return len(hits), sum(hits)

    def _damaged(self, environ, start_response, app):
        """The server's answer, damaged on the way: with a CRC32 header its body does not
        have (``checksum``), or its headers and half its body, then the connection shut
        (``cut``: the client sees the body end short of its Content-Length)."""
        length = []

        def respond(status, headers, exc_info=None):
            if self.damage == "checksum":
                headers = [(k, v) for k, v in headers if k.lower() != "x-amz-checksum-crc32"]
                headers.append(("x-amz-checksum-crc32", "AAAAAA=="))  # CRC32 0
            length.extend(int(v) for k, v in headers if k.lower() == "content-length")
            return start_response(status, headers, exc_info)

        body = app(environ, respond)
        if self.damage == "checksum":
            yield from body
            return
        keep = (length[0] if length else 0) // 2
        try:
            for chunk in body:
                if keep <= 0:
                    break
                yield chunk[:keep]
                keep -= len(chunk)
        finally:
            getattr(body, "close", lambda: None)()  # the WSGI contract: the app's iterable
        environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)

    def _drop(self, environ, start_response):
        """The connection closed under the request, unanswered."""
        start_response("500 Dropped", [])  # never sent: the socket is shut first
        environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
        return []

    def _fail(self, environ, start_response):
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        if self.fail_status == 0:
            return self._drop(environ, start_response)
        code, message = _FAULTS.get(self.fail_status, ("InternalError", "Injected."))
        body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error>").encode()  # fmt: skip
        start_response(f"{self.fail_status} Injected", [("Content-Type", "application/xml"),
                                                        ("Content-Length", str(len(body)))])  # fmt: skip
        return [body]


def _server(traffic: Traffic | None):
    from moto.server import ThreadedMotoServer

    if traffic is None:
        return ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    class CountingServer(ThreadedMotoServer):
        def _server_entry(self):
            from moto.moto_server.werkzeug_app import (
                DomainDispatcherApplication,
                create_backend_app,
            )
            from werkzeug.serving import make_server

            app = traffic.wrap(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    return CountingServer(ip_address="127.0.0.1", port=0, verbose=False)


@contextmanager
def local_s3(traffic: Traffic | None = None):
    """A fresh bucket on a local S3 server: yields ``(bucket, endpoint_url)``; ``traffic``
    (optional) counts what the server answers and injects faults."""
    server = _server(traffic)
    server.start()
    saved = {k: os.environ.get(k) for k in _VARS}
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test",
                          AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
        _drop_cached_filesystems()
        import s3fs

        bucket = f"tt-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem().mkdir(bucket)
        yield bucket, endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _drop_cached_filesystems()
        server.stop()
