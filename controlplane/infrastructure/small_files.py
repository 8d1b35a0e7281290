"""The small files a config names (key, certificate and CA files), opened as the loader and every
process open them: without blocking, so that a FIFO or a device is refused by its type instead of
waiting for a writer for ever, and bounded in size."""

from __future__ import annotations

import os
import stat


def check_small_file(path: str, limit: int, kind: str) -> None:
    """Raise ValueError unless `path` is a regular file of at most `limit` bytes (`kind` names
    such a file in the error); OSError when it cannot be opened."""
    _read(path, limit, kind, content=False)


def read_small_file(path: str, limit: int, kind: str) -> bytes:
    """The bytes of `path`, checked as `check_small_file` checks it."""
    return _read(path, limit, kind, content=True)


def _read(path: str, limit: int, kind: str, *, content: bool) -> bytes:
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"reading {path}: not a regular file")
        if status.st_size > limit:
            raise ValueError(f"reading {path}: {status.st_size} bytes, more than the {limit} {kind} may hold")
        if not content:
            return b""
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            return file.read(limit + 1)[:limit]
    finally:
        os.close(descriptor)
