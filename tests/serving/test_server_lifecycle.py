"""The server's life around requests (serving/lifecycle.py): client disconnects cost one log
line each and leak nothing; half-sent requests are dropped after `read_timeout_s`; SIGTERM
stops admitting, lets requests finish for `shutdown_timeout_s`, aborts the rest with a final
SSE error event, frees their KV memory and exits 0; startup errors are one line naming the file
or port, exit 2. The real `inferlab serve` in a subprocess where the log or the signal matter,
model=tiny."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from checkpoints import write_tiny_checkpoint

from engines.builtin import EngineConfig
from engines.builtin.backend import BuiltinBackend
from engines.builtin.distributed.group import TensorParallelError
from engines.builtin.kv_cache import PagedKVCacheManager
from serving import ServerConfig
from serving import cli as serve_cli
from serving.testing import ServeProcess, serve_in_thread, serve_process

# slow: `make test-fast` leaves it out; serial: its timings run alone (Makefile's `test`)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

READ_TIMEOUT_S = 1.0
SHUTDOWN_TIMEOUT_S = 1.0
SERVE_ARGS = [
    "model=tiny",
    "engine.kv_cache=paged",
    "engine.kv_cache_memory_bytes=16777216",
    "engine.max_model_len=1024",
    "engine.device=cpu",
    "engine.num_threads=1",
    f"read_timeout_s={READ_TIMEOUT_S}",
    f"shutdown_timeout_s={SHUTDOWN_TIMEOUT_S}",
    "keep_alive_timeout_s=1",
    "log_level=info",
]
SLACK_S = 5.0  # scheduling slack on a busy 2-core machine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One `inferlab serve` for the module; the SIGTERM test (last) ends it."""
    with serve_process(SERVE_ARGS, tmp_path_factory.mktemp("serve") / "server.log") as process:
        yield process


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        name: float(value) for name, value in re.findall(r"^([a-z_]+) (\S+)$", text, re.MULTILINE)
    }


