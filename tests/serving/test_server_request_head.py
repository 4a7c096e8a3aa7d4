"""Bounds on a request's head: a request line and headers over `max_header_bytes` get 431 after
at most that many bytes were fed to the HTTP parser (serving/request_head.py), more than
`max_header_count` header fields get 431 (serving/limits.py), on either of uvicorn's parsers;
heads within the bounds are served as before, on fresh, kept-alive and pipelined connections.
Raw sockets: no HTTP client sends such heads."""

from __future__ import annotations

import json
import re
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from engines.builtin import EngineConfig
from engines.builtin.backend import BuiltinBackend
from serving import ServerConfig
from serving.request_head import request_head_protocol
from serving.testing import RunningServer, serve_in_thread

MAX_BYTES = ServerConfig().max_header_bytes
MAX_COUNT = ServerConfig().max_header_count


def recording(base: type[Any]) -> tuple[type[Any], Counter[int]]:
    """`base` counting the bytes uvicorn's protocol (and so its parser) is given, per client
    port."""
    fed: Counter[int] = Counter()

    class Recording(base):  # type: ignore[valid-type, misc]
        def data_received(self, data: bytes) -> None:
            fed[self.client[1]] += len(data)
            super().data_received(data)

    return Recording, fed


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[RunningServer, Counter[int]]]:
    """A server with the default bounds on the parser named by the parameter."""
    if request.param == "httptools":
        base: type[Any] = pytest.importorskip(
            "uvicorn.protocols.http.httptools_impl"
        ).HttpToolsProtocol
    else:
        base = H11Protocol
    protocol, fed = recording(base)
    backend = BuiltinBackend(
        EngineConfig.from_dict({"model": "tiny", "device": "cpu", "max_model_len": 128})
    )
    backend.load()
    config = ServerConfig(read_timeout_s=60)  # a head refused is answered, not timed out
    try:
        with serve_in_thread(backend, config, http=request_head_protocol(config, protocol)) as s:
            yield s, fed
    finally:
        backend.close()


def exchange(server: RunningServer, data: bytes, pieces: int = 1) -> tuple[bytes, int]:
    """Send `data` (in `pieces` sends) on a fresh connection and read until the server closes
    it: (what came back, the client's port). The server may close while the rest is still
    being sent (it reads no further), so a reset is part of the answer."""
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        client_port = sock.getsockname()[1]
        step = -(-len(data) // pieces)
        try:
            for i in range(0, len(data), step):
                sock.sendall(data[i : i + step])
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received, client_port


def get(headers: list[bytes]) -> bytes:
    return b"GET /health HTTP/1.1\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


def head_of(size: int) -> bytes:
    """A GET whose request line and headers are exactly `size` bytes."""
    bare = get([b"Host: test", b"Connection: close", b"X-Pad: "])
    return get([b"Host: test", b"Connection: close", b"X-Pad: " + b"a" * (size - len(bare))])


def statuses(received: bytes) -> list[int]:
    """The status of each response in `received` (responses follow each other directly)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


def assert_refused(received: bytes, *words: str) -> None:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), received[:200]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "headers_too_large")
    for word in words:
        assert word in error["message"], error["message"]


def test_a_head_over_max_header_bytes_gets_431_unread(
    server: tuple[RunningServer, Counter[int]],
) -> None:
    # before: a 1 MB header was read whole and answered 200 (100 MB: 20 s, +150 MB)
    running, fed = server
    huge = get([b"Host: test", b"X-Big: " + b"a" * (1 << 20), b"Connection: close"])
    for pieces in (1, 64):  # at once, and in 16 KiB sends: the bound is on the whole head
        received, port = exchange(running, huge, pieces)
        assert_refused(received, f"over {MAX_BYTES} bytes", "max_header_bytes")
        assert fed[port] <= MAX_BYTES  # the rest was never read into the parser
    # the bound is exact: a head of MAX_BYTES is served, one more byte is not
    assert statuses(exchange(running, head_of(MAX_BYTES))[0]) == [200]
    assert_refused(exchange(running, head_of(MAX_BYTES + 1))[0], "max_header_bytes")
    # so is a long request line
    assert_refused(exchange(running, b"GET /" + b"a" * MAX_BYTES + b" HTTP/1.1\r\n")[0])


def test_more_than_max_header_count_fields_get_431(
    server: tuple[RunningServer, Counter[int]],
) -> None:
    # before: 10,000 small headers were served (200)
    running, _ = server
    many = [b"Host: test", b"Connection: close"]
    at_limit = many + [b"X-%d: y" % i for i in range(MAX_COUNT - len(many))]
    assert statuses(exchange(running, get(at_limit))[0]) == [200]
    assert_refused(
        exchange(running, get([*at_limit, b"X-last: y"]))[0],
        f"{MAX_COUNT + 1} header fields",
        f"at most {MAX_COUNT} (the server option max_header_count)",
    )
    tiny = [b"Host: test"] + [b"X:"] * 9_999  # 10,000 fields within max_header_bytes
    assert len(get(tiny)) < MAX_BYTES
    assert_refused(exchange(running, get(tiny))[0], "10000 header fields")
    numbered = [b"Host: test"] + [b"X-%d: y" % i for i in range(9_999)]  # over the size too
    assert_refused(exchange(running, get(numbered))[0])


def test_heads_within_the_bounds_are_served_as_before(
    server: tuple[RunningServer, Counter[int]],
) -> None:
    running, _ = server
    # a small head with a body past max_header_bytes, in one send: the body is not the head's
    body = b'{"prompt": "Hi", "max_tokens": 1' + b" " * (2 * MAX_BYTES) + b"}"
    post = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    received, _ = exchange(running, post)
    assert statuses(received) == [200], received[:300]
    # each request of a kept-alive or pipelined connection has the whole bound: three heads
    # of almost MAX_BYTES in one send are three answers
    near = head_of(MAX_BYTES - 100).replace(b"Connection: close", b"Connection: keep-alive")
    received, _ = exchange(running, near + near + head_of(MAX_BYTES))
    assert statuses(received) == [200, 200, 200]
