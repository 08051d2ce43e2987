"""A tensor that ``torch.save`` wrote (one DCP entry), read where its bytes already lie.

Owns ``saved_tensor``: the record's zip directory and its pickle read without building
anything (``_TensorPickle``: only the globals a plain tensor's pickle names are resolved,
to what locates its bytes), then the tensor made over the record's own bytes
(``torch.frombuffer``, with the saved offset, size and strides). A record of any other
shape (a tensor subclass, a conjugate bit, a storage class this does not know, the other
byte order, a compressed entry) is read by ``torch.load``, weights only.

Also owns where a record's values lie before the record has arrived, for a reader that
receives them straight into their tensor (store_reader.py): ``values_at`` reads it from
the record's first bytes (its first entries, the pickle among them, precede the values),
and ``confirms`` checks it against the record's directory, at its end, once the rest has
arrived, reading nothing where the values lie.

Why not ``torch.load``, or torch's own zip reader and weights-only unpickler given the
bytes as their storage (what the store reader did before): the weights-only unpickler
is pure Python. Measured side by side on one record of 768 x 768 float32 (another job
running): 1.5 ms that way, 0.4 ms here (0.12 ms on a quiet machine, against 3.8 ms for
``torch.load``, which also copies). In a profiled 1.6 GB resume of the 125M model the
loading thread's entries took 0.79-1.26 s against 1.28-1.46 s, on cores the fetching
needs (docs/benchmarks.md § 21). Here a record costs its directory and its ~150-byte
pickle through the C unpickler: O(record's directory + pickle), never a copy of the
tensor's bytes.

Never: unpickle anything but the allowlisted names, or write into the record's bytes.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import warnings
import zipfile
from dataclasses import dataclass
from typing import cast

import torch

# The storage classes a plain tensor's pickle names (torch.save of a CPU tensor).
_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
             "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
             "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8,
             "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
             "ComplexFloatStorage": torch.complex64,
             "ComplexDoubleStorage": torch.complex128}  # fmt: skip
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip entry's local header (30 bytes)


@dataclass(frozen=True)
class _Located:
    """Where a saved tensor's values are: its storage (dtype, record key, elements) and
    its view of it."""

    dtype: torch.dtype
    key: str
    numel: int
    offset: int
    size: tuple
    stride: tuple


def _located(storage, storage_offset, size, stride, requires_grad=False, hooks=None,
             metadata=None) -> _Located:  # fmt: skip
    if metadata or hooks:  # a conjugate or negative bit, hooks: torch.load's to build
        raise pickle.UnpicklingError("a tensor with metadata")
    dtype, key, numel = storage
    return _Located(dtype, key, numel, storage_offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """The C unpickler, resolving only what a plain tensor's pickle names, to ``_Located``."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            # a function of this unpickler's own: a BUILD opcode setting its attributes
            # (its defaults) cannot outlive the record
            return lambda *args: _located(*args)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a plain tensor's")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return dtype, str(key), int(numel)


def _span(view: memoryview, info: zipfile.ZipInfo, hole: tuple = (0, 0)) -> tuple[int, int]:
    """Where a stored (uncompressed) zip entry's bytes lie in ``view``: ``[begin, end)``,
    its local header read (never from ``hole``, the bytes ``view`` does not hold)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"{info.filename} is compressed")
    _outside(info.header_offset, info.header_offset + _LOCAL_HEADER.size, hole)
    header = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if header[0] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    begin = info.header_offset + _LOCAL_HEADER.size + header[10] + header[11]
    if begin + info.compress_size > len(view):
        raise zipfile.BadZipFile(f"{info.filename} runs past the record")
    _outside(info.header_offset, begin, hole)
    return begin, begin + info.compress_size


def _entry(view: memoryview, info: zipfile.ZipInfo, hole: tuple = (0, 0)) -> memoryview:
    """The bytes of a stored zip entry, where they lie in ``view``; an entry reaching
    into ``hole`` is refused."""
    begin, end = _span(view, info, hole)
    _outside(begin, end, hole)
    return view[begin:end]


def _outside(begin: int, end: int, hole: tuple):
    if begin < hole[1] and hole[0] < end:
        raise zipfile.BadZipFile(f"bytes {begin}-{end} of the record are where its values are")


def _plain(view: memoryview, hole: tuple = (0, 0)):
    """``(archive, its folder prefix, _Located)`` for a record holding a plain tensor of
    this host's byte order, read from its directory, byte order and pickle (never from
    ``hole``); None for a record of another shape or the other byte order."""
    archive = zipfile.ZipFile(_ViewFile(view, hole))
    first = archive.namelist()[0]
    prefix = first[: first.index("/") + 1]
    if f"{prefix}byteorder" in set(archive.namelist()):
        order = bytes(_entry(view, archive.getinfo(f"{prefix}byteorder"), hole))
        if order != sys.byteorder.encode():
            return None  # torch.load swaps the values: not in a buffer read from the store
    pickled = _entry(view, archive.getinfo(f"{prefix}data.pkl"), hole)
    where = _TensorPickle(io.BytesIO(pickled), encoding="utf-8").load()
    return (archive, prefix, where) if isinstance(where, _Located) else None


def _in_place(view: memoryview) -> torch.Tensor | None:
    """The tensor over ``view``'s own bytes, or None where the record is not a plain
    tensor of this host's byte order."""
    plain = _plain(view)
    if plain is None:
        return None
    archive, prefix, where = plain
    data = _entry(view, archive.getinfo(f"{prefix}data/{where.key}"))
    if not where.numel:  # frombuffer refuses no bytes
        values = torch.empty(0, dtype=where.dtype)
    else:
        with warnings.catch_warnings():  # a bytes object's is read-only: never written here
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(data, dtype=where.dtype)
    # bounds checked: a size or offset past the stored values is a RuntimeError
    return values.as_strided(where.size, where.stride, where.offset)


