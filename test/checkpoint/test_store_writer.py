"""The store writer (store_writer.py): its planning (objects, parts, the concurrency and
memory bound) as pure functions, and its saves on the local S3 server of harness/s3.py,
read back by DCP's own readers. DCP runs for real (no_dist: one process); the botocore
client is wrapped only to record when each request began and ended.

Negative controls: a packing that breaks the bound, a log with a part ending after its
completion, an unbounded budget that exceeds the bound, a zeroed state that is not equal.
"""

from __future__ import annotations

import base64
import random
import threading
import time
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import served_bucket
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from torchtitan.checkpoint import store_reader, store_writer
from torchtitan.checkpoint.store import store_for
from torchtitan.checkpoint.store_writer import Uploader, plan_objects


# ---- planning: pure ----------------------------------------------------------------------
def packed_within(objects: list, size: dict, bound: int) -> bool:
    """Each object within ``bound`` unless it is one item, and none could have taken the
    next object's first item (greedy: an object closes only when the next item overflows)."""
    for k, obj in enumerate(objects):
        filled = sum(size[i] for i in obj)
        if filled > bound and len(obj) > 1:
            return False
        if k + 1 < len(objects) and filled + size[objects[k + 1][0]] <= bound:
            return False
    return True


def test_objects_hold_every_item_once_in_order_within_the_bound():
    """Exact cases at the boundary (an object filled to exactly the bound stays one
    object; an item above the bound is alone), then 200 random plans. Negative controls:
    packings that break the bound or close an object early are refused by the check."""
    sizes = dict(zip("abcdefg", [4, 4, 4, 9, 1, 1, 8], strict=True))
    objects = plan_objects(list(sizes), list(sizes.values()), 8)
    assert objects == [["a", "b"], ["c"], ["d"], ["e", "f"], ["g"]]
    assert packed_within(objects, sizes, 8)
    assert not packed_within([["a", "b", "c"], ["d"], ["e", "f"], ["g"]], sizes, 8)
    assert not packed_within([["a"], ["b"], ["c"], ["d"], ["e", "f"], ["g"]], sizes, 8)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 40)
        size = {i: rng.choice([0, 1, rng.randint(1, 100), rng.randint(100, 300)]) for i in range(n)}
        objects = plan_objects(list(size), list(size.values()), 100)
        assert [i for obj in objects for i in obj] == list(size), "every item once, in order"
        assert packed_within(objects, size, 100), objects


def test_requests_stay_within_the_concurrency_and_memory_bound():
    """64 requests of 3-10 units through an Uploader of 4 requests and a budget of 20:
    never more than 4 running, never more than 20 units held; every request runs once.
    Negative control: the same requests with a budget of 1,000 hold more than 20."""

    def run(budget: int) -> tuple[int, int, list]:
        uploader = Uploader(None, "b", "p", in_flight=4, budget=budget)
        running, most, done = [0], [0], []
        lock = threading.Lock()

        def request(i):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.002)
            with lock:
                running[0] -= 1
                done.append(i)

        sizes = [3 + i % 8 for i in range(64)]
        futures = [uploader.submit(n, request, i) for i, n in enumerate(sizes)]
        for f in futures:
            f.result()
        uploader.close()
        assert uploader.held == 0 and uploader.sent == sum(sizes)
        return most[0], uploader.peak, sorted(done)

    most, peak, done = run(20)
    assert most <= 4 and peak <= 20 and done == list(range(64)), (most, peak)
    _, unbounded, _ = run(1000)
    assert unbounded > 20, "negative control: without the budget more is held"


def test_an_item_larger_than_the_budget_goes_alone():
    """A request larger than the whole budget is admitted when nothing else is held (its
    bytes are needed whole) rather than waiting forever."""
    uploader = Uploader(None, "b", "p", in_flight=2, budget=10)
    assert uploader.submit(50, lambda: "sent").result(timeout=5) == "sent"
    uploader.close()


# ---- saves on the local server -------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with served_bucket() as served:
        yield served


MIB = 1 << 20
PART = 5 * MIB  # S3's (and moto's) smallest part but the last


