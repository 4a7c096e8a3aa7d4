"""The request-body size limit: `BodySizeLimit`, pure ASGI middleware.

A body over `max_body_bytes` is refused with 413 before it is parsed, and before it is even read
when its Content-Length says so; a chunked body (no Content-Length) is counted as it arrives and
refused the moment it passes the limit. Without it a client could make the server buffer and
parse any amount of JSON (uvicorn has no limit of its own).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.protocol import send_error


class BodyTooLarge(Exception):
    """Raised from `receive` once a chunked body passes the limit."""


class BodySizeLimit:
    """Refuses HTTP request bodies over `max_body_bytes` with 413 and OpenAI's error body."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send, f"{declared} bytes (Content-Length)")
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracked_send)
        except BodyTooLarge:
            if not started:  # always so: handlers read the whole body before answering
                await self._refuse(send, f"more than {self.max_body_bytes} bytes (chunked)")

    async def _refuse(self, send: Send, size: str) -> None:
        message = (
            f"The request body is {size}; this server accepts at most "
            f"{self.max_body_bytes} bytes (the server option max_body_bytes)"
        )
        # The rest of the body is never read, so the connection cannot carry another request.
        await send_error(send, 413, message, "request_too_large", close=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses a malformed one before the app runs
    return None
