"""The instance processes as the router holds them: started as fresh interpreters, each with a
control socket; messages to one are queued and written by a thread of its own (a hung instance
that stops reading blocks that thread, never the router); ended by asking, then killing."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from queue import Queue
from typing import Any

from engines.base import ConfigError
from engines.builtin.disaggregation.messages import InstanceSpec
from engines.builtin.distributed.launch import CODE_ROOT
from engines.builtin.platform import available_cpus
from engines.builtin.step_stats import EngineGauges

#: An instance: this Python, then CODE_ROOT and its control socket's descriptor (`-c`, as the
#: tensor-parallel workers: no other copy of inferlab on the path is imported first).
INSTANCE_COMMAND = [
    sys.executable,
    "-c",
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from engines.builtin.disaggregation.instance import main; main(sys.argv[2:])",
]
#: How long the instances may take to load their engines.
STARTUP_TIMEOUT_S = 600.0
#: How long ending an instance waits for it to leave before killing it.
EXIT_GRACE_S = 5.0


@dataclass
class InstanceProcess:
    role: str
    index: int
    process: subprocess.Popen[bytes]
    control: Connection
    alive: bool = True
    gauges: EngineGauges = field(default_factory=EngineGauges)
    facts: dict[str, Any] = field(default_factory=dict)
    last_heard_ns: int = 0
    unresponsive: str | None = None  # why the router sends it no new requests (a hung prefill)
    _outbox: Queue[tuple[Any, ...] | None] = field(default_factory=Queue)
    _writer: threading.Thread | None = None

    @classmethod
    def start(cls, spec: InstanceSpec) -> InstanceProcess:
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [*INSTANCE_COMMAND, CODE_ROOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
        theirs.close()
        instance = cls(spec.role, spec.index, process, Connection(ours.detach()))
        instance.control.send(spec)  # the socket is empty: this cannot block
        return instance

    @property
    def name(self) -> str:
        return f"{self.role} instance {self.index} (pid {self.process.pid})"

    def await_ready(self, deadline: float) -> None:
        """Its "ready" facts, or an error naming it (exited, failed, or too slow to start);
        then its writer starts."""
        while not self.control.poll(1.0):
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start in {STARTUP_TIMEOUT_S:g} s")
        try:
            message = self.control.recv()
        except EOFError:
            raise RuntimeError(f"{self.name} exited while starting") from None
        if message[0] == "fatal":
            error = ConfigError if "engine." in message[1] else RuntimeError
            raise error(f"{self.name}: {message[1]}")
        self.facts = message[1]
        self._writer = threading.Thread(target=self._write, daemon=True, name=self.name)
        self._writer.start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue `message` for the instance (dropped once it is gone)."""
        if self.alive:
            self._outbox.put(message)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self.control.send(message)
            except OSError:
                return  # it died (or was closed): the router reads its end

    def kill(self) -> None:
        self.alive = False
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._outbox.put(None)
        self.control.close()  # a writer blocked in send gets an OSError and ends


def placement(num_instances: int, num_threads: int | None) -> tuple[int, list[int] | None]:
    """Threads per instance, and the cores to pin them to in turn (None: not pinned, too few
    cores to give each its own). Without engine.num_threads the cores are shared out."""
    cores = sorted(os.sched_getaffinity(0))
    count, _ = available_cpus()
    threads = num_threads or max(1, count // num_instances)
    if threads * num_instances > len(cores):
        return threads, None
    return threads, cores


def end_instances(instances: list[InstanceProcess], cleanup: Any, links: Any) -> None:
    """Ask every ready instance to leave, kill those that do not within the grace (and at once
    those never ready), and clear what the connector's setup left (a finalizer: it runs once,
    at close, collection or exit)."""
    for instance in instances:
        if instance.alive and instance._writer is not None:
            instance.send(("close",))
    deadline = time.monotonic() + EXIT_GRACE_S
    for instance in instances:
        if instance.alive and instance._writer is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                instance.process.wait(max(0.0, deadline - time.monotonic()))
        instance.kill()
    if cleanup is not None:
        cleanup(links)
