"""Data files in object storage, on a real S3 API (moto's server on 127.0.0.1, reached
through fsspec → s3fs → botocore): an object changed in place is refused, naming it."""

from __future__ import annotations

import pytest

from harness import s3
from torchtitan.data.fingerprint import fingerprint_diff
from torchtitan.data.spec import SourceSpec, ends_crc, remote_signature

pytestmark = pytest.mark.skipif(s3.missing() is not None, reason=str(s3.missing()))


@pytest.fixture
def bucket():
    with s3.local_s3() as (name, _endpoint):
        yield name


def _put(url: str, data: bytes):
    import fsspec

    with fsspec.open(url, "wb") as f:
        f.write(data)


def _fingerprint(files: list[str]) -> dict:
    spec = SourceSpec(name="web", files=files, weight=1.0, root="", location="s3", named=True)
    return {"sources": [{"name": "web", "files": spec.fingerprint()}]}


def test_an_object_changed_in_place_is_refused_naming_it(bucket):
    a, b = f"s3://{bucket}/web/a.jsonl", f"s3://{bucket}/web/b.jsonl"
    _put(a, b'{"text": "first document"}\n')
    _put(b, b'{"text": "other document"}\n')
    before = _fingerprint([a, b])
    # Negative control: nothing rewritten, nothing differs (the tag is stable).
    assert fingerprint_diff(before, _fingerprint([a, b])) == []
    # Rewritten at the same size: only the store's tag can tell.
    _put(b, b'{"text": "OTHER document"}\n')
    assert remote_signature(b)[0] == len(b'{"text": "first document"}\n')
    assert fingerprint_diff(before, _fingerprint([a, b])) == ["source 'web' file b.jsonl changed"]


def test_an_object_without_a_tag_is_signed_by_its_ends(bucket):
    import fsspec

    url = f"s3://{bucket}/c.jsonl"
    _put(url, b"x" * (3 << 20))
    fs, inner = fsspec.core.url_to_fs(url)
    first = ends_crc(fs, inner, 3 << 20)
    assert first == ends_crc(fs, inner, 3 << 20)
    _put(url, b"x" * ((3 << 20) - 1) + b"y")  # the last byte, at the same size
    assert ends_crc(fs, inner, 3 << 20) != first
    _put(url, b"y" + b"x" * ((3 << 20) - 1))  # the first byte
    assert ends_crc(fs, inner, 3 << 20) != first


def test_a_hub_file_is_named_only():
    # The revision stamp pins a Hub file's bytes; signing it would ask the Hub.
    assert SourceSpec.signature("hf://datasets/org/name/data/train-0.parquet") == []


def test_an_object_unsigned_by_an_older_checkpoint_is_no_change():
    # A checkpoint written before objects were signed names them only: not a change;
    # a signed one that differs still is.
    old = {"sources": [{"name": "web", "files": [["a.jsonl"], ["b.jsonl", 9, "ETag:1"]]}]}
    new = {
        "sources": [{"name": "web", "files": [["a.jsonl", 9, "ETag:2"], ["b.jsonl", 9, "ETag:3"]]}]
    }
    assert fingerprint_diff(old, new) == ["source 'web' file b.jsonl changed"]


def test_an_object_is_read_through_a_bounded_byte_cache(bucket):
    """What reading an object fetches and keeps per open file: JSON lines (sequential
    reads of READ_BYTES) one readahead block of REMOTE_BLOCK_BYTES past the read, so a
    1 MiB read of a 12 MiB object fetches 5 MiB, not s3fs's default 1 + 50; parquet
    (``ranged``) exactly the bytes asked. Negative control: the file system's own default
    fetches the whole object for the same read."""
    import fsspec

    from torchtitan.data.streaming import READ_BYTES, REMOTE_BLOCK_BYTES, _open_binary

    url = f"s3://{bucket}/big.jsonl"
    _put(url, b"x" * (12 << 20))
    with _open_binary(url) as f:
        assert len(f.read(READ_BYTES)) == READ_BYTES
        assert f.cache.total_requested_bytes == READ_BYTES + REMOTE_BLOCK_BYTES
        f.read(REMOTE_BLOCK_BYTES - READ_BYTES)  # within the block: no request
        assert f.cache.total_requested_bytes == READ_BYTES + REMOTE_BLOCK_BYTES
    with _open_binary(url, ranged=True) as f:
        f.seek(3 << 20)
        assert len(f.read(1000)) == 1000 and f.cache.name == "none"  # one ranged GET a read
    fs, inner = fsspec.core.url_to_fs(url)
    with fs.open(inner, "rb") as f:
        f.read(READ_BYTES)
        assert f.cache.total_requested_bytes == 12 << 20


def test_a_dataset_path_in_a_bucket_lists_its_data_files(bucket):
    """``training.dataset_path`` as a URL: a prefix lists its data files (recursively, as
    URLs, sorted), not an empty one nor a stray ``.json`` beside them, and names them
    relative to the prefix; a glob and an object work too; a prefix without data is one
    line naming it."""
    from torchtitan.data.sources import DataError, resolve_source

    for name, data in (
        ("b/1.jsonl", b'{"text": "x"}\n'),
        ("a.jsonl", b'{"text": "y"}\n'),
        ("stats.json", b"{}"),
        ("empty.jsonl", b""),
        ("README.md", b"# x"),
    ):
        _put(f"s3://{bucket}/web/{name}", data)
    spec = resolve_source(path=f"s3://{bucket}/web")
    assert spec.files == [f"s3://{bucket}/web/a.jsonl", f"s3://{bucket}/web/b/1.jsonl"]
    assert [spec.relative_name(f) for f in spec.files] == ["a.jsonl", "b/1.jsonl"]
    assert spec.name == "web"
    assert resolve_source(path=f"s3://{bucket}/web/b/*.jsonl").files == spec.files[1:]
    assert resolve_source(path=f"s3://{bucket}/web/a.jsonl").files == spec.files[:1]
    with pytest.raises(DataError, match=f"dataset path 's3://{bucket}/none' matches no data"):
        resolve_source(path=f"s3://{bucket}/none")
