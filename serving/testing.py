"""A real uvicorn server on a free loopback port, in a background thread: for tests and
benchmarks that talk HTTP to the server while inspecting its engine.

    with serve_in_thread(backend) as server:
        httpx.get(f"{server.base_url}/health")
        server.serving.engine.kv   # the engine behind it (read it only while it is idle)
        server.server.request_shutdown()   # SIGTERM's graceful shutdown, from a test

The server is the one `inferlab serve` runs (serving/lifecycle.py: timeouts, graceful
shutdown), minus the signal handlers, which only the main thread can install.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from serving.app import create_app
from serving.config import ServerConfig
from serving.generation import ServingEngine
from serving.lifecycle import Server, bind_socket, uvicorn_config


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    app: FastAPI
    server: Server
    thread: threading.Thread

    @property
    def serving(self) -> ServingEngine:
        return self.app.state.serving


@contextmanager
def serve_in_thread(
    backend: BuiltinBackend,
    config: ServerConfig | None = None,
    startup_timeout_s: float = 30.0,
    **uvicorn_options: Any,
) -> Iterator[RunningServer]:
    """Serve `backend` (loaded) until the block ends, then shut down as on SIGTERM; the backend
    stays open afterwards (its engine thread too). `uvicorn_options` override uvicorn's
    settings (e.g. `http=` another protocol class)."""
    config = config or ServerConfig()
    app = create_app(backend, config)
    sock = bind_socket("127.0.0.1", 0)  # the OS picks a free port; no race with other tests
    port = sock.getsockname()[1]
    server = Server(
        uvicorn_config(
            app,
            config,
            **{"log_level": "warning", "access_log": False, "lifespan": "off", **uvicorn_options},
        ),
        app.state.serving,
        config.shutdown_timeout_s,
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="inferlab-serve", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server thread did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app, server, thread)
    finally:
        server.request_shutdown()
        thread.join(timeout=config.shutdown_timeout_s + 30)
        app.state.serving.close()
        sock.close()


@contextmanager
def serve_engine(
    options: dict[str, Any], config: ServerConfig | None = None, model: str = "tiny"
) -> Iterator[RunningServer]:
    """A built-in engine of `model` with engine `options`, loaded and served in a thread
    (serve_in_thread) until the block ends; then closed."""
    backend = BuiltinBackend(EngineConfig.from_dict({"model": model, **options}))
    backend.load()
    try:
        with serve_in_thread(backend, config) as running:
            yield running
    finally:
        backend.close()


ROOT = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(r"^inferlab serve: .* on (http://\S+):(\d+)/v1$", re.MULTILINE)


@dataclass
class ServeProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path  # the server's stdout and stderr

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve_process(
    args: list[str], log: Path, startup_timeout_s: float = 300.0
) -> Iterator[ServeProcess]:
    """`inferlab serve ARGS port=0` in a process of its own, its output in `log`, healthy when
    the block starts; killed at the end if still running. The port is the one it printed."""
    command = [sys.executable, "-m", "harness.cli", "serve", *args, "port=0"]
    with serve_command(command, log, startup_timeout_s) as process:
        yield process


@contextmanager
def serve_command(
    command: list[str], log: Path, startup_timeout_s: float = 300.0
) -> Iterator[ServeProcess]:
    """A server process that prints `inferlab serve: ... on http://HOST:PORT/v1` once it
    listens (`inferlab serve`, serving/scripted_server.py): as serve_process."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while (match := _LISTENING.search(log.read_text(errors="replace"))) is None:
            if process.poll() is not None:
                raise RuntimeError(
                    f"inferlab serve exited with {process.returncode}:\n"
                    f"{log.read_text(errors='replace')}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("inferlab serve did not start in time")
            time.sleep(0.1)
        base_url = f"{match.group(1)}:{match.group(2)}"
        wait_until_answering(process, f"{base_url}/health", deadline, "inferlab serve", log)
        yield ServeProcess(process, base_url, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def wait_until_answering(
    process: subprocess.Popen[Any], url: str, deadline: float, name: str, log: Path
) -> None:
    """Poll GET `url` until it answers 200. The server's process exiting, or the monotonic
    `deadline` passing, raises RuntimeError with `name` and the server's log."""
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{name} did not answer GET {url} (exit status {process.poll()}):\n"
                f"{log.read_text(errors='replace')}"
            )
        time.sleep(0.1)
