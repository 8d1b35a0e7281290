"""JSON Lines on a byte stream (the socketpair between the leader and each worker): the
same framing as a log on disk, one record a line, each ended by a newline."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import trio

RECEIVE_SIZE = 65536


def frame_lines(records: Iterable[bytes]) -> bytes:
    """Encoded records (no newline in them) as the bytes to send: each on a line of its own."""
    return b"".join(record + b"\n" for record in records)


async def receive_lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    """Each whole line the stream carries, newline removed, until it ends or breaks (a line
    cut short by the end is dropped)."""
    buffered = b""
    while True:
        try:
            data = await stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if not data:
            return
        *lines, buffered = (buffered + data).split(b"\n")
        for line in lines:
            yield line
