"""The server a run measures when `engine.launch.command` is set: started (or taken over from
the previous run, server_keeper.py) when the backend loads, handed back when it closes.

    launched = LaunchedServer.start(config.launch, fields, log)
    launched.base_url          # http://HOST:PORT/v1, what the requests go to
    launched.failure()         # why it can serve no more requests (it exited), or None
    launched.describe()        # its command, version, start-up time, reuse: summary.json
    launched.release()         # kept for the next run (engine.launch.reuse), else stopped
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engines.openai import server_keeper
from engines.openai.launch_config import LaunchConfig, environment, server_command
from engines.openai.server_process import ServerProcess, ServerStartError
from models.location import model_location
from models.packaged import DERIVED_MODELS, PACKAGED_MODELS, PackagedModelMissingError

logger = logging.getLogger(__name__)  # `log` is the server log's path below

SERVER_LOG = "server.log"  # in the run folder: the server's output during the run


#: how long a server that stopped answering may take to exit before a run is told it lives
EXIT_GRACE_S = 5.0


def template_fields(served_model: str | None, model: dict[str, Any]) -> dict[str, Any]:
    """The command template's fields (launch_config.TEMPLATE_FIELDS) but host and port."""
    return {
        "python": sys.executable,
        "model": model.get("path") or model.get("name"),
        "model_name": model.get("name"),
        "model_path": model.get("path"),
        "model_file": _model_file(model),
        "served_model_name": served_model,
        "threads": _cores(),
    }


def _cores() -> int:
    """The cores this process may run on: a launcher's placement, inherited by the server."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _model_file(model: dict[str, Any]) -> str | None:
    """model.path, else the file a packaged model installed (models/packaged.py), else None."""
    if model.get("path"):
        return str(model["path"])
    name = model.get("name")
    if name in PACKAGED_MODELS or name in DERIVED_MODELS:
        try:
            return model_location(name)
        except PackagedModelMissingError:
            return None
    return None


def free_port(host: str) -> int:
    """A port free on `host`; ServerStartError naming engine.launch.host when nothing can listen
    there (an address of another machine, a name that does not resolve)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        try:
            sock.bind((host, 0))
        except OSError as exc:  # socket.gaierror, too
            raise ServerStartError(
                f"engine.launch.host: cannot listen on {host!r} ({exc}); allowed: an address "
                "of this machine, e.g. 127.0.0.1, 0.0.0.0, ::1"
            ) from exc
        port: int = sock.getsockname()[1]
        return port


def _url_host(host: str) -> str:
    """Where a client reaches a server listening on `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@dataclass
class LaunchedServer:
    launch: LaunchConfig
    key: server_keeper.ServerKey
    server: ServerProcess
    reused: bool
    version: str | None
    version_error: str | None = None

    @property
    def base_url(self) -> str:
        return f"{self.server.root}/v1"

    @classmethod
    def start(
        cls, launch: LaunchConfig, fields: dict[str, Any], log: Path | None
    ) -> LaunchedServer:
        """The server for this run: the kept one when it is the same, else a new one, ready.
        ServerStartError (its log's last lines in the message) when it could not be."""
        env = environment(launch.env)
        fields = {**fields, "host": launch.host, "threads": launch.threads or fields["threads"]}
        key = server_keeper.server_key(server_command(launch, {**fields, "port": "{port}"}), env)
        server = server_keeper.acquire(key, lambda kept: _reset(kept, launch))
        if server is not None:
            try:
                server.log_to(log)
            except OSError as exc:  # taken from the keeper: no one else would stop it
                server.stop(launch.stop_timeout_s)
                raise ServerStartError(f"the server's log {log} cannot be written: {exc}") from exc
            return cls(launch, key, server, True, server.version)
        port = launch.port or free_port(launch.host)
        command = server_command(launch, {**fields, "port": port})
        root = f"http://{_url_host(launch.host)}:{port}"
        server = ServerProcess.start(command, root, env, log)
        try:
            server.wait_ready(launch.health_path, launch.startup_timeout_s, launch.stop_timeout_s)
        except BaseException:  # Ctrl-C while it starts, too: no server left behind
            server.stop(launch.stop_timeout_s)
            raise
        launched = cls(launch, key, server, False, None)
        server.version, launched.version_error = _version(server, launch)
        launched.version = server.version
        return launched

    def failure(self) -> str | None:
        if self.server.exit_status() is None and not self.server.answers(
            self.server.root + self.launch.health_path
        ):
            # a killed server's sockets close before it can be reaped: its clients' requests
            # may all have failed before its exit shows
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.process.wait(timeout=EXIT_GRACE_S)
        if self.server.exit_status() is None:
            return None
        return self.server.exited_error("during the run")

    def release(self) -> None:
        server_keeper.release(self.key, self.server, self.launch.reuse, self.launch.stop_timeout_s)

    def describe(self) -> dict[str, Any]:
        return {
            "command": shlex.join(self.server.command),
            "params": dict(self.launch.params),
            "version": self.version,
            "version_error": self.version_error,
            "pid": self.server.pid,
            "cores": self.server.cores,  # it inherited them from the job's placement
            # start until its health check answered (the first run of a reused server)
            "startup_s": self.server.ready_s,
            "reused": self.reused,
            "exit_status": self.server.exit_status(),
            "log": SERVER_LOG,
        }


def _reset(server: ServerProcess, launch: LaunchConfig) -> bool:
    """Is the kept server fit for another run: healthy, and its caches emptied where the
    preset knows how (vLLM's POST /reset_prefix_cache)? A failure starts a new one."""
    if not server.answers(server.root + launch.health_path):
        return False
    if launch.reset_path is None:
        return True
    try:
        server.read_json(launch.reset_path, method="POST")
    except (httpx.HTTPError, ValueError) as exc:
        # said, else a wrong reset_path silently cold-starts the server for every job
        logger.warning(
            "engine.launch.reset_path: POST %s failed (%s); a new server is started",
            launch.reset_path,
            str(exc).splitlines()[0],
        )
        return False
    return True


def _version(server: ServerProcess, launch: LaunchConfig) -> tuple[str | None, str | None]:
    """The version the server reports at launch.version_path, or why there is none."""
    if launch.version_path is None:
        return None, "not asked (engine.launch.version_path=null)"
    try:
        data = server.read_json(launch.version_path)
    except (httpx.HTTPError, ValueError) as exc:
        return None, f"GET {launch.version_path}: {exc}"
    value: Any = data
    for part in launch.version_field.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return None, f"GET {launch.version_path}: no field {launch.version_field!r}"
    return str(value), None