def state() -> dict:
    """A 12 MiB tensor (a multipart upload of 3 parts at the test's sizes), 24 small ones
    of 256 KiB (objects of 1 MiB), and a bytes entry."""
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 * MIB, generator=g),
        "small": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(24)},
        "half": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "extra": {"note": "bytes entry", "n": 3},
    }


def blank(s: dict) -> dict:
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v)
            if isinstance(v, torch.Tensor) else None for k, v in s.items()}  # fmt: skip


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        equal(a[k], b[k]) if isinstance(a[k], dict)
        else torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        for k in a
    )  # fmt: skip


class Recorded:
    """A botocore client whose writes are recorded: (method, key, part, began, ended)."""

    def __init__(self, client, delay: float):
        self.client, self.delay, self.events = client, delay, []
        self.parts_stored: list[bool] = []  # each part's CRC32 stored as its body's
        self.lock = threading.Lock()

    def __getattr__(self, method):
        call = getattr(self.client, method)

        def recorded(**args):
            began = time.perf_counter()
            if method in ("put_object", "upload_part"):
                time.sleep(self.delay * random.random())  # completions out of order
            reply = call(**args)
            with self.lock:
                self.events.append((method, args.get("Key"), args.get("PartNumber"), began,
                                    time.perf_counter()))  # fmt: skip
                if method == "upload_part":  # the CRC32 the server stored for the part
                    crc = zlib.crc32(args["Body"]).to_bytes(4, "big")
                    self.parts_stored.append(reply.get("ChecksumCRC32") == b64(crc))
            return reply

        return recorded


def ordering_problems(events: list, returned: float) -> list[str]:
    """What breaks "every object complete before the write returns (and DCP's .metadata
    begun after), every part before its upload's completion, parts numbered 1..n"."""
    problems = []
    writes = ("put_object", "upload_part", "complete_multipart_upload")
    for method, key, part, began, ended in events:
        if key.endswith("/.metadata"):
            if began < returned:
                problems.append(".metadata begun before the data's write returned")
        elif method in writes and ended > returned:
            problems.append(f"{method} {key} {part} ended after the write returned")
    for method, key, _, began, _ in events:
        if method == "complete_multipart_upload":
            parts = [(p, e) for m, k, p, _, e in events if m == "upload_part" and k == key]
            if any(e > began for _, e in parts):
                problems.append(f"{key} completed before its last part ended")
            if sorted(p for p, _ in parts) != list(range(1, len(parts) + 1)):
                problems.append(f"{key} parts {sorted(p for p, _ in parts)}")
    return problems


def save(url: str, client: Recorded, monkeypatch, single_max: int = MIB + PART
         ) -> tuple[store_writer.StoreWriter, float]:  # fmt: skip
    monkeypatch.setattr(store_reader, "_s3_client", lambda: client)
    writer = store_writer.StoreWriter(url, object_max=MIB, part=PART, in_flight=4,
                                      single_max=single_max)  # fmt: skip
    original = writer.write_data
    returned = []

    def write_data(plan, planner):
        result = original(plan, planner)
        returned.append(time.perf_counter())
        return result

    writer.write_data = write_data
    dcp.save(state(), checkpoint_id=url, storage_writer=writer, no_dist=True)
    return writer, returned[0]


