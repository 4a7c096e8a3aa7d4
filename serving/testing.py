"""A real uvicorn server on a free loopback port, in a background thread: for tests and
benchmarks that talk HTTP to the server while inspecting its engine.

    with serve_in_thread(backend) as server:
        httpx.get(f"{server.base_url}/health")
        server.serving.engine.kv   # the engine behind it (read it only while it is idle)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from engines.builtin.backend import BuiltinBackend
from serving.app import create_app
from serving.config import ServerConfig
from serving.generation import ServingEngine


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    app: FastAPI

    @property
    def serving(self) -> ServingEngine:
        return self.app.state.serving


@contextmanager
def serve_in_thread(backend: BuiltinBackend, config: ServerConfig | None = None,
                    startup_timeout_s: float = 30.0) -> Iterator[RunningServer]:
    """Serve `backend` (loaded) until the block ends; the backend stays open afterwards."""
    app = create_app(backend, config)
    # proto=IPPROTO_TCP matters: asyncio turns Nagle off (TCP_NODELAY) only on connections
    # whose socket says so, and Nagle with delayed ACKs holds each SSE chunk back ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; no race with other tests
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="inferlab-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server thread did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
