"""One server process that a run started: in a session and process group of its own, its output
streamed to a log file, ready once its health check answers 200, stopped with SIGTERM to the
whole group and, after a grace period, SIGKILL, until no process of the group is left.

The server is started through a few lines of Python that ask Linux to send it SIGTERM when the
process that started it dies (`prctl(PR_SET_PDEATHSIG)`), then exec the command: a harness
killed with SIGKILL leaves no server behind. Linux ties that signal to the thread that started
the server, so servers are started from the main thread or from one that lives as long as the
process (`_popen`). Its own children (vLLM's engine processes) are in its group, which `stop`
ends; after a SIGKILL of the harness they rely on the server's own handling of its death.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from engines.base import now_ns

TAIL_LINES = 20  # of the server's log, in the error of a server that failed
_KEPT_LINES = 200
# Of one line of the tail: a server that writes megabytes without a newline (a progress bar,
# a dump) would otherwise put all of it in the job's error, summary.json and the terminal.
_KEPT_LINE_CHARS = 2000

# Runs as `python -c GUARD PARENT_PID COMMAND...`: the death signal is set, then the parent
# checked (it may have died before), then the command replaces this process.
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "prctl = getattr(ctypes.CDLL(None), 'prctl', None)\n"
    "if prctl is not None: prctl(1, signal.SIGTERM)\n"  # 1: PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class ServerStartError(RuntimeError):
    """The server could not be started, exited, or never answered its health check; the
    message ends with the last lines of its log."""


def group_alive(pgid: int) -> bool:
    """Is any process of process group `pgid` left?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of the group we cannot signal: still there
        return True
    return True