PREFIX = 4096  # a record's first bytes, read before its values: its first entries are ~700


@dataclass(frozen=True)
class Layout:
    """Where a saved tensor's storage lies in its record: ``[begin, end)``, and its view
    of it (``located``)."""

    located: _Located
    begin: int
    end: int

    def values(self) -> tuple[int, int] | None:
        """The bytes of the record the tensor itself spans (a contiguous view of its
        storage), or None where its values are not one run of bytes."""
        where, size = self.located, self.located.size
        numel, expected, step = 1, [], 1
        for n in reversed(size):
            expected.append(step)
            step *= n
            numel *= n
        if any(n != 1 and s != e for n, s, e in zip(reversed(size), reversed(where.stride),
                                                     expected)):  # fmt: skip
            return None
        item = where.dtype.itemsize
        begin = self.begin + where.offset * item
        end = begin + numel * item
        return (begin, end) if self.begin <= begin <= end <= self.end else None


def values_at(prefix: memoryview) -> Layout | None:
    """Where the values of the tensor ``torch.save`` wrote lie in its record, read from
    the record's first bytes (``prefix``: its local headers and pickle, which torch
    writes before the values), or None where ``prefix`` does not say (a record of
    another shape, the other byte order, values past it). Found by name among the local
    headers after the pickle: not proof, so a reader that trusted it confirms it
    (``confirms``) before using the values. Cost: O(len(prefix))."""
    try:
        header = _LOCAL_HEADER.unpack_from(prefix, 0)
        name = bytes(prefix[30 : 30 + header[10]])
        if header[0] != b"PK\x03\x04" or not name.endswith(b"/data.pkl") or header[4]:
            return None
        archive = name[: -len(b"data.pkl")]
        begin = 30 + header[10] + header[11]
        stream = io.BytesIO(prefix[begin:])
        located = _TensorPickle(stream, encoding="utf-8").load()
    except Exception:  # noqa: BLE001 - any damage: not located here (confirmed or read whole)
        return None
    if not isinstance(located, _Located):
        return None
    head, at, found = bytes(prefix), begin + stream.tell(), {}
    wanted = {archive + b"byteorder", archive + b"data/" + located.key.encode()}
    while len(found) < 2:
        at = head.find(b"PK\x03\x04", at)
        if at < 0 or at + _LOCAL_HEADER.size > len(head):
            break
        fields = _LOCAL_HEADER.unpack_from(head, at)
        name = head[at + 30 : at + 30 + fields[10]]
        if name in wanted and not fields[4]:  # stored, not compressed
            found[name] = at + 30 + fields[10] + fields[11]
        at += 4
    data = found.get(archive + b"data/" + located.key.encode())
    order = found.get(archive + b"byteorder")
    if data is None:
        return None
    if order is not None and not head[order:].startswith(sys.byteorder.encode() + b"PK"):
        return None  # the other byte order: torch.load swaps the values
    return Layout(located, data, data + located.numel * located.dtype.itemsize)


def confirms(view: memoryview, layout: Layout, hole: tuple[int, int]) -> bool:
    """Whether the record in ``view`` (every byte of it but ``hole``, which is where its
    values were received elsewhere) is the plain tensor ``layout`` says, of this host's
    byte order, its values at ``layout``'s place: its directory (at its end), pickle and
    byte order read again, nothing in ``hole`` read. Cost: O(directory + pickle)."""
    try:
        plain = _plain(view, hole)
        if plain is None:
            return False
        archive, prefix, where = plain
        span = _span(view, archive.getinfo(f"{prefix}data/{layout.located.key}"), hole)
    except Exception:  # noqa: BLE001 - any damage: not confirmed (the entry is read again whole)
        return False
    return where == layout.located and span == (layout.begin, layout.end)


def saved_tensor(view: memoryview) -> torch.Tensor:
    """The tensor that ``torch.save`` wrote into ``view``, its values the bytes of
    ``view`` themselves (module docstring); torch.load's (a copy) for a record of another
    shape. Cost: O(the record's directory and pickle), no copy of the tensor's bytes."""
    try:
        tensor = _in_place(view)
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, TypeError,
            IndexError, EOFError, struct.error, RuntimeError):  # fmt: skip
        tensor = None  # torch.load reads it, or says what is wrong with it
    if tensor is not None:
        return tensor
    return cast(torch.Tensor, torch.load(io.BytesIO(view), map_location="cpu", weights_only=True))


class _ViewFile(io.RawIOBase):
    """A read-only file over a memoryview that copies only what is read (the zip reader
    reads a record's directory, never the tensor's bytes); a read reaching into ``hole``
    (bytes the view does not hold) is refused."""

    def __init__(self, view: memoryview, hole: tuple = (0, 0)):
        self.view, self.at, self.hole = view, 0, hole

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = max(0, offset + (0, self.at, len(self.view))[whence])
        return self.at

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), len(self.view) - self.at))
        _outside(self.at, self.at + n, self.hole)
        buffer[:n] = self.view[self.at : self.at + n]
        self.at += n
        return n