def test_a_save_in_objects_and_parts_loads_back_exactly(server, monkeypatch):
    """The state saved as 1 MiB objects (the big tensor as a 3-part multipart upload,
    parts sent 4 at once, finishing out of order) loads back torch.equal through the
    store reader and through DCP's own fsspec reader; every object was stored before the
    write returned, every part before its completion, parts numbered 1..3; the server
    saw the planned requests. Negative controls: the zeroed state is not equal, and a
    log with a part ending after the completion is flagged."""
    bucket, traffic = server
    url = f"s3://{bucket}/objects"
    client = Recorded(store_reader._s3_client(), delay=0.05)
    traffic.reset()
    crc_on = []  # torch.save's zip CRC32 switch, as each entry is serialized
    write_item = store_writer._write_item

    def recorded(*args, **kwargs):
        crc_on.append(torch.utils.serialization.config.save.compute_crc32)
        return write_item(*args, **kwargs)

    monkeypatch.setattr(store_writer, "_write_item", recorded)
    writer, returned = save(url, client, monkeypatch)
    assert crc_on and not any(crc_on), "serialized without the CRC32 no reader checks"
    names = sorted(store_for(url).listdir(url))
    objects = writer.stats["objects"]
    assert names == sorted([".metadata", *(f"__0_{i}.distcp" for i in range(objects))])
    assert objects == 1 + 1 + 24 // 4, names  # the bytes entry and half, big, 4 w's each
    parts = [e for e in client.events if e[0] == "upload_part"]
    assert len(parts) == 3 and traffic.requests.get("POST") == 2  # create, complete
    assert client.parts_stored == [True] * 3, "each part stored with its body's CRC32"
    assert traffic.requests.get("PUT") == objects - 1 + 3 + 1  # PUTs, parts, .metadata
    assert ordering_problems(client.events, returned) == []
    m, k, p, b, e = parts[0]
    swapped = [*client.events, (m, k, p, b, returned + 1)]
    assert ordering_problems(swapped, returned), "negative control: a late part is flagged"
    assert writer.stats["peak_held"] <= 4 * MIB + 12 * MIB  # budget, or one entry alone
    assert torch.utils.serialization.config.save.compute_crc32, "and back on after"

    for reader in (store_reader.StoreReader(url), FsspecReader(url)):
        got = blank(state())
        dcp.load(got, checkpoint_id=url, storage_reader=reader, no_dist=True)
        assert equal(got, state())
    assert not equal(blank(state()), state()), "negative control"


def b64(crc: bytes) -> str:
    return base64.b64encode(crc).decode()


def wrong_checksums(url: str) -> list[str]:
    """The objects under ``url`` whose stored CRC32 (what a whole GET is answered with)
    is missing or is not zlib's of their bytes."""
    client = store_reader._s3_client()
    bucket, prefix = url.split("://", 1)[1].split("/", 1)
    wrong = []
    for name in store_for(url).listdir(url):
        reply = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}", ChecksumMode="DISABLED")
        want = b64(zlib.crc32(reply["Body"].read()).to_bytes(4, "big"))
        answer = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}", ChecksumMode="ENABLED")
        answer["Body"].close()  # its headers only: the stored checksum
        if answer.get("ChecksumCRC32") != want:
            wrong.append(name)
    return wrong


def test_an_entry_up_to_the_single_put_bound_is_one_put(server, monkeypatch):
    """With single PUTs up to 16 MiB, the 12 MiB tensor (alone in its object, above the
    1 MiB objects) is one PUT: no multipart upload begun, one request per object, and it
    loads back equal; every object is stored with the CRC32 of its bytes (botocore's,
    which S3 checks and a whole GET is answered with). Negative controls: the bound at
    6 MiB (the test above) makes it a multipart upload; an object stored with a wrong
    CRC32 is caught."""
    bucket, traffic = server
    url = f"s3://{bucket}/single"
    client = Recorded(store_reader._s3_client(), delay=0.0)
    traffic.reset()
    writer, _ = save(url, client, monkeypatch, single_max=16 * MIB)
    assert traffic.requests.get("POST") is None, "no multipart upload"
    assert traffic.requests.get("PUT") == writer.stats["objects"] + 1  # and .metadata
    assert writer.stats["requests"] == writer.stats["objects"]
    got = blank(state())
    dcp.load(got, checkpoint_id=url, storage_reader=store_reader.StoreReader(url), no_dist=True)
    assert equal(got, state())
    assert wrong_checksums(url) == []

    body = b"an object sent with another body's CRC32"
    store_reader._s3_client().put_object(
        Bucket=bucket, Key="single-wrong/x", Body=body, ChecksumAlgorithm="CRC32",
        ChecksumCRC32=b64((zlib.crc32(body) ^ 1).to_bytes(4, "big")))  # fmt: skip
    assert wrong_checksums(f"s3://{bucket}/single-wrong") == ["x"], "negative control"