def wait_for(condition: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def http_request(path: str, payload: dict[str, Any] | None = None) -> bytes:
    body = b"" if payload is None else json.dumps(payload).encode()
    method = "GET" if payload is None else "POST"
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def open_stream(
    address: tuple[str, int],
    payload: dict[str, Any],
    chunks: int,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A raw streaming request, read until `chunks` SSE events arrived."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(http_request("/v1/completions", {**payload, "stream": True}))
    received = b""
    while received.count(b"data: ") < chunks:
        data = await asyncio.wait_for(reader.read(65536), 60)
        assert data, received
        received += data
    return reader, writer, received


def address_of(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


# ---- disconnects ----------------------------------------------------------------------------


def test_disconnects_log_one_line_each_no_traceback_no_leak(served: ServeProcess) -> None:
    address = address_of(served.base_url)
    long = {"prompt": "Tell a long story.", "max_tokens": 900, "ignore_eos": True}
    num_streams, num_plain = 20, 10
    before = metrics(served.base_url)

    async def run() -> None:
        streams = await asyncio.gather(*(open_stream(address, long, 2) for _ in range(num_streams)))
        plain = []
        for _ in range(num_plain):
            reader, writer = await asyncio.open_connection(*address)
            writer.write(http_request("/v1/completions", long))
            plain.append((reader, writer))
        # every request is generating (past admission, in the engine) before its client leaves
        running = await asyncio.to_thread(
            wait_for,
            lambda: (
                (m := metrics(served.base_url))["inferlab_num_requests_running"]
                + m["inferlab_num_requests_waiting"]
                == num_streams + num_plain
            ),
        )
        assert running, metrics(served.base_url)
        for _, writer, *_ in [*streams, *plain]:
            writer.close()

    asyncio.run(run())
    total = num_streams + num_plain
    assert wait_for(
        lambda: (
            metrics(served.base_url)["inferlab_requests_aborted_total"]
            - before["inferlab_requests_aborted_total"]
            == total
        )
    ), metrics(served.base_url)
    assert wait_for(
        lambda: (
            (m := metrics(served.base_url))["inferlab_num_requests_admitted"]
            == m["inferlab_num_requests_running"]
            == m["inferlab_num_requests_waiting"]
            == m["inferlab_kv_cache_reserved_bytes"]
            == 0
        )
    ), metrics(served.base_url)
    log = served.log_text()
    assert "Traceback" not in log, log
    assert "ERROR" not in log, log
    lines = [line for line in log.splitlines() if "client disconnected after" in line]
    assert len(lines) == total, log
    assert all(line.startswith("INFO:") for line in lines), lines
    assert httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200


# ---- half-sent requests ----------------------------------------------------------------------


def closed_after(address: tuple[str, int], send: bytes, wait_s: float) -> tuple[float, bytes]:
    """Send `send`, then read until the server closes the connection: (seconds, bytes read)."""
    with socket.create_connection(address, timeout=wait_s) as sock:
        started = time.monotonic()
        sock.sendall(send)
        received = b""
        while data := sock.recv(65536):
            received += data
        return time.monotonic() - started, received


@pytest.mark.parametrize(
    ("what", "send"),
    [
        ("nothing", b""),
        ("half the headers", b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Le"),
        ("headers, half the body", http_request("/v1/completions", {"prompt": "hello there"})[:-8]),
    ],
)
def test_half_sent_requests_are_dropped_after_read_timeout(
    served: ServeProcess, what: str, send: bytes
) -> None:
    # before: the server held such a connection for good (socket.timeout here)
    elapsed, received = closed_after(address_of(served.base_url), send, 30.0)
    assert READ_TIMEOUT_S * 0.9 <= elapsed <= READ_TIMEOUT_S + SLACK_S, (what, elapsed)
    if what.startswith("headers"):  # the app saw the request: it answers 408, then closes
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), received
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
    else:
        assert received == b""
    assert httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("base", ["h11", "httptools"])
def test_header_and_body_deadlines_with_either_http_parser(base: str) -> None:
    """uvicorn runs httptools' parser when installed, else h11's; the deadlines hold on both."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from serving.request_head import request_head_protocol

    if base == "httptools":
        pytest.importorskip("httptools")  # the dev environment has it (through guidellm)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as protocol
    else:
        protocol = H11Protocol
    backend = BuiltinBackend(
        EngineConfig.from_dict({"model": "tiny", "device": "cpu", "max_model_len": 128})
    )
    backend.load()
    config = ServerConfig(read_timeout_s=READ_TIMEOUT_S)
    try:
        with serve_in_thread(
            backend, config, http=request_head_protocol(config, protocol)
        ) as running:
            address = address_of(running.base_url)
            elapsed, received = closed_after(address, b"GET /health HTTP/1.1\r\nHo", 30.0)
            assert received == b"" and elapsed <= READ_TIMEOUT_S + SLACK_S
            elapsed, received = closed_after(
                address, http_request("/v1/completions", {"prompt": "hi"})[:-4], 30.0
            )
            assert received.startswith(b"HTTP/1.1 408 ") and elapsed <= READ_TIMEOUT_S + SLACK_S
            # a whole request on a kept-alive connection is not cut: the deadline is per part
            with socket.create_connection(address, timeout=30) as sock:
                for _ in range(3):
                    sock.sendall(http_request("/health"))
                    response = b""
                    while not response.endswith(b'{"status":"ok"}'):
                        response += sock.recv(65536)
                    time.sleep(READ_TIMEOUT_S * 0.6)
    finally:
        backend.close()


def test_idle_keep_alive_connection_is_closed(served: ServeProcess) -> None:
    with socket.create_connection(address_of(served.base_url), timeout=30) as sock:
        sock.sendall(http_request("/health"))
        response = b""
        while not response.endswith(b'{"status":"ok"}'):
            response += sock.recv(65536)
        assert response.startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert sock.recv(65536) == b""  # keep_alive_timeout_s=1 closes it
        assert time.monotonic() - started <= 1 + SLACK_S


# ---- graceful shutdown --------------------------------------------------------------------------


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a chunked SSE response (chunk sizes dropped)."""
    return [
        line.removeprefix("data: ")
        for line in raw.decode(errors="replace").splitlines()
        if line.startswith("data: ")
    ]


def test_drain_finishes_short_requests_aborts_long_ones_frees_kv() -> None:
    backend = BuiltinBackend(
        EngineConfig.from_dict(
            {
                "model": "tiny",
                "dtype": "float32",
                "device": "cpu",
                "max_model_len": 1024,
                "kv_cache": "paged",
                "kv_cache_memory_bytes": 16 << 20,
            }
        )
    )
    backend.load()
    engine_step = backend.engine.step

    def slow_step() -> Any:  # >= 20 ms a step: the short stream is still running at SIGTERM
        time.sleep(0.02)
        return engine_step()

    backend.engine.step = slow_step  # type: ignore[method-assign]
    long = {"prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True}
    short = {"prompt": "Be brief.", "max_tokens": 40, "ignore_eos": True}
    try:
        with serve_in_thread(backend, ServerConfig(shutdown_timeout_s=4.0)) as running:
            address = address_of(running.base_url)

            async def run() -> tuple[bytes, bytes, bytes, list[httpx.Response]]:
                # (the writers are kept: a collected StreamWriter closes its connection)
                long_reader, long_writer, long_head = await open_stream(address, long, 1)
                short_reader, short_writer, short_head = await open_stream(address, short, 1)
                async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as client:
                    plain = asyncio.ensure_future(client.post("/v1/completions", json=long))
                    assert await asyncio.to_thread(
                        wait_for, lambda: running.serving.engine_thread.stats.num_running == 3
                    )
                    running.server.request_shutdown()
                    assert await asyncio.to_thread(wait_for, lambda: running.serving.draining)
                    refused = await client.post("/v1/completions", json=short)
                    health = await client.get("/health")
                    rest = await asyncio.gather(long_reader.read(), short_reader.read())
                    cut = await plain
                long_writer.close()
                short_writer.close()
                return (
                    long_head + rest[0],
                    short_head,
                    short_head + rest[1],
                    [refused, health, cut],
                )

            long_raw, short_head, short_raw, (refused, health, cut) = asyncio.run(run())
            running.thread.join(30)
            assert not running.thread.is_alive()
        # admission closed at once: 503 with OpenAI's body, and /health says so
        for response in (refused, health):
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "server_shutting_down"
            assert response.headers["retry-after"] == "1"
        # the long non-streaming request was cut at the deadline: 503 with the reason
        assert cut.status_code == 503, cut.text
        assert cut.json()["error"]["code"] == "server_shutting_down"
        assert "shutdown_timeout_s=4" in cut.json()["error"]["message"]
        # the short stream, still running at the signal, finished normally
        short_events = sse_events(short_raw)
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert len(short_events) - 2 - len(sse_events(short_head)) >= 20
        # the long one was cut at the deadline with a final error event, then [DONE]
        long_events = sse_events(long_raw)
        assert long_events[-1] == "[DONE]"
        error = json.loads(long_events[-2])["error"]
        assert (error["type"], error["code"]) == ("server_error", "server_shutting_down")
        assert "shutdown_timeout_s=4" in error["message"]
        assert running.server.aborted_at_shutdown == 2
        # and its KV memory is back
        engine = running.serving.engine
        assert wait_for(lambda: not engine.has_unfinished_requests())
        kv = engine.kv
        assert isinstance(kv, PagedKVCacheManager)
        assert kv.pool.num_in_use == 0 and engine.sequences == {}
        assert running.serving.in_flight == 0
    finally:
        backend.close()


def test_the_request_the_engine_dies_under_gets_the_503_of_a_failed_engine() -> None:
    # a tensor-parallel rank dying mid-step, as the engine sees it (its step raises
    # EngineDeadError and keeps the reason): that request, the next ones and /health all get
    # 503 engine_failed
    backend = BuiltinBackend(
        EngineConfig.from_dict({"model": "tiny", "device": "cpu", "max_model_len": 128})
    )
    backend.load()
    engine = backend.engine
    assert engine is not None

    def rank_lost(*args: Any) -> Any:
        raise TensorParallelError("tensor-parallel all-reduce failed: rank 1 killed by SIGKILL")

    engine.runner.execute = rank_lost  # type: ignore[method-assign]
    payload = {"prompt": "hello", "max_tokens": 4}
    try:
        with (
            serve_in_thread(backend, ServerConfig()) as running,
            httpx.Client(base_url=running.base_url, timeout=30) as client,
        ):
            responses = [
                client.post("/v1/completions", json=payload),
                client.post("/v1/completions", json=payload),
                client.get("/health"),
            ]
    finally:
        backend.close()
    for response in responses:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_failed"
        assert "rank 1 killed by SIGKILL" in error["message"]


def test_sigterm_with_30_streams_exits_0_within_shutdown_timeout(served: ServeProcess) -> None:
    """Last in the module: it ends the shared server."""
    address = address_of(served.base_url)
    long = {"prompt": "Tell a long story.", "max_tokens": 900, "ignore_eos": True}

    async def run() -> tuple[list[bytes], float, int, float]:
        streams = await asyncio.gather(*(open_stream(address, long, 1) for _ in range(30)))
        sent = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        raws = await asyncio.gather(*(reader.read() for reader, _, _ in streams))
        streams_done = time.monotonic() - sent
        returncode = await asyncio.to_thread(served.process.wait, 60)
        exited = time.monotonic() - sent
        return (
            [head + raw for (_, _, head), raw in zip(streams, raws, strict=True)],
            streams_done,
            returncode,
            exited,
        )

    raws, streams_done, returncode, exited = asyncio.run(run())
    log = served.log_text()
    print(
        f"\nSIGTERM with 30 streams in flight: streams ended after {streams_done:.2f} s, "
        f"the process exited after {exited:.2f} s (shutdown_timeout_s={SHUTDOWN_TIMEOUT_S})"
    )
    assert returncode == 0, log
    assert SHUTDOWN_TIMEOUT_S <= exited <= SHUTDOWN_TIMEOUT_S + SLACK_S + 5, log
    for raw in raws:
        events = sse_events(raw)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down", error
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert "aborted 30 requests still running" in log, log
    assert "Traceback" not in log, log


# ---- startup errors --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (dummy weights, the project tokenizer) in Hugging Face layout."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def broken_copy(checkpoint: Path, tmp_path: Path, file: str, content: bytes | None) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for item in checkpoint.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    if content is None:
        (folder / file).unlink()
    else:
        (folder / file).write_bytes(content)
    return folder


def test_the_good_checkpoint_loads(checkpoint: Path) -> None:
    """The broken copies below differ from this one only in the file each breaks."""
    backend, _ = serve_cli.build_backend(
        ["model=hf", f"model.path={checkpoint}", "engine.device=cpu"]
    )
    backend.load()
    backend.close()


@pytest.mark.parametrize(
    ("file", "content", "says"),
    [
        ("model.safetensors", b"not a safetensors file" * 8, "not a readable safetensors file"),
        ("model.safetensors", b"", "not a readable safetensors file"),
        ("config.json", None, "no config.json"),
        ("config.json", b"{not json", "not valid JSON"),
        ("config.json", b"[1, 2]", "expected a JSON object, got list"),
        ("tokenizer.json", None, "is missing"),
        ("tokenizer.json", b"{broken", "is not a valid tokenizer.json"),
    ],
)
def test_startup_error_is_one_line_naming_the_file(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    file: str,
    content: bytes | None,
    says: str,
) -> None:
    folder = broken_copy(checkpoint, tmp_path, file, content)
    assert serve_cli.main(["model=hf", f"model.path={folder}", "engine.device=cpu", "port=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("inferlab serve: "), err
    assert str(folder / file) in err and says in err, err


def test_startup_error_for_a_missing_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    assert serve_cli.main(["model=hf", f"model.path={missing}", "port=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"model.path: {missing} does not exist" in err, err


def test_startup_error_for_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert serve_cli.main(["model=tiny", f"port={port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"port: cannot listen on 127.0.0.1:{port}: Address already in use" in err, err
    assert time.monotonic() - started < 30  # before the model loads
