"""A real S3 API on 127.0.0.1 for tests and benchmarks: moto's server mode.

``local_s3()`` starts ``moto.server.ThreadedMotoServer`` on a free port, points the
standard variables at it (``AWS_ENDPOINT_URL``, dummy ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) so that the product's own client stack
(fsspec → s3fs → aiobotocore/botocore, over HTTP) reaches it as it would reach a bucket,
creates a bucket and yields its name. The server enforces conditional writes
(``If-None-Match: *``, ``If-Match: <etag>``) and gives ETags. The variables are restored
and fsspec's cached file systems dropped at the end.

``missing()`` says why the server cannot run here (moto or s3fs not installed: the
``s3`` and ``dev`` extras), or None; a test skips with that reason.

Never: mock the client. Nothing in ``torchtitan/`` imports this.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from contextlib import contextmanager

_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def missing() -> str | None:
    for module, extra in (("moto", "moto[server] (the dev extra)"), ("s3fs", "s3fs (the s3 extra)"),
                          ("flask", "moto[server] (the dev extra)")):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            return f"no local S3 server: {module} is not installed (pip install {extra})"
    return None


def _drop_cached_filesystems():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextmanager
def local_s3():
    """A fresh bucket on a local S3 server: yields ``(bucket, endpoint_url)``."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
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
