"""uvicorn's HTTP protocol, guarding each request's head (its request line and headers) before
the app sees the request: `header_timeout_protocol` closes a connection whose head has not
arrived within the read timeout (uvicorn has none: a client that sent half its headers held a
connection forever). It works with either of uvicorn's HTTP parsers: httptools' when it is
installed ("auto" picks it), else h11's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("inferlab.serve")


def default_protocol() -> type[asyncio.Protocol]:
    """The HTTP/1.1 protocol uvicorn's "auto" picks: httptools' when installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def header_timeout_protocol(
    header_timeout_s: float, base: type[Any] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`base`, default: what "auto" picks), closing a connection whose
    request line and headers have not all arrived `header_timeout_s` after it opened, or after
    the first byte of its next request. Idle keep-alive connections are uvicorn's
    `timeout_keep_alive`; the body is RequestClock's."""
    base = base or default_protocol()

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _awaiting_headers = True

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers and self._header_timer is None:
                self._arm()  # the first bytes of a next request on a kept-alive connection
            super().data_received(data)

        # the headers are in: h11 has left IDLE, or httptools called back
        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._headers_done()

        def on_response_complete(self) -> None:
            self._awaiting_headers = True
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_done(self) -> None:
            self._awaiting_headers = False
            self._disarm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self._awaiting_headers and not self.transport.is_closing():
                logger.info(
                    "connection from %s: no complete request headers within "
                    "read_timeout_s=%g s; closed",
                    _peer(self.client),
                    header_timeout_s,
                )
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