@dataclass
class ServerProcess:
    command: list[str]
    root: str  # http://HOST:PORT
    process: subprocess.Popen[bytes]
    started_ns: int
    ready_s: float | None = None  # start until the health check answered
    version: str | None = None  # as the server reported it, once asked
    cores: list[int] | None = None  # the CPU cores it may run on (None: not known here)
    _lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_KEPT_LINES)
    )
    _sink: IO[bytes] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pump: threading.Thread | None = None

    @classmethod
    def start(
        cls, command: list[str], root: str, env: dict[str, str | None], log: Path | None
    ) -> ServerProcess:
        """Start `command` (ServerStartError when its program is not found), its output into
        `log`; `env` is added to this process's environment (a None removes the variable)."""
        if not command:
            raise ServerStartError("engine.launch.command: empty")
        environ = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
        for name in [k for k, v in env.items() if v is None]:
            environ.pop(name, None)
        # looked up on the PATH the server gets: engine.launch.env.PATH may add its folder
        if shutil.which(command[0], path=environ.get("PATH", os.defpath)) is None:
            raise ServerStartError(
                f"engine.launch.command: {command[0]!r} is not an executable on PATH "
                "(is the server installed in this environment?)"
            )
        # the log opened before the server starts: a log that cannot be written (a full or
        # read-only disk, a folder in its place) must not leave a started server behind
        try:
            sink = log.open("ab") if log is not None else None
        except OSError as exc:
            raise ServerStartError(f"the server's log {log} cannot be written: {exc}") from exc
        try:
            process = _popen(
                [sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *command], environ
            )
        except BaseException:
            if sink is not None:
                sink.close()
            raise
        server = cls(command, root, process, now_ns(), cores=_cores_of(process.pid), _sink=sink)
        server._pump = threading.Thread(target=server._copy_output, daemon=True, name="server-log")
        server._pump.start()
        return server

    # ---- its output ---------------------------------------------------------------------------

    def _copy_output(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, b""):
            text = line[:_KEPT_LINE_CHARS].decode(errors="replace").rstrip("\n")
            if len(line) > _KEPT_LINE_CHARS:
                text += f" ... ({len(line) - _KEPT_LINE_CHARS} more bytes in the log)"
            with self._lock:
                self._lines.append(text)
                if self._sink is not None:
                    try:
                        self._sink.write(line)
                        self._sink.flush()
                    except (OSError, ValueError):  # a full disk: the tail is still kept
                        self._sink = None

    def log_to(self, log: Path | None) -> None:
        """From now on, append the server's output to `log` (None: keep only its tail)."""
        sink = log.open("ab") if log is not None else None
        with self._lock:
            previous, self._sink = self._sink, sink
        if previous is not None:
            previous.close()

    def tail(self, lines: int = TAIL_LINES) -> str:
        with self._lock:
            kept = list(self._lines)[-lines:]
        return "\n".join(kept) if kept else "(the server wrote nothing)"

    # ---- its state ----------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_status(self) -> int | None:
        return self.process.poll()

    def exited_error(self, when: str) -> str:
        return (
            f"the server exited with status {self.process.returncode} {when}; "
            f"its last lines:\n{self.tail()}"
        )

    def wait_ready(self, health_path: str, timeout_s: float, grace_s: float = 5.0) -> None:
        """Poll GET root + `health_path` until it answers 200. The process exiting, or
        `timeout_s` passing (the server is then stopped, `grace_s` between SIGTERM and SIGKILL:
        engine.launch.stop_timeout_s), raises ServerStartError."""
        url = self.root + health_path
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            if self.exit_status() is not None:
                raise ServerStartError(self.exited_error("before it was ready"))
            if self.answers(url):
                self.ready_s = (now_ns() - self.started_ns) / 1e9
                return
            if time.monotonic() > deadline:
                self.stop(grace_s)
                raise ServerStartError(
                    f"the server did not answer GET {url} with 200 within {timeout_s:g} s "
                    f"(engine.launch.startup_timeout_s); its last lines:\n{self.tail()}"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.5)

    def answers(self, url: str) -> bool:
        try:
            # trust_env=False: the server is ours, never behind the user's HTTP_PROXY
            return httpx.get(url, timeout=5.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def read_json(self, path: str, method: str = "GET") -> Any:
        response = httpx.request(method, self.root + path, timeout=10.0, trust_env=False)
        response.raise_for_status()
        return response.json() if response.content else None

    # ---- stopping -----------------------------------------------------------------------------

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left of it after
        `grace_s`, then wait until no process of the group remains."""
        pgid = self.process.pid  # a session leader: its group's id is its pid
        if self.exit_status() is None:
            _signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        _signal_group(pgid, signal.SIGKILL)  # children that outlived the server, too
        self.process.wait()
        deadline = time.monotonic() + 10.0
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._pump is not None:
            self._pump.join(timeout=5.0)
        self.log_to(None)


_Request = tuple["Future[subprocess.Popen[bytes]]", list[str], dict[str, str]]
_spawner: tuple[int, queue.SimpleQueue[_Request]] | None = None  # (its process, its requests)
_spawner_lock = threading.Lock()


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the guarded server from a thread that lives as long as this process. Linux sends
    the death signal when the *thread* that started the child ends (prctl(2),
    PR_SET_PDEATHSIG), so a server started from a short-lived thread (a notebook's thread pool,
    a launcher's worker thread) got SIGTERM the moment that thread finished, the harness still
    running."""
    if threading.current_thread() is threading.main_thread():  # it ends with the process
        return _start(args, env)
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # first use, or a forked child
            requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
            threading.Thread(
                target=_spawn_forever, args=(requests,), daemon=True, name="server-spawner"
            ).start()
            _spawner = (os.getpid(), requests)
        requests = _spawner[1]
    started: Future[subprocess.Popen[bytes]] = Future()
    requests.put((started, args, env))
    return started.result()


def _spawn_forever(requests: queue.SimpleQueue[_Request]) -> None:
    while True:
        started, args, env = requests.get()
        try:
            started.set_result(_start(args, env))
        except BaseException as exc:  # the caller's to raise (a missing program, no memory)
            started.set_exception(exc)


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own group: Ctrl-C reaches the harness only
    )


def _cores_of(pid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # not Linux, or it is gone already
        return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
