"""What the API app knows of hypercorn's `receive` beyond ASGI, fenced in one module.

hypercorn (trio) gives an app the `receive` method of a trio memory channel holding the
request's messages as they arrive (hypercorn.trio.task_group.TaskGroup.spawn_app). The body
reader takes a message already queued without waiting, which spares it a cancel scope with
deadlines for most bodies (those that come with their head). `tests/test_private_surface.py`
checks, through a real hypercorn, that `receive` is still such a method: a hypercorn that
changes it fails that test naming its version, instead of quietly taking the slower way.
"""

from __future__ import annotations

import trio


def queued_message(receive) -> dict | None:
    """The next message of a hypercorn `receive` when one is queued already; None when none is
    (or `receive` is not hypercorn's channel): then `await receive()`."""
    if not is_queue_receive(receive):
        return None
    try:
        return receive.__self__.receive_nowait()
    except trio.WouldBlock:
        return None


def is_queue_receive(receive) -> bool:
    """Whether `receive` is what `queued_message` reads without waiting: a trio memory channel's."""
    return isinstance(getattr(receive, "__self__", None), trio.MemoryReceiveChannel)
