"""What the gateway's two Quart apps (the API's routes other than the completions, and the
metrics listener's `/metrics`) share: how quart-trio must end a response under hypercorn."""

from __future__ import annotations

import trio
from quart_trio import QuartTrio


class _ResponseEndShielded:
    """An ASGI middleware (as Quart's `asgi_app`) sending the end of each response shielded
    from cancellation.

    hypercorn finishes the exchange inside that last send: it tells the app the stream is closed,
    which makes quart-trio cancel the request's tasks, and then closes (or recycles) the
    connection, which a cancellation would interrupt, leaving a `Connection: close` socket open
    (or a keep-alive one without its idle timeout).
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_end_shielded(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_end_shielded)


def new_quart_app(name: str) -> QuartTrio:
    """A Quart-trio app whose connections end as HTTP requires; OPTIONS is a method like any
    other (plinth's mux answers it 405)."""
    app = QuartTrio(name)
    app.asgi_app = _ResponseEndShielded(app.asgi_app)
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    return app
