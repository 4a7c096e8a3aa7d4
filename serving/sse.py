"""Server-sent events, and noticing that the client went away.

Starlette's StreamingResponse (ASGI spec 2.4) notices a disconnect only when a write fails, and
then leaves the body iterator for the garbage collector to close. A request waiting in the
engine's queue writes nothing, so it would keep its place (and later its KV memory) after its
client left. Here a watcher task waits for `http.disconnect` the whole time and the body
iterator is closed at once, which aborts the engine request (see BuiltinBackend.generate).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse_event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves.

    Both tasks are finished before this returns or raises, so whoever closes what `work` was
    iterating (an async generator) never finds it still running."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled
        disconnected = (
            watcher.done()
            and not watcher.cancelled()
            and watcher.exception() is None
            and not task.done()
        )
        for pending in (task, watcher):
            pending.cancel()
        # let both unwind now; a cancellation of our own still propagates afterwards
        await asyncio.gather(task, watcher, return_exceptions=True)
    if disconnected or task.cancelled():  # (cancelled: the watcher failed; as good as gone)
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """An SSE response whose body iterator is closed the moment the client disconnects;
    `on_close` runs however the response ends (even if the body never started)."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any
    ) -> None:
        headers = {
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **kwargs.pop("headers", {}),
        }
        super().__init__(content, headers=headers, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            await unless_disconnected(receive, self.stream_response(send))
        except (ClientDisconnected, OSError):
            pass  # nothing left to send to; the finally below aborts the request
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
            self.on_close()
