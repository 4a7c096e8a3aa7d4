"""`run.clients_on=ray`: the clients of `run.num_clients` as Ray tasks, on the cluster that
`ray.init()` joins (Ray's own RAY_ADDRESS, else a local one it starts; docs/scaling.md).

Each task connects back to the launching process over TCP (multiprocessing's Listener and
Client, with a random key), and then speaks the very protocol a local client speaks over its
pipe: ready, clock readings, start, rows, end. So the clock offset of a client on another host
is measured the same way (over the network, its uncertainty is half that round trip), and
every row still reaches the run folder the moment its request finishes. `RayTask` stands for
the client's process: Ctrl-C in the launcher cancels the task (a KeyboardInterrupt in it: its
driver stops like an interrupted run and sends its last rows), a kill forces it.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from harness.running.launching import ray_connection_hint
from workloads.request import WorkloadRequest

#: client_main's signature: (engine, model, share, limits, connection, ignore_sigint)
ClientMain = Callable[..., None]
CONNECT_TIMEOUT_S = 600.0  # from submitting the tasks to every client connected (scheduling,
# a worker's start, the imports)


class RayTask:
    """A client running as a Ray task, as the client pool handles a process."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.pid: int | None = None  # the client reports its own in its ready message
        self.failure: str | None = None

    @property
    def exitcode(self) -> int | None:
        """None while it runs, 0 when it returned, 1 when Ray reports it failed."""
        if self.is_alive():
            return None
        return 1 if self._failed() else 0

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def _failed(self) -> bool:
        import ray

        if self.failure is None:
            try:
                ray.get(self.ref, timeout=0)
                self.failure = ""
            except Exception as exc:  # the task raised, was cancelled, or its node was lost
                self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return bool(self.failure)

    def terminate(self) -> None:
        import ray

        ray.cancel(self.ref)

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)


def _client_task(
    main: ClientMain,
    engine: dict[str, Any],
    model: dict[str, Any],
    share: list[WorkloadRequest],
    limits: dict[str, int | None],
    address: tuple[str, int],
    authkey: bytes,
    index: int,
) -> None:
    # Ray's workers run uvloop, which swallows a KeyboardInterrupt raised in a transport's
    # callback (a cancelled client would carry on): asyncio's own loop, as in a local client
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    conn = Client(address, authkey=authkey)
    conn.send(index)  # connections arrive in any order
    main(engine, model, share, limits, conn, False)


def start_ray_clients(
    main: ClientMain,
    engine: dict[str, Any],
    model: dict[str, Any],
    shares: list[list[WorkloadRequest]],
    limits: list[dict[str, int | None]],
) -> list[tuple[RayTask, Connection]]:
    """Submit one Ray task per share (one CPU each) and wait until every one has connected."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "run.clients_on=ray needs the optional extra `ray`: pip install -e '.[ray]'"
        ) from None
    if not ray.is_initialized():
        try:
            ray.init()  # RAY_ADDRESS when set (Ray's own variable), else a local cluster
        except ConnectionError as exc:
            raise RuntimeError(
                f"run.clients_on=ray: {exc}{ray_connection_hint(str(exc))}"
            ) from None
    authkey = secrets.token_bytes(32)
    listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
    remote = ray.remote(num_cpus=1)(_client_task)
    tasks = [
        RayTask(remote.remote(main, engine, model, share, limits[i], listener.address, authkey, i))
        for i, share in enumerate(shares)
    ]
    conns: dict[int, Connection] = {}

    def accept() -> None:
        while len(conns) < len(shares):
            conn = listener.accept()
            conns[int(conn.recv())] = conn

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        while acceptor.is_alive():
            acceptor.join(0.2)
            ended = next((t for t in tasks if not t.is_alive() and t._failed()), None)
            if ended is not None:
                raise RuntimeError(f"a Ray client task failed before connecting: {ended.failure}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(shares) - len(conns)} Ray client task(s) did not connect within "
                    f"{CONNECT_TIMEOUT_S:.0f} s (does the cluster have {len(shares)} free CPUs?)"
                )
    except BaseException:
        for task in tasks:
            task.kill()
        raise
    finally:
        listener.close()
    return [(tasks[i], conns[i]) for i in range(len(shares))]
