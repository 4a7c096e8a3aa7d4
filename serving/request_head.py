"""uvicorn's HTTP protocol, guarding each request's head (its request line and headers) before
the app sees the request, on either of uvicorn's HTTP parsers (httptools' when it is installed,
which "auto" picks; else h11's):

- a deadline: a connection whose head has not arrived within `read_timeout_s` is closed
  (uvicorn has none: a client that sent half its headers held a connection forever);
- a size: a head over `max_header_bytes` gets 431 and the connection is closed, after at most
  that many bytes were read into the parser. httptools has no bound of its own: it buffered a
  100 MB header whole (20 s, +200 MB of memory) and the app answered 200. h11 has one (16 KiB
  by default, answered 400); it is set to the same bound.

The number of header fields is bounded in the app (serving/limits.py): the size bound already
caps what the parser does with a head.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.config import ServerConfig
from serving.protocol import error_body

logger = logging.getLogger("inferlab.serve")

#: The code of the error body, for a head too large and for too many header fields.
TOO_LARGE_CODE = "headers_too_large"


def default_protocol() -> type[asyncio.Protocol]:
    """The HTTP/1.1 protocol uvicorn's "auto" picks: httptools' when installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def request_head_protocol(
    config: ServerConfig, base: type[Any] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`base`, default: what "auto" picks) with the head's deadline
    (`read_timeout_s`, from the connection's opening or the first byte of its next request; idle
    keep-alive connections are uvicorn's `timeout_keep_alive`, the body is RequestClock's) and
    its size bound (`max_header_bytes`)."""
    base = base or default_protocol()
    timeout_s, max_bytes = config.read_timeout_s, config.max_header_bytes
    refusal = _refusal(
        f"The request line and headers are over {max_bytes} bytes; this server accepts at "
        f"most {max_bytes} bytes (the server option max_header_bytes)"
    )

    class RequestHeadProtocol(_RequestHeadGuard, base):  # type: ignore[valid-type, misc]
        _timeout_s = timeout_s
        _max_bytes = max_bytes
        _refusal_response = refusal

    RequestHeadProtocol.__name__ = f"RequestHead{base.__name__}"
    return RequestHeadProtocol


# The guard's base is uvicorn's protocol class, chosen at run time (request_head_protocol puts
# the guard in front of it): to the type checker, anything.
_UvicornProtocol: Any = object


class _RequestHeadGuard(_UvicornProtocol):
    """The head's deadline and size bound, over either of uvicorn's HTTP protocols."""

    _timeout_s: float
    _max_bytes: int
    _refusal_response: bytes  # the whole 431
    _header_timer: asyncio.TimerHandle | None = None
    _in_head = True  # the parser is reading a request line and headers
    _head_bytes = 0  # of the head, fed to the parser so far
    _heads = 0  # heads begun on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        while self._in_head and data and not self.transport.is_closing():
            if self._header_timer is None:
                self._arm()  # the first bytes of a next request on a kept-alive connection
            room = self._max_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                break
            # the head may end within what fits: what follows it is a body, or a next
            # request (pipelined), whose head is counted from where it begins
            head, data = data[:room], data[room:]
            heads, self._head_bytes = self._heads, self._max_bytes
            if head:  # (never b"": to h11 that means the client closed)
                super().data_received(head)
            if self._in_head and self._heads == heads:
                self._refuse()
                return
        if data and not self.transport.is_closing():
            super().data_received(data)

    # the head is in: h11 has left IDLE, or httptools called back
    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._head_done()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._head_done()

    # the next head begins: httptools parses straight on into a pipelined request; h11
    # reads it only once the response is out (uvicorn pauses reading until then)
    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_begins()

    def on_response_complete(self) -> None:
        if isinstance(self, H11Protocol):
            self._head_begins()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_begins(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._heads += 1

    def _head_done(self) -> None:
        self._in_head = False
        self._disarm()

    def _refuse(self) -> None:
        logger.info(
            "connection from %s: request line and headers over max_header_bytes=%d "
            "bytes; answered 431 and closed",
            _peer(self.client),
            self._max_bytes,
        )
        self._disarm()
        self.transport.write(self._refusal_response)
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self._timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._in_head and not self.transport.is_closing():
            logger.info(
                "connection from %s: no complete request headers within "
                "read_timeout_s=%g s; closed",
                _peer(self.client),
                self._timeout_s,
            )
            self.transport.close()


def _refusal(message: str) -> bytes:
    """A whole 431 response with OpenAI's error body, written before any app runs."""
    body = json.dumps(error_body(message, "invalid_request_error", None, TOO_LARGE_CODE)).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