@pytest.mark.parametrize("only", ["", "__0_7.distcp"])  # __0_7: the last object (4 w's)
def test_a_failed_save_aborts_its_upload_and_names_the_object(server, monkeypatch, only):
    """Every PUT refused (404 NoSuchBucket, as from a server restarted empty), or only the
    single PUT of the last object (its failure can surface only once the write waits for
    its PUT, after every item is serialized): the save fails with the writer's one line naming the
    bucket, the object and the fix, and no multipart upload is left behind. Negative
    control: the same save with the server answering leaves a complete checkpoint."""
    bucket, traffic = server
    url = f"s3://{bucket}/refused{len(only)}"
    client = Recorded(store_reader._s3_client(), delay=0.0)
    traffic.fail_next, traffic.fail_status, traffic.fail_kinds = 10_000, 404, ("PUT",)
    traffic.fail_within, traffic.fail_suffix = f"/refused{len(only)}/", only
    try:
        with pytest.raises(BaseException) as raised:
            save(url, client, monkeypatch)
    finally:
        traffic.fail_next, traffic.fail_status = 0, 503
        traffic.fail_within, traffic.fail_suffix, traffic.fail_kinds = "", "", ("GET", "GET range")
    text = str(raised.value)
    assert f"bucket {bucket} does not exist (writing {url}/__0_{only[4:]}" in text, text[-2000:]
    assert "create it, or set --checkpoint.folder" in text
    assert torch.utils.serialization.config.save.compute_crc32, "torch's switch restored"
    uploads = client.client.list_multipart_uploads(Bucket=bucket, Prefix=f"refused{len(only)}/")
    assert not uploads.get("Uploads"), "a failed save aborts its multipart upload"
    save(url, client, monkeypatch)
    assert ".metadata" in store_for(url).listdir(url)


class Paged:
    """The real client, its upload listings cut into pages of ``MaxUploads`` as S3 cuts
    them (moto's server ignores ``max-uploads`` and answers everything at once)."""

    def __init__(self, client):
        self.client, self.listings = client, 0

    def __getattr__(self, method):
        return getattr(self.client, method)

    def list_multipart_uploads(self, MaxUploads=1000, KeyMarker="", UploadIdMarker="", **args):
        self.listings += 1
        every = self.client.list_multipart_uploads(**args).get("Uploads", [])
        every.sort(key=lambda u: (u["Key"], u["UploadId"]))
        after = [u for u in every if (u["Key"], u["UploadId"]) > (KeyMarker, UploadIdMarker)]
        page = after[:MaxUploads]
        more = len(after) > MaxUploads
        reply = {"Uploads": page, "IsTruncated": more}
        if more:
            reply.update(NextKeyMarker=page[-1]["Key"], NextUploadIdMarker=page[-1]["UploadId"])
        return reply


def test_a_killed_saves_uploads_are_aborted_with_its_folder(server, monkeypatch):
    """Multipart uploads left by a kill -9 (begun, a part sent, never completed) are
    invisible to listings, and removing the save's folder aborts them; ``abort_uploads``
    pages through the listing (5 uploads, pages of 2) and touches no other folder.
    Negative controls: before the removal the store still lists the uploads; an upload
    under ``step-40/`` is left."""
    bucket, _ = server
    client = store_reader._s3_client()
    keys = [f"killed/step-4/__{rank}_0.distcp" for rank in range(5)]
    for key in [*keys, "killed/step-40/__0_0.distcp"]:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 8)
    store = store_for(f"s3://{bucket}/killed")
    assert store.listdir(f"s3://{bucket}/killed/step-4") == []
    listed = client.list_multipart_uploads(Bucket=bucket, Prefix="killed/step-4/")
    assert sorted(u["Key"] for u in listed.get("Uploads", [])) == keys, "negative control"
    paged = Paged(client)
    monkeypatch.setattr(store_reader, "_s3_client", lambda: paged)
    assert store_writer.abort_uploads(f"s3://{bucket}/killed/step-4", page_size=2) == 5
    assert paged.listings == 3, "pages of 2, 2 and 1"
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="killed/step-4/").get("Uploads")
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads", [])
    assert [u["Key"] for u in left] == ["killed/step-40/__0_0.distcp"], "negative control"
    store.rmtree(f"s3://{bucket}/killed/step-40")
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads")


