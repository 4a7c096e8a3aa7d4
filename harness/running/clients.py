"""Load from many clients (`run.num_clients=N`, engine=openai): one asyncio client cannot keep
up with a fast server, so the workload is split over N client processes, each with its own
backend (connection pool, event loop, CPU time) running the ordinary Driver over its share.

- Split: the workload's sessions are dealt round-robin in arrival order (a follow-up turn
  goes with its session's first turn, whose conversation it continues); a closed loop's
  concurrency C is split too (C >= N, each client keeps C // N or one more in flight), and so
  is an open loop's cap (`workload.arrival.max_concurrency`, the same way).
- Clocks: each client process reports to the launching one over a pipe. Before the start the
  launcher asks each client's clock `CLOCK_ROUNDS` times (ping-pong) and keeps the round
  with the shortest round trip: offset = client's reading - the midpoint of the launcher's
  send and receive, uncertainty = half that round trip. On one Linux host both clocks are
  CLOCK_MONOTONIC and the offset is ~0 within a few microseconds; it is measured anyway, and
  recorded, so that a remote client (another host) would be rebased the same way.
- Start: the launcher picks t0 on its own clock `START_DELAY_S` ahead and sends each client t0
  plus its offset; every driver waits for that moment, so all rows are seconds since one t0.
- Rows: a client sends each request's rows (its token rows, then its request row) the moment
  the request finishes, and the launcher appends them to the run's recorder at once, so a
  crash or Ctrl-C leaves every finished request readable. One pipe per client carries its
  rows and its messages in order; a shared queue would let a client killed while writing
  hold the lock the others need.
- Ctrl-C or SIGTERM in the launcher stops every client (SIGTERM: the client's driver stops
  like an interrupted run), keeps the rows of the requests that finished, and re-raises: the
  run is `incomplete`. The clients ignore SIGINT themselves (a terminal's Ctrl-C reaches the
  whole process group), so the launcher alone decides.
- A client that dies or fails mid-run: every request of its share without a row becomes a
  failed row that says why, the other clients run to their end, then the run fails.
- At the end each client's own figures (requests, chunks, client overhead per chunk, clock
  offset, pid and host, seconds from launch to ready) are `ClientPool.info["clients"]`
  (summary.json `clients`, with `clients_t0_ns`: t0 on the launcher's clock, to join the rows
  with other logs on that clock), and the clients' `ClientStats` are merged into the
  launching backend's, whose `engine.client` then covers the whole run.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from engines.backends import build_backend
from engines.base import Backend, now_ns
from harness.running import heap
from harness.running.driver import Driver, RequestTrace, RowSink
from harness.running.interrupts import deferred, interrupts
from harness.running.ray_clients import ClientMain, RayTask, start_ray_clients
from workloads import WORKLOAD_TYPES, config_keys
from workloads.request import WorkloadRequest

CLOCK_ROUNDS = 16  # ping-pongs per client; the shortest round trip is kept
START_DELAY_S = 0.25  # from choosing t0 to t0: the start message reaches every client first
STOP_TIMEOUT_S = 15.0  # after SIGTERM, how long the clients get to send their last rows
#: a client's figures for summary.json, from its backend's ClientStats.snapshot()
CLIENT_FIGURES = (
    "requests_finished",
    "requests_failed",
    "chunks",
    "client_overhead_per_chunk_mean_us",
    "client_overhead_per_chunk_p50_us",
    "client_overhead_per_chunk_p99_us",
    "client_overhead_per_chunk_max_us",
)


@dataclass(frozen=True)
class ClockOffset:
    offset_ns: int  # the client's clock minus the launcher's
    uncertainty_ns: int  # half the round trip of the reading kept


def measure_offset(
    ask: Callable[[], int], clock: Callable[[], int] = now_ns, rounds: int = CLOCK_ROUNDS
) -> ClockOffset:
    """The offset of the clock that `ask()` reads, from the ping-pong with the shortest round
    trip: its reading is taken somewhere inside that trip, so the midpoint is off by at most
    half of it."""
    best: tuple[int, int] | None = None  # (round trip, offset)
    for _ in range(rounds):
        sent = clock()
        theirs = ask()
        back = clock()
        if best is None or back - sent < best[0]:
            best = (back - sent, theirs - (sent + back) // 2)
    assert best is not None
    return ClockOffset(best[1], (best[0] + 1) // 2)


def split_requests(requests: list[WorkloadRequest], n: int) -> list[list[WorkloadRequest]]:
    """N shares: sessions dealt round-robin in arrival order, each whole (a follow-up turn
    goes where its first turn goes)."""
    by_id = {w.request_id: w for w in requests}

    def root(w: WorkloadRequest) -> str:
        while w.follows is not None and w.follows in by_id:
            w = by_id[w.follows]
        return w.request_id

    roots = sorted((w for w in requests if not w.follows), key=lambda w: w.arrival_s)
    client_of = {w.request_id: i % n for i, w in enumerate(roots)}
    shares: list[list[WorkloadRequest]] = [[] for _ in range(n)]
    for w in requests:
        # a turn whose session is not in the workload: the driver of client 0 names it
        shares[client_of.get(root(w), 0)].append(w)
    return shares


def split_concurrency(
    concurrency: int | None, n: int, key: str = "workload.arrival.concurrency"
) -> list[int | None]:
    """A closed loop's C or an open loop's cap (the config's `key`) over N clients, C >= N;
    None for each when there is none."""
    if concurrency is None:
        return [None] * n
    if concurrency < n:
        raise ValueError(
            f"{key}: {concurrency} is invalid with run.num_clients={n}; "
            f"allowed: an integer >= {n} (each client keeps at least one request in flight)"
        )
    return [concurrency // n + (i < concurrency % n) for i in range(n)]


def cap_key(workload: Mapping[str, Any]) -> str:
    """The config key of an open loop's cap on the requests in flight, for error messages: a
    workload type with its own `max_concurrency` (a trace replay, whose times are its own)
    takes it at the top, the others in their arrival block."""
    kind = workload.get("type", "synthetic")
    own = kind in WORKLOAD_TYPES and "max_concurrency" in config_keys(WORKLOAD_TYPES.get(kind))
    return "workload.max_concurrency" if own else "workload.arrival.max_concurrency"


def client_limits(
    concurrency: int | None, max_concurrency: int | None, n: int, workload: Mapping[str, Any]
) -> list[dict[str, int | None]]:
    """Each client's share of a closed loop's C and of an open loop's cap (`workload`: the
    workload's config, which names the cap's key); ValueError when one is below N."""
    closed = split_concurrency(concurrency, n)
    caps = split_concurrency(max_concurrency, n, cap_key(workload))
    return [{"concurrency": c, "max_concurrency": m} for c, m in zip(closed, caps, strict=True)]


# ---- the client process -------------------------------------------------------------------------


class _RowSender:
    """The client driver's sink: a request's rows go to the launcher together, once its
    request row (the driver's last for it) is written."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.rows: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, table: str, row: dict[str, Any]) -> None:
        self.rows.append((table, row))
        if table == "requests":
            rows, self.rows = self.rows, []
            self.conn.send(("rows", rows))


def _figures(backend: Backend, driver: Driver) -> dict[str, Any]:
    stats = getattr(backend, "stats", None)
    snapshot = stats.snapshot() if stats is not None else {}
    return {
        **{key: snapshot.get(key) for key in CLIENT_FIGURES},
        "harness_overhead_fraction": driver.overhead_fraction,
    }


def client_main(
    engine: dict[str, Any],
    model: dict[str, Any],
    share: list[WorkloadRequest],
    limits: dict[str, int | None],
    conn: Connection,
    ignore_sigint: bool = True,
) -> None:
    """One client process: build and load its backend, answer clock readings until the start,
    then drive its share from the t0 it was sent, sending rows as requests finish.
    `ignore_sigint`: False in a Ray task, which Ray stops with a KeyboardInterrupt."""
    with interrupts():  # SIGTERM from the launcher: stop like an interrupted run
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            backend = build_backend(engine, model)
            backend.load()
            with heap.frozen():  # before the start: a fresh process's first collection is long
                conn.send(("ready", {"pid": os.getpid(), "host": socket.gethostname()}))
                while True:
                    message = conn.recv()
                    if message[0] == "clock":
                        conn.send(("clock", now_ns()))
                    elif message[0] == "start":
                        t0 = message[1]
                        break
                    else:
                        raise ValueError(f"unexpected message from the launcher: {message[0]!r}")
                driver = Driver(backend, _RowSender(conn))
                try:
                    driver.run(share, **limits, t0=t0)
                    end = "done"
                except KeyboardInterrupt:
                    end = "interrupted"
            conn.send((end, _figures(backend, driver), getattr(backend, "stats", None)))
            backend.close()
        except BaseException as exc:
            reason = "".join(traceback.format_exception_only(exc)).strip()
            with suppress(OSError):  # the launcher may be gone
                conn.send(("error", reason or type(exc).__name__))
        finally:
            conn.close()


# ---- the launcher -------------------------------------------------------------------------------

#: multiprocessing's own start methods: a spawned child knows them
_STDLIB_START_METHODS = (None, "fork", "spawn", "forkserver")


@contextmanager
def _spawn_from_any_process() -> Iterator[None]:
    """A spawned child re-applies its parent's default start method before anything else. In
    a joblib worker (a sweep on hydra/launcher=joblib) that default is "loky", which a fresh
    interpreter does not know: every client would die at once ("cannot find context for
    'loky'"). So the default is "spawn" while a client starts, then what it was."""
    before = multiprocessing.get_start_method(allow_none=True)
    if before in _STDLIB_START_METHODS:
        yield
        return
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)


