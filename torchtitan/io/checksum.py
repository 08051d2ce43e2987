"""CRC-32 (zlib's polynomial: the ``x-amz-checksum-crc32`` of S3 and the CRC32 of the
project's manifests) at the speed of the machine.

Owns the one ``crc32`` every checksum of the project's bytes goes through: ISA-L's
(``isal``, a dependency) where it is installed, zlib's otherwise; both give the same
value for the same bytes, in one piece or in chunks (``test/io/test_checksum.py``).

Why not zlib's: a local checkpoint's every byte is checksummed when it is saved (its
manifest) and again when a start verifies it, and the store reader checks each body a
store sent a CRC32 for (S3 sends one for a whole-object GET, none for a range; the local
test server also for a range covering a whole object); on a 2-core machine those bytes
are CPU-bound. (The store writer leaves its CRC32s to botocore: a request holding its
own makes botocore SHA-256 the body over https.) Measured here on 64 MiB (x86-64 with PCLMULQDQ, no AVX-512):
zlib's 2.8 GB/s, ISA-L's 7.6 GB/s (awscrt's, which botocore uses where it is installed,
2.1 GB/s; zlib-ng's 5.0 GB/s). Both release the GIL on large buffers, so the fetch
threads checking bodies run side by side. For 1.6 GB: 0.57 s of CPU -> 0.21 s.

Never: choose the checksum of a format the project does not write (the store sends
what it sends: other algorithms go through botocore).
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # not installed (an install without the dependency): zlib's
    _isal_crc32 = None

crc32 = _isal_crc32 or zlib.crc32
"""``crc32(data, value=0) -> int``: the CRC-32 of ``data`` (a bytes-like object),
continuing from ``value`` (the CRC-32 of the bytes before it). Cost: O(len(data))."""

FAST = _isal_crc32 is not None
