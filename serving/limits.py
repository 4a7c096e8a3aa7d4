"""Request size limits, pure ASGI middleware: `BodySizeLimit` and `HeaderCountLimit` (the size
of the request line and headers is bounded before the app, in serving/request_head.py).

A body over `max_body_bytes` is refused with 413 before it is parsed, and before it is even read
when its Content-Length says so; a chunked body (no Content-Length) is counted as it arrives and
refused the moment it passes the limit. Without it a client could make the server buffer and
parse any amount of JSON (uvicorn has no limit of its own). A request with more than
`max_header_count` header fields is refused with 431 (neither uvicorn nor its parsers count them;
10,000 small headers were served).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.protocol import TrackedSend, send_error
from serving.request_head import TOO_LARGE_CODE


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

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        tracked_send = TrackedSend(send)
        try:
            await self.app(scope, counting_receive, tracked_send)
        except BodyTooLarge:
            if not tracked_send.started:  # always so: handlers read the whole body before answering
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


class HeaderCountLimit:
    """Refuses HTTP requests with more than `max_header_count` header fields with 431 and
    OpenAI's error body; the body is never read, so the connection is closed."""

    def __init__(self, app: ASGIApp, max_header_count: int) -> None:
        self.app = app
        self.max_header_count = max_header_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        count = len(scope["headers"]) if scope["type"] == "http" else 0
        if count <= self.max_header_count:
            await self.app(scope, receive, send)
            return
        message = (
            f"The request has {count} header fields; this server accepts at most "
            f"{self.max_header_count} (the server option max_header_count)"
        )
        await send_error(send, 431, message, TOO_LARGE_CODE, close=True)
