"""The store reader (store_reader.py) on the local S3 server of harness/s3.py, whose WSGI
layer counts the bytes it sent and injects faults: what a load fetched is counted by the
server, not by the reader. DCP runs for real (no_dist: one process).

Each property has a negative control: DCP's fsspec reader (read-ahead) fetches more than
the plan needs; without coalescing the same load makes one request per entry; a replaced
object stops the load; a fault that persists is one line.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import served_bucket
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint import integrity, store_reader
from torchtitan.checkpoint.folder import MANIFEST, write_json
from torchtitan.checkpoint.store import store_for, upload_folder


@pytest.fixture(scope="module")
def server():
    with served_bucket() as served:
        yield served


def state() -> dict:
    """Tensors of several sizes and dtypes, and a bytes entry."""
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(512, 1024, generator=g),  # 2 MiB
        "small": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(12)},
        "ints": torch.randint(0, 1 << 30, (4096,), generator=g),
        "half": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "extra": {"note": "bytes entry", "n": 3},
    }


def blank(s: dict) -> dict:
    """The same structure, zeroed: what a load fills."""
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v)
            if isinstance(v, torch.Tensor) else None for k, v in s.items()}  # fmt: skip


def assert_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture(scope="module")
def saved(server, tmp_path_factory) -> tuple[str, str]:
    """One checkpoint written by DCP to a local folder, and its copy in the bucket."""
    bucket, _ = server
    local = str(tmp_path_factory.mktemp("saved"))
    dcp.save(state(), checkpoint_id=local, no_dist=True)
    url = f"s3://{bucket}/saved"
    upload_folder(local, url, last=".metadata")
    return local, url


def etags_of(url: str) -> dict:
    store = store_for(url)
    return {n: store.signature(f"{url}/{n}")["etag"] for n in store.listdir(url)}


def load(reader, into: dict, url: str) -> dict:
    dcp.load(into, checkpoint_id=url, storage_reader=reader, no_dist=True)
    return into


def test_a_load_from_the_bucket_equals_a_local_load_and_fetches_each_byte_once(saved, server):
    """Every tensor equal to a local load's (torch.equal); the bytes the server sent equal
    what the plan needs plus the coalesced gaps (here none: DCP writes one rank's entries
    back to back), in one ranged GET for the whole file. Negative controls: DCP's fsspec
    reader (read-ahead) makes the server send more than that; without coalescing the same
    load takes one GET per entry."""
    local, url = saved
    _, traffic = server
    expected = load(dcp.FileSystemReader(local), blank(state()), local)
    assert_equal(expected, state())

    traffic.reset()
    reader = store_reader.StoreReader(url, etags_of(url))
    reader.read_metadata()  # as the manager does before DCP's load, which reads it too
    assert_equal(load(reader, blank(state()), url), expected)
    data_file = os.path.getsize(os.path.join(local, "__0_0.distcp"))
    stats = reader.stats
    assert stats["needed"] == stats["fetched"] == traffic.by_name["__0_0.distcp"], stats
    metadata = os.path.getsize(os.path.join(local, ".metadata"))
    assert traffic.by_name[".metadata"] == metadata, "the metadata fetched once"
    assert stats["needed"] <= data_file and stats["requests"] == 1

    traffic.reset()
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    assert_equal(load(FsspecReader(url), blank(state()), url), expected)
    assert traffic.by_name["__0_0.distcp"] > stats["needed"], "read-ahead: more than needed"

    items = 12 + 4  # the entries that are tensors
    spans = store_reader.plan_requests(
        {i: (f, o, n) for i, (f, o, n) in enumerate(ranges_of(reader))}, gap=-1
    )
    assert len(spans) >= items > stats["requests"], "without coalescing: a GET per entry"


def ranges_of(reader) -> list:
    return [(s.relative_path, s.offset, s.length) for s in reader.storage_data.values()]


def test_a_partial_load_fetches_its_entries_and_the_gaps_only(saved, server):
    """A plan naming 11 of the 12 small entries (written back to back; not w10) fetches
    their bytes and the one entry between them (a gap within a tenth of the span's bytes),
    counted by the server, in fewer GETs than entries. Negative control: with no gap
    allowed it fetches exactly the needed bytes, one GET per entry."""
    _, url = saved
    _, traffic = server
    names = [f"w{i}" for i in range(12) if i != 10]
    for gap in (store_reader.GAP, -1):
        old, store_reader.GAP = store_reader.GAP, gap
        try:
            traffic.reset()
            reader = store_reader.StoreReader(url, etags_of(url))
            got = load(reader, {"small": {n: torch.zeros(64, 33) for n in names}}, url)
        finally:
            store_reader.GAP = old
        assert all(torch.equal(got["small"][n], state()["small"][n]) for n in names)
        stats = reader.stats
        assert stats["fetched"] == traffic.by_name["__0_0.distcp"]
        if gap < 0:
            assert stats["fetched"] == stats["needed"] and stats["requests"] == len(names)
        else:
            assert stats["needed"] < stats["fetched"] <= stats["needed"] * 1.1, stats
            assert stats["requests"] < len(names)


def test_a_replaced_object_stops_the_load_with_one_line(saved, server):
    """A data file rewritten after its ETag was taken (same size, other bytes): the GET's
    If-Match fails and the load stops with one line naming the file. Negative control:
    the same reader without ETags loads (the bytes of the other write)."""
    local, _ = saved
    bucket, _ = server
    url = f"s3://{bucket}/replaced"
    upload_folder(local, url, last=".metadata")
    etags = etags_of(url)
    fs = store_for(url).fs
    data = bytearray(fs.cat_file(f"{url}/__0_0.distcp"))
    data[-1] ^= 0xFF  # the last byte: DCP's own bytes, not a tensor's
    fs.pipe_file(f"{url}/__0_0.distcp", bytes(data))
    with pytest.raises(CheckpointException) as caught:
        load(store_reader.StoreReader(url, etags), blank(state()), url)
    message = str(caught.value)
    assert "__0_0.distcp was replaced since it was written" in message, message
    load(store_reader.StoreReader(url, {}), blank(state()), url)


@contextlib.contextmanager
def faults(traffic, count: int, status: int):
    """The next ``count`` GETs of a data file fail with ``status`` (0: dropped)."""
    traffic.fail_next, traffic.fail_status, traffic.fail_suffix = count, status, ".distcp"
    try:
        yield
    finally:
        traffic.fail_next, traffic.fail_status, traffic.fail_suffix = 0, 503, ""


@pytest.mark.parametrize("status", [503, 0])
def test_transient_faults_are_retried(saved, server, status):
    """The server throttles (503 SlowDown) or drops the connection of the first 2 GETs of
    the data: the load retries and equals the local one. Negative control: a fault on
    every try ends the load with one line naming the object and the number of tries."""
    _, url = saved
    _, traffic = server
    traffic.reset()
    reader = store_reader.StoreReader(url, etags_of(url))
    with faults(traffic, 2, status):
        got = load(reader, blank(state()), url)
    assert traffic.failed == 2 and reader.stats["retries"] == 2
    assert_equal(got, state())

    traffic.reset()
    old, store_reader.BACKOFF = store_reader.BACKOFF, 0.01
    try:
        with faults(traffic, 1000, status), pytest.raises(CheckpointException) as caught:
            load(store_reader.StoreReader(url, {}), blank(state()), url)
    finally:
        store_reader.BACKOFF = old
    message = str(caught.value)
    assert f"{url}/__0_0.distcp" in message and f"{store_reader.ATTEMPTS} tries" in message
    assert traffic.failed == store_reader.ATTEMPTS


def test_spans_coalesce_small_gaps_sort_by_offset_and_interleave_files():
    """plan_requests: items sorted by offset, joined across gaps <= gap (the smallest
    first) while all the gaps joined stay within a tenth of the bytes needed, never past
    the span size; spans of two files alternate."""
    ranges = {0: ("a", 100, 10), 1: ("a", 0, 50), 2: ("a", 52, 28), 3: ("b", 0, 5),
              4: ("a", 1000, 10), 5: ("b", 10, 500), 6: ("b", 600, 5)}  # fmt: skip
    needed = sum(n for _, _, n in ranges.values())  # 608: at most 60 bytes of gaps

    def plan(gap, span_max):
        spans = store_reader.plan_requests(ranges, gap=gap, span_max=span_max)
        assert sum(s.needed for s in spans) == needed
        assert sum(s.size for s in spans) <= needed * 1.1
        return [(s.file, s.start, s.end, [i for i, _, _ in s.items]) for s in spans]

    # b's 5-byte gap would make a span of 510 > 200: apart
    assert plan(20, 200) == [("a", 0, 110, [1, 2, 0]), ("b", 0, 5, [3]),
                             ("a", 1000, 1010, [4]), ("b", 10, 510, [5]),
                             ("b", 600, 605, [6])]  # fmt: skip
    # gaps of 2, 5 and 20 bytes joined (27); the next, 90, would pass the budget
    assert plan(1000, 2000) == [("a", 0, 110, [1, 2, 0]), ("b", 0, 510, [3, 5]),
                                ("a", 1000, 1010, [4]), ("b", 600, 605, [6])]  # fmt: skip
    assert len(plan(-1, 2000)) == len(ranges), "no gap allowed: a GET per item"


def test_a_load_stops_on_the_first_bad_span_without_hanging(saved, server):
    """A missing data file: one line naming it (no retry: not transient)."""
    local, _ = saved
    bucket, _ = server
    url = f"s3://{bucket}/missing"
    upload_folder(local, url, last=".metadata")
    store_for(url).fs.rm_file(f"{url}/__0_0.distcp")
    with pytest.raises(CheckpointException) as caught:
        load(store_reader.StoreReader(url, {}), blank(state()), url)
    assert "__0_0.distcp is missing" in str(caught.value), str(caught.value)


def test_a_start_verifies_the_files_on_a_store_in_one_listing_per_writer(server):
    """A start's verification on a store lists each writer's files (``__<w>_``) in one
    request and HEADs the rest (DCP's ``.metadata``, rank 0); every file goes to exactly
    one rank at any rank count. A replaced, a truncated and a missing file are each named
    by the rank that lists its writer, and by no other. Negative control: the HEAD of each
    file takes a request per file."""
    bucket, traffic = server
    url = f"s3://{bucket}/listed/step-2"
    store = store_for(url)
    names = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__2_0.distcp", "__10_0.distcp",
             ".metadata"]  # fmt: skip
    for i, name in enumerate(names):
        store.write_bytes(f"{url}/{name}", bytes([i]) * (100 + i))
    files = integrity.digest(url, names)
    write_json(f"{url}/{MANIFEST}", {"files": files})
    for world in (1, 2, 3, 4, 11):
        shares = [integrity.listing_share(sorted(files), r, world) for r in range(world)]
        checked = [n for writers, others in shares for n in [*sum(writers.values(), []), *others]]
        assert sorted(checked) == sorted(files), world

    traffic.reset()
    assert integrity.verify_share(url, 0, 1) is None
    # a listing per writer (4); the manifest (a HEAD and a GET) and .metadata's HEAD
    assert traffic.requests == {"GET": 4, "GET range": 1, "HEAD": 2}, traffic.requests
    traffic.reset()
    assert integrity.verify_files(url, files) is None
    assert traffic.requests == {"HEAD": len(names)}, "negative control: a HEAD each"

    store.write_bytes(f"{url}/__1_0.distcp", bytes([9]) * 102)  # same size, other bytes
    store.write_bytes(f"{url}/__0_1.distcp", bytes(50))
    store.remove(f"{url}/__2_0.distcp")
    assert "__1_0.distcp was replaced" in integrity.verify_share(url, 1, 2)
    assert "__0_1.distcp has 50 bytes" in integrity.verify_share(url, 0, 2)
    assert "__2_0.distcp is missing" in integrity.verify_share(url, 2, 3)
    assert integrity.verify_share(url, 10, 11) is None, "writer 10's files are intact"


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(300, 7),
        torch.arange(10, dtype=torch.int64),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.randn(6, 7)[:, 2:5],  # a view: torch.save writes its whole storage
        torch.randn(4, 5).t(),
        torch.empty(0, 3),
        torch.ones(5, dtype=torch.bool),
    ],
    ids=["float", "int64", "bf16-scalar", "view", "transposed", "empty", "bool"],
)
def test_a_saved_tensor_is_read_in_place_and_equals_torch_load(tensor, monkeypatch):
    """An entry's tensor is torch.load's (values, dtype, shape, strides), its storage the
    fetched bytes themselves: no copy before the one into the model, and no torch.load
    (its Python unpickler was most of a resume's loading thread). Negative control:
    torch.load's tensor lies outside those bytes."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    data = buffer.getvalue()
    view = memoryview(data)
    load = torch.load
    with monkeypatch.context() as patched:
        patched.setattr(torch, "load", lambda *a, **k: pytest.fail("read by torch.load"))
        got = store_reader.saved_tensor(view)
    expected = load(io.BytesIO(data), weights_only=True)
    assert torch.equal(got, expected) and got.dtype == expected.dtype
    assert got.shape == expected.shape and got.stride() == expected.stride()
    begin = np.frombuffer(data, np.uint8).ctypes.data

    def inside(t: torch.Tensor) -> bool:
        at = t.untyped_storage().data_ptr()
        return begin <= at and at + t.untyped_storage().nbytes() <= begin + len(data)

    if tensor.numel():
        assert inside(got), "the tensor's bytes are the fetched ones, not a copy"
        assert not inside(expected), "negative control: torch.load copies them"


@pytest.mark.parametrize(
    "saved",
    [
        torch.nn.Parameter(torch.randn(3, 4)),  # another global: torch.load builds it
        torch.randn(3, dtype=torch.complex64).conj(),  # a conjugate bit (metadata)
        {"a": torch.ones(2)},  # not a tensor
    ],
    ids=["parameter", "conjugate", "dict"],
)
def test_a_record_of_another_shape_is_read_by_torch_load(saved):
    """What a plain tensor's pickle does not name is refused by the in-place reading and
    read by torch.load (weights only), equal to it. A record cut short is torch.load's
    error, never a tensor over the wrong bytes."""
    import io

    buffer = io.BytesIO()
    torch.save(saved, buffer)
    got = store_reader.saved_tensor(memoryview(buffer.getvalue()))
    expected = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    if isinstance(saved, dict):
        assert got.keys() == expected.keys() and torch.equal(got["a"], expected["a"])
    else:
        assert torch.equal(got, expected) and type(got) is type(expected)
        assert got.is_conj() == expected.is_conj()
    with pytest.raises(Exception, match="(?i)zip|archive|record|file"):
        store_reader.saved_tensor(memoryview(buffer.getvalue())[:-100])


def test_a_record_naming_more_values_than_it_stores_is_refused():
    """A record whose pickle names a tensor of 3 values over a storage of none (damaged,
    or made so): an error, as torch.load's, never a tensor over memory the record does not
    hold. Control: the same record naming 0 values reads as an empty tensor."""
    import collections
    import io
    import pickle
    import zipfile

    storage = object()

    def record(values: int) -> memoryview:
        class Tensor:
            def __reduce__(self):
                return (torch._utils._rebuild_tensor_v2,
                        (storage, 0, (values,), (1,), False, collections.OrderedDict()))  # fmt: skip

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                return ("storage", torch.FloatStorage, "0", "cpu", 0) if obj is storage else None

        pickled = io.BytesIO()
        Pickler(pickled, protocol=2).dump(Tensor())
        saved = io.BytesIO()
        torch.save(torch.empty(0), saved)
        source, out = zipfile.ZipFile(saved), io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as crafted:
            for info in source.infolist():
                data = source.read(info.filename)
                crafted.writestr(
                    info.filename,
                    pickled.getvalue() if info.filename.endswith("/data.pkl") else data,
                )
        return memoryview(out.getvalue())

    assert store_reader.saved_tensor(record(0)).shape == (0,), "control"
    with pytest.raises(RuntimeError):  # torch.load's, once the in-place reading refuses it
        store_reader.saved_tensor(record(3))


def test_a_record_of_the_other_byte_order_is_read_by_torch_load():
    """A record written on a host of the other byte order: torch swaps its bytes in place
    on load, which a buffer read from the store must not undergo, so it goes to torch.load
    (the values right, twice: a second read of the same bytes is not swapped back).
    Catches the in-place path taken for it."""
    import io
    import sys
    import zipfile

    import numpy as np

    tensor = torch.arange(6, dtype=torch.float32) + 0.5
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    source, other = zipfile.ZipFile(buffer), {"little": "big", "big": "little"}[sys.byteorder]
    swapped = io.BytesIO()
    with zipfile.ZipFile(swapped, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename.endswith("/byteorder"):
                data = other.encode()
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                data = np.frombuffer(data, "=f4").byteswap().tobytes()
            out.writestr(info.filename, data)
    view = memoryview(swapped.getvalue())
    for _ in range(2):
        assert torch.equal(store_reader.saved_tensor(view), tensor)


@pytest.fixture(params=["socket", "botocore"])
def way(request, monkeypatch) -> str:
    """How a body is received: straight from the socket (``receive``'s way), or through
    botocore's ``readinto`` (where the response is not what it expects)."""
    if request.param == "botocore":
        monkeypatch.setattr(store_reader, "socket_stream", lambda body: None)
    return request.param


def test_spans_are_received_into_reused_buffers(saved, server, way, monkeypatch):
    """Small spans (a span size of 64 KiB: the 2 MiB entry one span, the others several)
    and room for 2 buffers: each span's body is received into a buffer a span before it
    used, and the load equals the local one. The way straight from the socket is the one
    taken on this server (``stats["direct"]``); the control goes through botocore's."""
    _, url = saved
    monkeypatch.setattr(store_reader, "span_size", lambda needed: 64 << 10)
    monkeypatch.setattr(store_reader.SpanFetcher, "__init__", _small_budget(2 * (64 << 10)))
    reader = store_reader.StoreReader(url, etags_of(url))
    assert_equal(load(reader, blank(state()), url), state())
    stats = reader.stats
    assert stats["requests"] >= 4 and stats["buffers"] < stats["requests"], stats
    assert stats["direct"] == (stats["requests"] if way == "socket" else 0), stats


def _small_budget(budget: int):
    init = store_reader.SpanFetcher.__init__

    def small(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.budget = budget

    return small


@pytest.mark.parametrize("damage", ["checksum", "cut"])
def test_a_body_damaged_on_the_way_is_fetched_again(saved, server, way, damage):
    """The server answers the first 2 GETs of the data with a CRC32 header the body does
    not have, or with half the body and the connection shut: the reader tries again and
    the load equals the local one (both ways of receiving). Negative control: damaged on
    every try, the load ends with one line naming the object and the tries."""
    _, url = saved
    _, traffic = server
    traffic.reset()
    traffic.damage, traffic.fail_suffix = damage, ".distcp"
    try:
        traffic.damage_next = 2
        reader = store_reader.StoreReader(url, etags_of(url))
        assert_equal(load(reader, blank(state()), url), state())
        assert traffic.damaged == 2 and reader.stats["retries"] == 2, reader.stats
        traffic.damage_next, traffic.damaged = 1000, 0
        old, store_reader.BACKOFF = store_reader.BACKOFF, 0.01
        try:
            with pytest.raises(CheckpointException) as caught:
                load(store_reader.StoreReader(url, {}), blank(state()), url)
        finally:
            store_reader.BACKOFF = old
    finally:
        traffic.damage_next, traffic.damage, traffic.fail_suffix = 0, "checksum", ""
    message = str(caught.value)
    assert f"{url}/__0_0.distcp" in message and f"{store_reader.ATTEMPTS} tries" in message
    assert ("checksum" in message.lower() or "crc32" in message.lower()) == (damage == "checksum")
    assert traffic.damaged == store_reader.ATTEMPTS


def test_a_large_items_buffer_is_dropped_after_it_and_unit_buffers_are_reused():
    """Buffers: a span's unit buffer goes back to the pool and serves the next span; a
    buffer made for an item larger than a unit is dropped once given back, never handed
    to a later span (it would count its whole size against the budget, holding fewer
    GETs in flight). Negative control: the unit buffer is the one reused."""
    buffers = store_reader.Buffers(unit=1024)
    unit = buffers.take(100)
    buffers.give(unit)
    assert buffers.take(700) is unit and buffers.made == 1
    large = buffers.take(5000)
    assert len(large) == 5000 and buffers.made == 2
    buffers.give(large)
    buffers.give(unit)
    assert buffers.take(10) is unit
    assert len(buffers.take(10)) == 1024 and buffers.made == 3, "a new unit, not the large one"


@pytest.mark.parametrize("prefix", ["values-after", "some-in", "all-in"])
def test_entries_are_received_straight_into_their_tensors(saved, server, prefix, monkeypatch):
    """An entry that is a whole saved tensor of the target's dtype and shape (here the
    2 MiB one) is received from the socket into the tensor the load names: its bytes in
    ``in_place``, the tensor the same object at the same address, the load equal to the
    local one. The record's first bytes (``PREFIX``) are read before the values: they end
    before the values, hold a part of them, or the whole record. Negative control: with no
    entry large enough, nothing is received in place and the load is still equal."""
    import io

    _, url = saved
    record = io.BytesIO()
    torch.save(state()["big"], record)
    first = store_reader.torch_record.values_at(record.getbuffer()).begin
    size = {"values-after": first - 1, "some-in": 4096, "all-in": 1 << 30}[prefix]
    monkeypatch.setattr(store_reader.torch_record, "PREFIX", size)
    into = blank(state())
    big, address = into["big"], into["big"].data_ptr()
    reader = store_reader.StoreReader(url, etags_of(url))
    assert_equal(load(reader, into, url), state())
    assert into["big"] is big and big.data_ptr() == address
    assert reader.stats["in_place"] == big.nbytes and reader.stats["again"] == 0, reader.stats

    monkeypatch.setattr(store_reader, "IN_PLACE_MIN", 1 << 40)
    reader = store_reader.StoreReader(url, etags_of(url))
    assert_equal(load(reader, blank(state()), url), state())
    assert reader.stats["in_place"] == 0, "control: no entry in place"


def _with_decoy(record: bytes) -> bytes:
    """``record`` (torch.save's zip) rewritten with an entry before the values whose
    contents look like the values' local header: a record whose first bytes lie about
    where its values are (its directory, at its end, tells the truth)."""
    import io
    import zipfile

    source, out = zipfile.ZipFile(io.BytesIO(record)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as crafted:
        for info in source.infolist():
            if "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                name = info.filename.encode()
                header = b"PK\x03\x04" + bytes(22) + len(name).to_bytes(2, "little") + bytes(2)
                decoy = header + name + bytes(range(256)) * 4
                crafted.writestr(info.filename.rsplit("/data/", 1)[0] + "/decoy", decoy)
            crafted.writestr(info.filename, source.read(info.filename))
    return out.getvalue()


def test_a_record_whose_first_bytes_mislead_is_confirmed_and_read_again(server, tmp_path):
    """A record whose first bytes name a wrong place for its values (a decoy local header
    before them): the values received there are not trusted. Its directory, read once the
    record has arrived, disagrees, so the entry is fetched again whole and read as torch
    would (``again``), and the load equals the saved tensor. Catches a reader that trusts
    the first bytes (the load would hold the decoy's bytes)."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    bucket, _ = server
    tensor = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    local = tmp_path / "decoy"
    dcp.save({"t": tensor, "u": tensor + 1}, checkpoint_id=str(local), no_dist=True)
    metadata = dcp.FileSystemReader(str(local)).read_metadata()
    (name,) = {info.relative_path for info in metadata.storage_data.values()}
    data, out = (local / name).read_bytes(), bytearray()
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
        record = data[info.offset : info.offset + info.length]
        if index.fqn == "t":
            record = _with_decoy(record)
            assert store_reader.torch_record.values_at(memoryview(record)) is not None
        metadata.storage_data[index] = _StorageInfo(name, len(out), len(record))
        out += record
    (local / name).write_bytes(bytes(out))
    with open(local / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    url = f"s3://{bucket}/decoy"
    upload_folder(str(local), url, last=".metadata")

    reader = store_reader.StoreReader(url, etags_of(url))
    into = {"t": torch.zeros(256, 256), "u": torch.zeros(256, 256)}
    load(reader, into, url)
    assert torch.equal(into["t"], tensor) and torch.equal(into["u"], tensor + 1)
    assert reader.stats["again"] == 1 and reader.stats["in_place"] == tensor.nbytes, reader.stats


def test_where_the_values_lie_is_read_from_a_records_first_bytes():
    """``values_at``: the values' bytes of torch.save's record of a contiguous tensor and
    of a view (its whole storage saved, the view a run inside it); none for a transposed
    view (not one run), a record of the other byte order, or first bytes that stop
    before the values' header. ``confirms``: the record with its values blanked (never
    read) agrees; with the place moved by one byte, or the values' bytes claimed as
    missing where the pickle lies, it does not."""
    import io

    def record_of(t):
        buffer = io.BytesIO()
        torch.save(t, buffer)
        return memoryview(buffer.getvalue())

    from torchtitan.checkpoint import torch_record

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for tensor in (base, base[1:3]):
        record = record_of(tensor)
        layout = torch_record.values_at(record[:4096])
        first, last = layout.values()
        values = torch.frombuffer(bytearray(record[first:last]), dtype=torch.float32)
        assert torch.equal(values.reshape(tensor.shape), tensor)
        blanked = bytearray(record)
        blanked[first:last] = bytes(last - first)
        assert torch_record.confirms(memoryview(blanked), layout, (first, last))
        moved = torch_record.Layout(layout.located, layout.begin + 1, layout.end + 1)
        assert not torch_record.confirms(memoryview(blanked), moved, (first, last))
        assert not torch_record.confirms(memoryview(blanked), layout, (0, 100))
        assert torch_record.values_at(record[:200]) is None, "stops before the header"
    assert torch_record.values_at(record_of(base.t())).values() is None
