"""Counting what a piece of work reads: the files it opens and the bytes it reads.

For the start-up benchmark and the data plan's tests (how many files one rank opens
before its first batch). Opens are Python's ``open`` audit events (every reader of this project opens
files through Python, pyarrow included: it is handed Python file objects); bytes are
the process's ``rchar`` (/proc/self/io: bytes returned by read calls, cached or not).

Never: change what is read.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

_active: list[set] = []  # the open sets of the counters running now


def _hook(event: str, args: tuple):
    if event == "open" and _active and isinstance(args[0], str | bytes | os.PathLike):
        path = os.fsdecode(args[0])
        for opened in _active:
            opened.add(os.path.abspath(path))


_installed = False


def _read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))
    except (OSError, StopIteration):
        return 0


class Access:
    """What the work inside ``counting()`` opened (absolute paths) and read (bytes)."""

    def __init__(self):
        self.opened: set[str] = set()
        self.bytes_read = 0

    def files_under(self, folder: str) -> set[str]:
        folder = os.path.abspath(folder) + os.sep
        return {p for p in self.opened if p.startswith(folder)}


@contextmanager
def counting():
    """``with counting() as access:``; audit hooks cannot be removed, so one is installed
    on first use and stays idle (one list check per open) outside a count."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    access = Access()
    _active.append(access.opened)
    before = _read_bytes()
    try:
        yield access
    finally:
        # /proc/self/io is read with open(): not counted, it is outside the work.
        _active.remove(access.opened)
        access.bytes_read = _read_bytes() - before
