"""A tensor that ``torch.save`` wrote (one DCP entry), read where its bytes already lie.

Owns ``saved_tensor``: the record's zip directory and its pickle read without building
anything (``_TensorPickle``: only the globals a plain tensor's pickle names are resolved,
to what locates its bytes), then the tensor made over the record's own bytes
(``torch.frombuffer``, with the saved offset, size and strides). A record of any other
shape (a tensor subclass, a conjugate bit, a storage class this does not know, the other
byte order, a compressed entry) is read by ``torch.load``, weights only.

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


def _entry(view: memoryview, info: zipfile.ZipInfo) -> memoryview:
    """The bytes of a stored (uncompressed) zip entry, where they lie in ``view``."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"{info.filename} is compressed")
    header = _LOCAL_HEADER.unpack_from(view, info.header_offset)
    if header[0] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    begin = info.header_offset + _LOCAL_HEADER.size + header[10] + header[11]
    if begin + info.compress_size > len(view):
        raise zipfile.BadZipFile(f"{info.filename} runs past the record")
    return view[begin : begin + info.compress_size]


def _in_place(view: memoryview) -> torch.Tensor | None:
    """The tensor over ``view``'s own bytes, or None where the record is not a plain
    tensor of this host's byte order."""
    archive = zipfile.ZipFile(_ViewFile(view))
    first = archive.namelist()[0]
    prefix = first[: first.index("/") + 1]
    names = set(archive.namelist())
    if f"{prefix}byteorder" in names:
        order = bytes(_entry(view, archive.getinfo(f"{prefix}byteorder")))
        if order != sys.byteorder.encode():
            return None  # torch.load swaps the values: not in a buffer read from the store
    pickled = _entry(view, archive.getinfo(f"{prefix}data.pkl"))
    where = _TensorPickle(io.BytesIO(pickled), encoding="utf-8").load()
    if not isinstance(where, _Located):
        return None
    data = _entry(view, archive.getinfo(f"{prefix}data/{where.key}"))
    if not where.numel:  # frombuffer refuses no bytes
        values = torch.empty(0, dtype=where.dtype)
    else:
        with warnings.catch_warnings():  # a bytes object's is read-only: never written here
            warnings.simplefilter("ignore", UserWarning)
            values = torch.frombuffer(data, dtype=where.dtype)
    # bounds checked: a size or offset past the stored values is a RuntimeError
    return values.as_strided(where.size, where.stride, where.offset)


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
    reads a record's directory, never the tensor's bytes)."""

    def __init__(self, view: memoryview):
        self.view, self.at = view, 0

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
        buffer[:n] = self.view[self.at : self.at + n]
        self.at += n
        return n