class Raced:
    """A client whose every listing is answered after another rank aborted the first
    upload listed (two ranks removing one failed save's folder at once)."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    def list_multipart_uploads(self, **kw):
        reply = self.client.list_multipart_uploads(**kw)
        first = (reply.get("Uploads") or [None])[0]
        if first is not None:
            self.client.abort_multipart_upload(
                Bucket=kw["Bucket"], Key=first["Key"], UploadId=first["UploadId"]
            )
        return reply


def test_uploads_another_rank_aborted_first_are_passed_over(server, monkeypatch):
    """After a failed save every rank removes its folder: an upload another rank aborted
    between this rank's listing and its abort answers NoSuchUpload, and the rest are
    still aborted. Negative control: that answer is an error of its own (the old loop
    stopped at it, leaving the other uploads)."""
    bucket, _ = server
    client = store_reader._s3_client()
    keys = [f"raced/step-6/__{rank}_0.distcp" for rank in range(3)]
    for key in keys:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    monkeypatch.setattr(store_reader, "_s3_client", lambda: Raced(client))
    assert store_writer.abort_uploads(f"s3://{bucket}/raced/step-6") == 2
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="raced/").get("Uploads")
    upload = client.create_multipart_upload(Bucket=bucket, Key=keys[0])["UploadId"]
    client.abort_multipart_upload(Bucket=bucket, Key=keys[0], UploadId=upload)
    with pytest.raises(Exception, match="NoSuchUpload"):
        client.abort_multipart_upload(Bucket=bucket, Key=keys[0], UploadId=upload)


def test_small_entries_are_written_together_and_read_in_one_get(server, tmp_path):
    """Small tensors (the AdamW ``step`` of every parameter) between large ones: the store
    writer puts the bytes entry and every tensor under ``SMALL`` at the head of the first
    object, in plan order, so a load of the small ones alone (what a rank loads from
    another's files: the replicated entries DCP saved once) is one ranged GET of the bytes
    it needs. Negative control: DCP's local writer, in plan order, leaves them between the
    large ones: one GET each."""
    from torchtitan.checkpoint.store import upload_folder

    bucket, _ = server
    g = torch.Generator().manual_seed(4)
    layers = {f"l{i}": {"weight": torch.randn(512, 512, generator=g),
                        "step": torch.tensor(float(i))} for i in range(6)}  # fmt: skip
    saved = {"layers": layers, "extra": {"n": 1}}
    url = f"s3://{bucket}/small-first"
    dcp.save(saved, storage_writer=store_writer.StoreWriter(url), no_dist=True)
    local = tmp_path / "local"
    dcp.save(saved, checkpoint_id=str(local), no_dist=True)
    upload_folder(str(local), f"{url}-local", last=".metadata")

    for where, small_requests in ((url, 1), (f"{url}-local", 6)):
        metadata = store_reader.StoreReader(where).read_metadata()
        places = {i.fqn: info for i, info in metadata.storage_data.items()}
        steps = [places[f"layers.l{i}.step"] for i in range(6)]
        weights = [places[f"layers.l{i}.weight"] for i in range(6)]
        if where == url:
            assert max(s.offset for s in steps) < min(w.offset for w in weights)
            assert [s.offset for s in steps] == sorted(s.offset for s in steps), "plan order"
        reader = store_reader.StoreReader(where)
        into = {"layers": {f"l{i}": {"step": torch.tensor(-1.0)} for i in range(6)}}
        dcp.load(into, checkpoint_id=where, storage_reader=reader, no_dist=True)
        assert all(into["layers"][f"l{i}"]["step"].item() == i for i in range(6))
        stats = reader.stats
        assert stats["requests"] == small_requests, (where, stats)
        assert stats["fetched"] == stats["needed"], (where, stats)
