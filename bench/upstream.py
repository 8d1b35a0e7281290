"""The benchmark's upstream: a fast, canned OpenAI-compatible node that is never the bottleneck.

    python -m bench.upstream [--host 127.0.0.1] [--port 0]

A reference, not project code: plain asyncio protocols and a hand-rolled HTTP/1.1 keep-alive
parser, because it must serve several times what any proxy in front of it can. Prints
`listening on http://HOST:PORT` once it accepts connections; runs until killed.

`POST /v1/chat/completions` (or `/v1/completions`) answers with the same canned chat completion
every time, or with `"stream": true` a canned SSE stream of `bench_chunks` events (default 64,
the last one `data: [DONE]`), each in its own HTTP chunk and its own write. With
`"bench_interval": S` the events are paced S seconds apart (0.02 for 50 chunks/s), on a fixed
schedule from the first one, so a late event does not delay the ones after it.

`GET /health` answers 200, `GET /v1/models` lists MODEL and `GET /metrics` serves one GPU's
gauges, so a gateway's probes (health, model discovery, GPU scrape) all see a healthy node.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket

import msgspec

MODEL = "bench-model"
STREAM_CHUNKS = 64
"""SSE events in a canned stream, `data: [DONE]` included."""

COMPLETION = msgspec.json.encode(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1767323045,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the bench upstream."},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 9, "total_tokens": 16, "completion_tokens": 7},
    }
)
MODELS = msgspec.json.encode(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1767323045, "owned_by": "vllm", "root": MODEL}]}
)
GPU_METRICS = b"".join(
    f'{name}{{gpu="GPU-bench-0"}} {value}\n'.encode()
    for name, value in (
        ("gpu_memory_used_bytes", 42949672960),
        ("gpu_memory_total_bytes", 85899345920),
        ("gpu_utilization_percent", 25),
        ("gpu_temperature_celsius", 45),
    )
)


@functools.cache
def sse_events(count: int) -> tuple[bytes, ...]:
    """`count` SSE events as vLLM streams a chat completion: tokens, then `data: [DONE]`
    (made once per count: serving canned bytes must cost nothing)."""
    events = []
    for index in range(count - 1):
        delta = {"role": "assistant", "content": " lorem"} if index == 0 else {"content": " lorem"}
        finish = "stop" if index == count - 2 else None
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1767323045,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        events.append(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return tuple(events)


class CompletionRequest(msgspec.Struct):
    """What the upstream reads from a completion request's body (the rest is ignored)."""

    stream: bool | None = None
    bench_chunks: int = STREAM_CHUNKS
    bench_interval: float = 0.0


decode_completion_request = msgspec.json.Decoder(CompletionRequest)


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
    return head + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_JSON = b"application/json"
_COMPLETION_RESPONSE = _response(b"200 OK", _JSON, COMPLETION)
_ROUTES = {
    (b"GET", b"/health"): _response(b"200 OK", b"text/plain", b""),
    (b"GET", b"/v1/models"): _response(b"200 OK", _JSON, MODELS),
    (b"GET", b"/metrics"): _response(b"200 OK", b"text/plain; version=0.0.4", GPU_METRICS),
}
_NOT_FOUND = _response(b"404 Not Found", _JSON, b'{"detail": "Not Found"}')
_BAD_REQUEST = _response(b"400 Bad Request", _JSON, b'{"detail": "invalid body"}')
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_STREAM_END = b"0\r\n\r\n"
_COMPLETION_PATHS = (b"/v1/chat/completions", b"/v1/completions")


@functools.cache
def framed_stream(count: int) -> tuple[bytes, ...]:
    """The canned stream of `count` events, each framed as one HTTP chunk (made once per count)."""
    return tuple(_chunk(event) for event in sse_events(count))


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive client connection: requests are answered in order, one at a time."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.streaming: asyncio.TimerHandle | None = None
        """The next paced event, while a paced stream is being sent (requests wait meanwhile)."""
        self.close_after_response = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        # Each event must leave at once. (asyncio sets this itself only for sockets created
        # with proto=IPPROTO_TCP, which an accepted socket of ours is not.)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
            self.streaming = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.streaming is None:
            self._answer_buffered()

    def _answer_buffered(self) -> None:
        while self.streaming is None and not self.close_after_response:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            total = end + 4 + _content_length(head)
            if len(self.buffer) < total:
                return
            body = bytes(self.buffer[end + 4 : total])
            del self.buffer[:total]
            self.close_after_response = b"\r\nconnection: close" in head.lower()
            self._answer(head, body)
            if self.close_after_response and self.streaming is None:
                self.transport.close()

    def _answer(self, head: bytes, body: bytes) -> None:
        method, target = head.split(b" ", 2)[:2]
        path = target.partition(b"?")[0]
        if method == b"POST" and path in _COMPLETION_PATHS:
            try:
                request = decode_completion_request.decode(body)
            except msgspec.DecodeError:
                self.transport.write(_BAD_REQUEST)
                return
            if not request.stream:
                self.transport.write(_COMPLETION_RESPONSE)
            elif request.bench_interval > 0:
                self._start_paced(framed_stream(max(1, request.bench_chunks)), request.bench_interval)
            else:
                self.transport.write(_STREAM_HEAD)
                for chunk in framed_stream(max(1, request.bench_chunks)):
                    self.transport.write(chunk)
                self.transport.write(_STREAM_END)
            return
        self.transport.write(_ROUTES.get((method, path), _NOT_FOUND))

    def _start_paced(self, chunks: tuple[bytes, ...], interval: float) -> None:
        self.transport.write(_STREAM_HEAD)
        loop = asyncio.get_running_loop()
        started = loop.time()

        def send(index: int) -> None:  # the events are sent by timer callbacks, one each
            self.transport.write(chunks[index])
            if index + 1 < len(chunks):
                self.streaming = loop.call_at(started + (index + 1) * interval, send, index + 1)
                return
            self.transport.write(_STREAM_END)
            self.streaming = None
            if self.close_after_response:
                self.transport.close()
            else:
                self._answer_buffered()

        self.streaming = loop.call_at(started, send, 0)


def _content_length(head: bytes) -> int:
    lowered = head.lower()
    start = lowered.find(b"\r\ncontent-length:")
    if start < 0:
        return 0
    start += len(b"\r\ncontent-length:")
    end = lowered.find(b"\r\n", start)
    return int(lowered[start : end if end >= 0 else None])


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.bind((host, port))
    server = await loop.create_server(UpstreamConnection, sock=listening, backlog=4096)
    bound_host, bound_port = listening.getsockname()[:2]
    print(f"listening on http://{bound_host}:{bound_port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
