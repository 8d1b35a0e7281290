"""What the gateway's two Quart apps (the API's routes other than the completions, and the
metrics listener's `/metrics`) share: how quart-trio must end a response under hypercorn."""

from __future__ import annotations

import trio
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection


class _HttpConnection(TrioASGIHTTPConnection):
    """quart-trio's connection handler, sending the end of each response shielded from cancellation.

    hypercorn finishes the exchange inside that last send: it tells the app the stream is closed,
    which makes quart-trio cancel the request's tasks, and then closes (or recycles) the
    connection, which a cancellation would interrupt, leaving a `Connection: close` socket open
    (or a keep-alive one without its idle timeout).
    """

    async def __call__(self, receive, send) -> None:
        async def send_end_shielded(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(receive, send_end_shielded)


def new_quart_app(name: str) -> QuartTrio:
    """A Quart-trio app whose connections end as HTTP requires; OPTIONS is a method like any
    other (plinth's mux answers it 405)."""
    app = QuartTrio(name)
    app.asgi_http_class = _HttpConnection
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    return app
