"""The floors: a minimal app on hypercorn that answers like the bench upstream.

    python -m bench.floor_app --port PORT [--host 127.0.0.1] [--bare]

What the gateway's stack costs before it does any gateway work: the same hypercorn settings as
`interlock serve`, one route that reads the body, decodes it like the upstream does, and answers
with the upstream's canned completion or canned SSE stream (paced with `bench_interval`, like
the upstream). No proxying, no routing, no metrics. By default a quart-trio app (the stack of
the gateway's other routes); with `--bare` a plain ASGI callable, as the gateway answers its
completion routes: the stack's own floor on that path. Runs until killed.
"""

from __future__ import annotations

import argparse

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from bench.upstream import COMPLETION, decode_completion_request, sse_events
from events.config import DEFAULT_SHUTDOWN_GRACE
from interlock.serve import KEEP_ALIVE_SECONDS


def create_floor_app() -> QuartTrio:
    app = QuartTrio("bench-floor")
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=None)

    @app.get("/health")
    async def health() -> Response:
        return Response(b"", content_type="text/plain")

    @app.post("/v1/chat/completions")
    async def completions() -> Response:
        completion = decode_completion_request.decode(await request.get_data())
        if not completion.stream:
            return Response(COMPLETION, content_type="application/json")
        events = sse_events(max(1, completion.bench_chunks))
        return Response(_paced(events, completion.bench_interval), content_type="text/event-stream")

    return app


async def bare_floor_app(scope, receive, send) -> None:
    """The same answers as `create_floor_app`'s, straight from hypercorn's ASGI messages."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] != "http":
        return
    pieces = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        pieces.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/health":
        await _send_whole(send, b"text/plain", b"")
        return
    completion = decode_completion_request.decode(b"".join(pieces))
    if not completion.stream:
        await _send_whole(send, b"application/json", COMPLETION)
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    async for event in _paced(sse_events(max(1, completion.bench_chunks)), completion.bench_interval):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _paced(events: tuple[bytes, ...], interval: float):
    started = trio.current_time()
    for index, event in enumerate(events):
        if interval > 0:
            await trio.sleep_until(started + index * interval)
        yield event


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_app", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bare", action="store_true", help="a plain ASGI app, no Quart")
    args = parser.parse_args()
    config = HypercornConfig()
    config.bind = [f"{args.host}:{args.port}"]
    config.graceful_timeout = DEFAULT_SHUTDOWN_GRACE
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    config.include_server_header = False
    config.accesslog = None
    trio.run(serve, bare_floor_app if args.bare else create_floor_app(), config)


if __name__ == "__main__":
    main()