def start_processes(
    main: ClientMain,
    engine: dict[str, Any],
    model: dict[str, Any],
    shares: list[list[WorkloadRequest]],
    limits: list[dict[str, int | None]],
) -> list[tuple[BaseProcess, Connection]]:
    """Each share's client as a local process (spawn), with its end of a pipe."""
    context = multiprocessing.get_context("spawn")
    started: list[tuple[BaseProcess, Connection]] = []
    for index, share in enumerate(shares):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=main,
            args=(engine, model, share, limits[index], theirs),
            name=f"inferlab-client-{index}",
            daemon=True,  # never outlives the launcher
        )
        with _spawn_from_any_process():
            process.start()
        theirs.close()  # the client's end lives in the client: its exit ends the pipe
        started.append((process, ours))
    return started


@dataclass
class _Client:
    index: int
    share: list[WorkloadRequest]
    limits: dict[str, int | None]  # its share of concurrency / max_concurrency
    process: BaseProcess | RayTask
    conn: Connection
    pending: dict[str, WorkloadRequest]  # its requests that have no row yet
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    closed: bool = False  # its pipe ended: nothing more will come
    end: str | None = None  # done | interrupted | error | died
    error: str | None = None
    stats: Any = None  # its backend's ClientStats

    def name(self) -> str:
        pid = self.info.get("pid") or self.process.pid
        return f"client {self.index} (pid {pid})"

    def what_happened(self) -> str:
        if self.end == "error":
            return f"failed: {self.error}"
        if self.end == "interrupted":
            return "was interrupted (the launcher stopped it)"
        failure = getattr(self.process, "failure", None)  # a Ray task's own account
        return f"died ({failure})" if failure else f"died (exit code {self.process.exitcode})"


