"""The server's life around the app: the listening socket, when each request arrived, read
timeouts for requests that never finish arriving, and a bounded graceful shutdown.

- `bind_socket`: the port is taken before the model loads, so a port in use is a one-line
  error at once, not after the load.
- `RequestClock` (ASGI middleware): stamps each request's arrival, the moment the app first sees
  it (its headers have arrived), which is where the server's TTFT starts; gives its body
  `read_timeout_s` to arrive, else answers 408 and closes the connection (the request line and
  headers have the same deadline: serving/request_head.py).
- `Server`: uvicorn's server whose SIGTERM/SIGINT stops admitting (new requests get 503), lets
  running requests finish for at most `shutdown_timeout_s`, then aborts the rest (a stream
  gets a final error event), frees their KV memory and exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import now_ns
from serving.config import ServerConfig, ServerConfigError
from serving.generation import ServingEngine
from serving.protocol import TrackedSend, send_error
from serving.request_head import request_head_protocol

logger = logging.getLogger("inferlab.serve")

ARRIVAL_KEY = "inferlab.arrival_ns"  # in the ASGI scope
#: After the drain, how long uvicorn waits for connections to finish their last writes.
GRACE_AFTER_DRAIN_S = 5
#: After aborting at the deadline, how long aborted requests get to write their last event.
ABORT_FLUSH_S = 5.0


def bind_socket(host: str, port: int, port_option: str = "port=") -> socket.socket:
    """A TCP socket bound to host:port (not yet listening; uvicorn listens on it);
    `port_option`: how the error tells the user to choose another port."""
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ServerConfigError(
            f"host: {host!r} is invalid: {exc.strerror}; allowed: a host "
            "name or IP address, e.g. 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, address = infos[0]
    # proto=IPPROTO_TCP matters: asyncio turns Nagle off (TCP_NODELAY) only on connections
    # whose socket says so, and Nagle with delayed ACKs holds each SSE chunk back ~40 ms.
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        zero = f"{port_option}0" if port_option.endswith("=") else f"{port_option} 0"
        raise ServerConfigError(
            f"port: cannot listen on {host}:{port}: {exc.strerror} (is "
            f"another server using it? choose another {port_option}, or {zero} "
            "for any free one)"
        ) from None
    return sock


def arrival_ns(scope: Scope) -> int:
    """When the request's headers arrived (now, for a request RequestClock did not see)."""
    return scope.get(ARRIVAL_KEY) or now_ns()


class RequestClock:
    """Pure ASGI middleware: stamps each HTTP request's arrival and gives its body
    `read_timeout_s` from then to arrive; a body that does not gets 408 and the connection is
    closed. A client that leaves while sending its body costs one log line, not a traceback."""

    def __init__(self, app: ASGIApp, read_timeout_s: float) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL_KEY] = now_ns()
        deadline = time.monotonic() + self.read_timeout_s
        body_done = timed_out = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:  # the body is in; what follows is the disconnect watch
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        tracked_send = TrackedSend(send)
        try:
            await self.app(scope, timed_receive, tracked_send)
        except ClientDisconnect:
            if not timed_out:
                logger.info(
                    "%s %s from %s: client disconnected before its request body arrived",
                    scope["method"],
                    scope["path"],
                    _client(scope),
                )
                return
        if timed_out:
            logger.info(
                "%s %s from %s: request body not received within read_timeout_s=%g "
                "s; connection closed",
                scope["method"],
                scope["path"],
                _client(scope),
                self.read_timeout_s,
            )
            if not tracked_send.started:
                await send_error(
                    send,
                    408,
                    f"The request body did not arrive within {self.read_timeout_s:g} s",
                    "request_timeout",
                    close=True,
                )


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


def uvicorn_config(app: ASGIApp, config: ServerConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for `config`: its log level, the timeouts, the request head's bounds,
    the shutdown grace."""
    settings: dict[str, Any] = dict(
        log_level=config.log_level,
        access_log=config.access_log,
        http=request_head_protocol(config),
        # h11's own bound on a head (16 KiB by default, refused with 400): the same as ours
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=config.keep_alive_timeout_s,
        timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,
    )
    settings.update(options)
    return uvicorn.Config(app, **settings)


class Server(uvicorn.Server):
    """uvicorn's server with a bounded graceful shutdown (see the module's docstring). A second
    signal stops at once, as with uvicorn."""

    def __init__(
        self, config: uvicorn.Config, serving: ServingEngine, shutdown_timeout_s: float
    ) -> None:
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout_s = shutdown_timeout_s
        self.shutdown_started = False
        self.aborted_at_shutdown: int | None = None  # requests aborted at the deadline
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn records the signal to raise it again once shut down, which ends the process
        # by that signal; a drained shutdown is an orderly exit (status 0), so it is not.
        if self.shutdown_started:
            self.force_exit = self.should_exit = True
            return
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Begin the graceful shutdown; callable from any thread."""
        if self.shutdown_started:
            return
        self.shutdown_started = True
        if self._loop is None or self._loop.is_closed():
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        serving, timeout = self.serving, self.shutdown_timeout_s
        try:
            serving.stop_admitting()
            logger.info(
                "shutting down: no new requests admitted; %d sequences in flight get "
                "up to shutdown_timeout_s=%g s to finish",
                serving.in_flight,
                timeout,
            )
            if not await serving.wait_idle(timeout):
                reason = (
                    f"the server is shutting down: the request did not finish within "
                    f"shutdown_timeout_s={timeout:g} s"
                )
                self.aborted_at_shutdown = 0
                flush_deadline = time.monotonic() + ABORT_FLUSH_S
                # again while some remain: a request admitted just before the drain may reach
                # the engine only after the first abort
                while time.monotonic() < flush_deadline:
                    self.aborted_at_shutdown += await serving.abort_all(reason)
                    if await serving.wait_idle(0.25):
                        break
                logger.warning(
                    "shutting down: aborted %d requests still running after %g s",
                    self.aborted_at_shutdown,
                    timeout,
                )
        finally:
            self.should_exit = True
