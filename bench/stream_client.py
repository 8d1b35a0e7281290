"""Paced SSE streams at a fixed concurrency: how late does each chunk arrive?

    python -m bench.stream_client URL [--concurrency 64] [--duration 10] [--warm-up 2]
        [--chunks 100] [--interval 0.02] [--pid PID ...]

Keeps `--concurrency` keep-alive connections busy, each asking URL (a chat-completions URL of
the bench upstream or of a proxy in front of it) for one paced stream after the other: `--chunks`
SSE events `--interval` seconds apart (the upstream's `bench_interval`). It records when each
event arrives and reports, over the measured window after the warm-up, the inter-chunk gaps
within a stream minus the pacing interval: the delay added on the way (negative when a late
chunk is followed by one on time). The gap before a stream's first event is not counted.

With `--pid` (repeatable) it also reads those processes' CPU time (user + system, from /proc)
at the start and end of the window, for the CPU cost per relayed chunk. Prints one JSON object.

Plain asyncio protocols and a minimal HTTP/1.1 response parser, so that 256 streams at 50
chunks/s cost the client little; streams start at random phases of the interval, as real
requests would, and connections open spread over the first part of the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import urllib.parse
from dataclasses import dataclass, field

from bench.processes import cpu_seconds
from bench.upstream import MODEL


@dataclass
class Recording:
    """What every connection adds to while the window is open."""

    window_start: float
    window_end: float
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive events of one stream, both arriving in the window."""
    events: int = 0
    """Events that arrived in the window."""
    streams: int = 0
    """Streams that completed in the window."""
    errors: list[str] = field(default_factory=list)

    def in_window(self, at: float) -> bool:
        return self.window_start <= at < self.window_end


_SIZE_LINE = -1
_CHUNK_END = -2
"""The CRLF that follows a chunk's data."""