class ClientPool:
    """Drives a workload from `num_clients` processes; for the experiment it stands where a
    Driver does: `run(requests, concurrency)` returns t0, then `t0` and `overhead_fraction`;
    `info` holds each client's figures for summary.json (also after a failure or Ctrl-C)."""

    def __init__(
        self,
        config: dict[str, Any],
        num_clients: int,
        backend: Backend,
        sink: RowSink,
        on_request_done: Callable[[dict[str, Any]], None] | None = None,
        on_ray: bool = False,
    ) -> None:
        self.on_ray = on_ray  # the clients are Ray tasks (harness/running/ray_clients.py)
        self.engine = backend.client_options(dict(config["engine"]))
        self.model = dict(config.get("model") or {})
        self.workload = dict(config.get("workload") or {})
        self.num_clients = num_clients
        self.backend = backend  # the launcher's: its ClientStats get every client's
        self.sink = sink
        self.on_request_done = on_request_done
        self.t0 = 0
        self.info: dict[str, Any] = {}
        self._overhead: list[float] = []

    @property
    def overhead_fraction(self) -> float | None:
        """The busiest client driver's own work / its wall time."""
        return max(self._overhead, default=None)

    def run(
        self,
        workload: list[WorkloadRequest],
        concurrency: int | None = None,
        max_concurrency: int | None = None,
    ) -> int:
        n = self.num_clients
        limits = client_limits(concurrency, max_concurrency, n, self.workload)
        shares = split_requests(workload, n)
        clients: list[_Client] = []
        interrupted = False
        launched = time.monotonic()
        try:
            started: list[tuple[BaseProcess | RayTask, Connection]] = []
            if self.on_ray:
                started += start_ray_clients(client_main, self.engine, self.model, shares, limits)
            else:
                started += start_processes(client_main, self.engine, self.model, shares, limits)
            for index, (process, conn) in enumerate(started):
                pending = {w.request_id: w for w in shares[index]}
                clients.append(_Client(index, shares[index], limits[index], process, conn, pending))
            self._serve(clients, lambda: all(c.ready or c.closed for c in clients), launched)
            unready = [c for c in clients if not c.ready]
            if unready:  # nothing was sent yet: the run fails as a backend that cannot load
                raise RuntimeError(f"{unready[0].name()} {unready[0].what_happened()}")
            for c in clients:
                offset = measure_offset(functools.partial(self._clock_of, c))
                c.info["clock_offset_ns"] = offset.offset_ns
                c.info["clock_offset_uncertainty_ns"] = offset.uncertainty_ns
            self.t0 = now_ns() + int(START_DELAY_S * 1e9)
            for c in clients:
                c.conn.send(("start", self.t0 + c.info["clock_offset_ns"]))
            self._serve(clients, lambda: all(c.closed for c in clients))
        except KeyboardInterrupt:
            interrupted = True
            with deferred():  # a second Ctrl-C waits: the finished requests' rows still come
                self._stop(clients)
            raise
        finally:
            self._end(clients)
        if not interrupted:
            self._fail_unfinished(clients)
        return self.t0

    def _clock_of(self, client: _Client) -> int:
        try:
            with deferred():  # an answer is taken whole, or the pipe loses its framing
                client.conn.send(("clock",))
                kind, reading = client.conn.recv()
        except (EOFError, OSError):
            client.process.join(timeout=5)
            raise RuntimeError(f"{client.name()} died before the start") from None
        assert kind == "clock", kind
        return int(reading)

    def _serve(
        self,
        clients: list[_Client],
        until: Callable[[], bool],
        launched: float | None = None,
        deadline: float | None = None,
    ) -> None:
        """Take the clients' messages as they come, until `until()` (or the deadline); a
        client's `ready_s` is counted from `launched`."""
        while not until():
            live = {c.conn: c for c in clients if not c.closed}
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return
            for conn in wait(list(live), timeout):
                assert isinstance(conn, Connection)
                with deferred():  # a message is taken whole, or the pipe loses its framing
                    self._receive(live[conn], launched)

    def _receive(self, client: _Client, launched: float | None) -> None:
        try:
            message = client.conn.recv()
        except (EOFError, OSError):  # the process ended (or died mid-message)
            client.closed = True
            client.process.join(timeout=5)
            if client.end is None:
                client.end = "died"
            return
        kind = message[0]
        if kind == "rows":
            for table, row in message[1]:
                self._take(client, table, row)
        elif kind == "ready":
            client.ready = True
            client.info.update(message[1])
            if launched is not None:
                client.info["ready_s"] = time.monotonic() - launched
        elif kind in ("done", "interrupted"):
            client.end = kind
            client.info.update(message[1])
            client.stats = message[2]
        elif kind == "error":
            client.end, client.error = "error", message[1]

    def _take(self, client: _Client, table: str, row: dict[str, Any]) -> None:
        self.sink(table, row)
        if table == "requests":
            client.pending.pop(row["request_id"], None)
            if self.on_request_done is not None:
                self.on_request_done(row)

    def _stop(self, clients: list[_Client]) -> None:
        """SIGTERM to every client still running; their last rows are taken for a while."""
        for c in clients:
            if not c.closed and c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        self._serve(clients, lambda: all(c.closed for c in clients), deadline=deadline)

    def _end(self, clients: list[_Client]) -> None:
        """No client outlives the run; their figures are kept, their stats merged."""
        for c in clients:
            if c.process.is_alive():
                c.process.kill()
            c.process.join(timeout=5)
            c.conn.close()
        merged = getattr(self.backend, "stats", None)
        for c in clients:
            if c.stats is not None and merged is not None:
                merged.merge(c.stats)
            if c.info.get("harness_overhead_fraction") is not None:
                self._overhead.append(c.info["harness_overhead_fraction"])
        self.info = {
            "clients": [self._describe(c) for c in clients],
            "clients_t0_ns": self.t0 or None,
        }

    def _describe(self, client: _Client) -> dict[str, Any]:
        info = client.info
        offset, uncertainty = (
            info.get("clock_offset_ns"),
            info.get("clock_offset_uncertainty_ns"),
        )
        return {
            "client": client.index,
            "pid": info.get("pid", client.process.pid),
            "host": info.get("host"),
            "status": client.end or "died",
            "error": None if client.end == "done" else client.what_happened(),
            "requests": len(client.share),
            **client.limits,
            "ready_s": info.get("ready_s"),
            **{key: info.get(key) for key in (*CLIENT_FIGURES, "harness_overhead_fraction")},
            "clock_offset_us": None if offset is None else offset / 1e3,
            "clock_offset_uncertainty_us": None if uncertainty is None else uncertainty / 1e3,
        }

    def _fail_unfinished(self, clients: list[_Client]) -> None:
        """Every request of a client that did not finish its share is a failed row that says
        why; then the run fails, naming the first such client."""
        broken = [(c, len(c.pending)) for c in clients if c.end != "done"]
        for c, _ in broken:
            reason = f"{c.name()} {c.what_happened()} before this request finished"
            now = now_ns()
            with deferred():
                for item in list(c.pending.values()):
                    trace = RequestTrace(item, now, sent_ns=now, finished_ns=now, error=reason)
                    self._take(c, "requests", trace.row(self.t0))
        if broken:
            first, unfinished = broken[0]
            raise RuntimeError(
                f"{first.name()} {first.what_happened()}; its {unfinished} unfinished "
                "request(s) are failed rows"
                + (f" ({len(broken)} clients in all)" if len(broken) > 1 else "")
            )
