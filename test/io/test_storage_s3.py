"""A whole object read from S3 (``storage.read_bytes``: a token-count file, a sidecar): one
plain GET of a URL botocore signs, falling back to s3fs, whose errors it keeps. On the
local S3 server of harness/s3.py, which counts the requests it answers and which of them
were signed in their URL (``Traffic.presigned``), and injects faults.

Negative controls: with the presigned way off, the same read is one GET signed in its
headers; a fault the server injects once is read through s3fs, and the bytes are the
object's, never the error's body."""

from __future__ import annotations

import logging
import uuid

import pytest

from harness.s3 import Traffic, local_s3, missing
from torchtitan.io import storage

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))


@pytest.fixture(scope="module")
def server():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    traffic = Traffic()
    with local_s3(traffic) as (bucket, _endpoint):
        yield bucket, traffic


@pytest.fixture
def obj(server, monkeypatch):
    """(url of a fresh 4 KB object, its bytes, the server's traffic, reset), with this
    process's count of failed presigned GETs at 0."""
    bucket, traffic = server
    monkeypatch.setattr(storage, "_presigned_failed", [0])
    url, body = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/0-256.npz", uuid.uuid4().bytes * 256
    storage.put_object(url, body)
    traffic.reset()
    traffic.fail_next, traffic.fail_status = 0, 503
    yield url, body, traffic
    traffic.fail_next = 0


def test_a_whole_object_is_one_presigned_get(obj, monkeypatch):
    url, body, traffic = obj
    assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 1
    # Control: the presigned way off, the read is s3fs's one GET, signed in its headers.
    monkeypatch.setattr(storage, "_presigned_failed", [storage.PRESIGNED_FAILURES])
    traffic.reset()
    assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 0


def test_a_proxy_in_the_environment_leaves_the_read_to_s3fs(obj, monkeypatch):
    """botocore's proxy rules apply to the store, not urllib3's: where a proxy is set, the
    read is s3fs's (the endpoint here is http://, so an HTTPS proxy leaves s3fs direct)."""
    url, body, traffic = obj
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 0


def test_no_proxy_alone_keeps_the_presigned_way(obj, monkeypatch):
    """``NO_PROXY`` alone (set on many clusters) names no proxy: the read is presigned."""
    url, body, traffic = obj
    monkeypatch.setenv("NO_PROXY", "169.254.169.254,.internal")
    assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 1


def test_fsspecs_own_s3_settings_leave_the_read_to_s3fs(obj, monkeypatch):
    """Where fsspec's configuration sets anything for s3 (an endpoint, ``anon``...), s3fs
    may reach another store than the ``AWS_*`` variables name: the read is s3fs's."""
    import fsspec.config

    url, body, traffic = obj
    monkeypatch.setitem(
        fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 2}}}
    )
    assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 0


def test_a_missing_key_is_not_found_in_one_get(obj):
    url, _, traffic = obj
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(url + ".absent")
    assert traffic.requests == {"GET": 1} and traffic.presigned == 1
    assert storage._presigned_failed == [0]  # an answer, not a failure of the way


@pytest.mark.parametrize("status", [403, 503, 0], ids=["refused", "throttled", "dropped"])
def test_a_failed_presigned_get_is_read_through_s3fs(obj, status):
    """A refusal or a dropped connection counts towards turning the way off; a 5xx
    (throttling: s3fs meets it too, and retries it) does not."""
    url, body, traffic = obj
    traffic.fail_next, traffic.fail_status = 1, status
    assert storage.read_bytes(url) == body  # the object's bytes, not the error's body
    assert traffic.failed == 1 and traffic.requests == {"GET": 1} and traffic.presigned == 0
    assert storage._presigned_failed == [0 if status == 503 else 1]


def test_presigned_gets_stop_after_repeated_failures(obj, caplog):
    """Off after PRESIGNED_FAILURES failures in a row, said once; a read the store
    answers this way ends a row. Control: failures with a success between them keep the
    way on."""
    url, body, traffic = obj
    traffic.fail_status = 403

    def failed_once():
        traffic.fail_next = 1
        assert storage.read_bytes(url) == body

    for _ in range(storage.PRESIGNED_FAILURES - 1):
        failed_once()
    assert storage.read_bytes(url) == body  # answered: the row ends
    assert storage._presigned_failed == [0]
    with caplog.at_level(logging.WARNING, logger="torchtitan.io.storage"):
        for _ in range(storage.PRESIGNED_FAILURES):
            failed_once()
        traffic.reset()
        assert storage.read_bytes(url) == body
    assert traffic.requests == {"GET": 1} and traffic.presigned == 0  # s3fs's alone now
    said = [r for r in caplog.records if "read through s3fs from now on" in r.getMessage()]
    assert len(said) == 1


def test_an_object_stored_compressed_is_read_as_stored(obj):
    """An object written with ``Content-Encoding: gzip`` reads back as its stored bytes, as
    through s3fs (botocore does not decode them): urllib3 would decompress it by default."""
    import gzip

    url, _, traffic = obj
    stored = gzip.compress(b"counts " * 1000)
    bucket, _, key = url.split("://", 1)[1].partition("/")
    storage.botocore_client().put_object(Bucket=bucket, Key=key + ".gz", Body=stored,
                                         ContentEncoding="gzip")  # fmt: skip
    traffic.reset()
    assert storage.read_bytes(url + ".gz") == stored
    assert traffic.presigned == 1