class StreamingConnection(asyncio.Protocol):
    """One keep-alive connection asking for one paced stream after the other."""

    def __init__(self, request: bytes, chunks: int, recording: Recording) -> None:
        self.request = request
        self.chunks = chunks
        self.recording = recording
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = self.loop.create_future()
        self.closing = False
        """Set when this side closes the connection: the server closing it is an error."""
        self._start_response()

    def _start_response(self) -> None:
        self.buffer = bytearray()
        self.in_head = True
        self.chunk_left = _SIZE_LINE
        """Data bytes of the current HTTP chunk still to come, or what is expected next."""
        self.events = 0
        self.last_event_at: float | None = None
        self.tail = b""
        """The last byte of the body so far, for an event terminator split between reads."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closing and self.recording.in_window(self.loop.time()):
            self.recording.errors.append(f"connection lost: {exc or 'closed by the server'}")
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        at = self.loop.time()
        self.buffer += data
        try:
            payload, finished = self._decode()
        except ValueError as error:
            self._fail(str(error))
            return
        if payload:
            self._count_events(payload, at)
        if finished:
            self._finish_response(at)

    def _decode(self) -> tuple[bytes, bool]:
        """Consume what the buffer holds: the body bytes it carried, and whether the response ended."""
        if self.in_head:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return b"", False
            head = bytes(self.buffer[:end]).lower()
            if not head.startswith(b"http/1.1 200"):
                raise ValueError(f"status {head[9:12].decode()}")
            if b"transfer-encoding: chunked" not in head:
                raise ValueError("not a chunked response")
            del self.buffer[: end + 4]
            self.in_head = False
        payload = bytearray()
        while True:
            if self.chunk_left > 0:
                if not self.buffer:
                    return bytes(payload), False
                taken = self.buffer[: self.chunk_left]
                del self.buffer[: self.chunk_left]
                payload += taken
                self.chunk_left -= len(taken)
                if self.chunk_left == 0:
                    self.chunk_left = _CHUNK_END
            elif self.chunk_left == _CHUNK_END:
                if len(self.buffer) < 2:
                    return bytes(payload), False
                del self.buffer[:2]
                self.chunk_left = _SIZE_LINE
            else:
                end = self.buffer.find(b"\r\n")
                if end < 0:
                    return bytes(payload), False
                size = int(bytes(self.buffer[:end]).split(b";")[0], 16)
                if size == 0:  # the last chunk: its size line, then an empty line (no trailers)
                    if len(self.buffer) < end + 4:
                        return bytes(payload), False
                    if self.buffer[end + 2 : end + 4] != b"\r\n":
                        raise ValueError("trailers are not supported")
                    del self.buffer[: end + 4]
                    return bytes(payload), True
                del self.buffer[: end + 2]
                self.chunk_left = size

    def _count_events(self, payload: bytes, at: float) -> None:
        arrived = payload.count(b"\n\n") + (self.tail == b"\n" and payload[:1] == b"\n")
        self.tail = payload[-1:]
        if not arrived:
            return
        recording = self.recording
        if recording.in_window(at):
            recording.events += arrived
            if self.last_event_at is not None and recording.in_window(self.last_event_at):
                recording.gaps.append(at - self.last_event_at)
            recording.gaps.extend([0.0] * (arrived - 1))  # events that arrived together
        self.events += arrived
        self.last_event_at = at

    def _finish_response(self, at: float) -> None:
        if self.events != self.chunks:
            self._fail(f"stream ended after {self.events} of {self.chunks} events")
            return
        if self.recording.in_window(at):
            self.recording.streams += 1
        self._start_response()
        self.transport.write(self.request)

    def _fail(self, error: str) -> None:
        if self.recording.in_window(self.loop.time()):
            self.recording.errors.append(error)
        self.close()

    def close(self) -> None:
        self.closing = True
        self.transport.close()


async def run_streams(
    url: str, *, concurrency: int, duration: float, warm_up: float, chunks: int, interval: float, pids: list[int]
) -> dict:
    """Run the streams and return the report (see the module docstring)."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname, parsed.port or 80
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a long story."}],
            "stream": True,
            "bench_chunks": chunks,
            "bench_interval": interval,
        }
    ).encode()
    request = (
        f"POST {parsed.path or '/'} HTTP/1.1\r\nHost: {parsed.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    started = loop.time()
    recording = Recording(window_start=started + warm_up, window_end=started + warm_up + duration)
    spread = min(1.0, warm_up / 2)
    connections: list[StreamingConnection] = []

    async def open_connection(index: int) -> None:
        await asyncio.sleep(spread * index / concurrency + random.uniform(0, interval))
        try:
            _, connection = await loop.create_connection(
                lambda: StreamingConnection(request, chunks, recording), host, port
            )
        except OSError as error:
            recording.errors.append(f"connect: {error}")
            return
        connections.append(connection)

    await asyncio.gather(*(open_connection(index) for index in range(concurrency)))
    await asyncio.sleep(max(0.0, recording.window_start - loop.time()))
    cpu_start = cpu_seconds(pids) if pids else 0.0
    await asyncio.sleep(max(0.0, recording.window_end - loop.time()))
    cpu = cpu_seconds(pids) - cpu_start if pids else None
    for connection in connections:
        connection.close()
    await asyncio.gather(*(connection.closed for connection in connections))
    return report(recording, concurrency=concurrency, duration=duration, interval=interval, cpu=cpu)


def report(recording: Recording, *, concurrency: int, duration: float, interval: float, cpu: float | None) -> dict:
    added = sorted(gap - interval for gap in recording.gaps)

    def percentile(fraction: float) -> float | None:
        if not added:
            return None
        return added[min(len(added) - 1, int(fraction * len(added)))] * 1000

    return {
        "concurrency": concurrency,
        "seconds": duration,
        "interval_ms": interval * 1000,
        "events": recording.events,
        "streams": recording.streams,
        "gaps": len(added),
        "added_delay_p50_ms": percentile(0.5),
        "added_delay_p99_ms": percentile(0.99),
        "added_delay_max_ms": added[-1] * 1000 if added else None,
        "added_delay_mean_ms": statistics.fmean(added) * 1000 if added else None,
        "errors": len(recording.errors),
        "first_errors": recording.errors[:5],
        "cpu_seconds": cpu,
        "cpu_per_chunk_us": cpu / recording.events * 1e6 if cpu is not None and recording.events else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="e.g. http://127.0.0.1:8000/v1/chat/completions")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams (default 64)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds (default 10)")
    parser.add_argument("--warm-up", type=float, default=2.0, help="seconds before measuring (default 2)")
    parser.add_argument("--chunks", type=int, default=100, help="SSE events per stream (default 100)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between events (default 0.02)")
    parser.add_argument("--pid", type=int, action="append", default=[], help="a process whose CPU to measure")
    args = parser.parse_args()
    result = asyncio.run(
        run_streams(
            args.url,
            concurrency=args.concurrency,
            duration=args.duration,
            warm_up=args.warm_up,
            chunks=args.chunks,
            interval=args.interval,
            pids=args.pid,
        )
    )
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
