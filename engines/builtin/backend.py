"""The built-in engine behind the harness's async `Backend` interface.

The engine's step loop runs one of two ways:

- On the caller's event loop (the default; the harness runs this way). A task steps the engine
  and yields once between steps, so a request submitted mid-step is admitted at the next step
  boundary and queueing delay is real. Submissions made in one go (an offline workload) all
  land before the next step, so batches are deterministic.
- In a thread of its own (`start_engine_thread()`; `inferlab serve` runs this way, as vLLM's
  engine core runs apart from its API server). The event loop then never waits for a step: it
  reads new requests and writes tokens while the engine computes. A thread is enough because
  torch's ops and the C kernels (called through ctypes.CDLL, which releases the GIL) run
  without the GIL. See `EngineThread`.

Either way `generate` yields a request's events as steps produce them, with the engine's own
timestamps, and closing a request's stream early aborts it and frees its KV memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engines.base import (
    TERMINAL_EVENTS,
    Backend,
    Failed,
    Finished,
    GenerationRequest,
    RequestEvent,
    now_ns,
)
from engines.builtin.config import EngineConfig
from engines.builtin.engine import EngineDeadError, LLMEngine
from engines.builtin.factory import build_engine
from engines.builtin.step_stats import EngineGauges

T = TypeVar("T")


class BuiltinBackend(Backend):
    name = "builtin"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config  # checked when it was built
        self.engine: LLMEngine | None = None
        self._queues: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.engine_thread: EngineThread | None = None

    def load(self) -> None:
        self.engine = build_engine(self.config)
        self.engine.step_observers.append(self.emit_step)

    @property
    def tokenizer(self):
        assert self.engine is not None, "load() first"
        return self.engine.tokenizer

    def describe(self) -> dict[str, Any]:
        assert self.engine is not None, "load() first"
        return {"backend": self.name, **self.engine.describe()}

    def start_engine_thread(self, max_requests: int = 1 << 16) -> EngineThread:
        """From now on step the engine in a thread of its own (idempotent). Afterwards only
        that thread may call the engine's stateful methods; use `engine_thread.call`."""
        assert self.engine is not None, "load() first"
        if self.engine_thread is None:
            if self._loop_task is not None and not self._loop_task.done():
                raise RuntimeError("the engine is already stepping on an event loop")
            self.engine_thread = EngineThread(self.engine, max_requests)
            self.engine_thread.start()
        return self.engine_thread

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        assert self.engine is not None, "load() first"
        if self.engine_thread is not None:
            return self.engine_thread.generate(request)
        return self._generate_on_loop(request)

    # ---- on the caller's event loop ---------------------------------------------------------

    async def _generate_on_loop(
        self,
        request: GenerationRequest,
    ) -> AsyncIterator[RequestEvent]:
        assert self.engine is not None, "load() first"
        self._ensure_loop()
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._queues[request.request_id] = queue
        try:
            try:
                self.engine.add_request(
                    request.request_id, request.prompt, request.sampling, priority=request.priority
                )
            except (ValueError, TypeError, EngineDeadError) as exc:
                yield Failed(request.request_id, self.engine.step_counter, now_ns(), str(exc))
                return
            assert self._wake is not None
            self._wake.set()
            remaining = request.sampling.n  # a request with n samples finishes n times
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, Failed):
                    return
                if isinstance(event, TERMINAL_EVENTS):
                    remaining -= 1
                    if remaining == 0:
                        return
        finally:
            self._queues.pop(request.request_id, None)
            engine = self.engine  # None once closed
            if engine is not None and engine.has_request(request.request_id):
                # the consumer went away early
                self.engine.abort_request(request.request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        engine = self.engine
        assert engine is not None and self._wake is not None
        while True:
            if not engine.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = engine.step()
            except Exception as exc:  # the engine is in doubt: fail what is open, not hang
                events = []
                for request_id in list(self._queues):
                    engine.abort_request(request_id)
                    events.append(
                        Failed(
                            request_id,
                            engine.step_counter,
                            now_ns(),
                            f"engine error: {type(exc).__name__}: {exc}",
                        )
                    )
            for event in events:
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            await asyncio.sleep(0)  # let arrivals and consumers run between steps

    def failure(self) -> str | None:
        return None if self.engine is None else self.engine.failure

    def close(self) -> None:
        if self.engine_thread is not None:
            self.engine_thread.stop()
            self.engine_thread = None
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.engine is not None:
            self.engine.close()  # ends its other tensor-parallel ranks, if any
        self.engine = None


# ---- the engine in a thread of its own ------------------------------------------------------


#: Events an event loop hands to request queues per turn: small enough that a busy loop still
#: answers /health promptly, large enough not to slow the streams (docs/benchmarks.md,
#: "Figures behind design choices").
DRAIN_SLICE = 16


@dataclass
class _Outbox:
    """Events on their way from the engine thread to one event loop. The engine thread appends
    a step's events and schedules one drain; the drain puts them in the requests' queues and
    then (`call_soon`, so after the consumers it woke have had their turn, i.e. have written
    their chunks) acknowledges them. Past `max_steps` unacknowledged steps the engine thread
    waits: the hand-over is bounded, and the engine never runs ahead of a loop that cannot keep
    up (which would only make both fight over the GIL)."""

    loop: asyncio.AbstractEventLoop
    max_steps: int
    items: list[tuple[asyncio.Queue[RequestEvent], RequestEvent]] = field(default_factory=list)
    steps: int = 0  # steps handed over and not yet acknowledged
    undrained: int = 0  # of which steps whose events wait in `items`
    scheduled: bool = False  # a drain is on its way
    cond: threading.Condition = field(default_factory=threading.Condition)

    def put(
        self,
        items: list[tuple[asyncio.Queue[RequestEvent], RequestEvent]],
        stopping: threading.Event,
    ) -> bool:
        """Hand `items` to the loop (engine thread); False if the loop is gone."""
        with self.cond:
            if not self._wait(self.max_steps - 1, stopping):
                return False
            schedule = not self.scheduled
            self.scheduled = True
            self.items.extend(items)
            self.steps += 1
            self.undrained += 1
        if schedule:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read these
                return False
        return True

    def _wait(self, most: int, stopping: threading.Event) -> bool:
        while self.steps > most:
            if self.loop.is_closed() or stopping.is_set():
                return False
            self.cond.wait(0.1)
        return True

    def _drain(self) -> None:
        """Deliver what was handed over, DRAIN_SLICE events at a time (on the loop): between
        slices the loop polls its sockets, so that a burst of one step's tokens to hundreds
        of streams does not hold every other request back until all are written."""
        with self.cond:
            batch, self.items = self.items[:DRAIN_SLICE], self.items[DRAIN_SLICE:]
            more = bool(self.items)
            if not more:
                self.scheduled = False
                steps, self.undrained = self.undrained, 0
        for queue, event in batch:
            queue.put_nowait(event)
        if more:
            self.loop.call_soon(self._drain)
        else:
            self.loop.call_soon(self._acknowledge, steps)

    def _acknowledge(self, steps: int) -> None:
        with self.cond:
            self.steps -= steps
            self.cond.notify_all()


@dataclass
class _Sink:
    """Where one request's events go, as the engine thread knows it."""

    outbox: _Outbox
    queue: asyncio.Queue[RequestEvent]
    remaining: int  # samples not finished yet


class EngineThread:
    """An engine stepped in a thread of its own; every call into the engine's state happens on
    that thread. Event loops (any number; each request belongs to the loop that submitted it)
    talk to it through thread-safe hand-overs:

    - in: a FIFO of commands (add a request, abort one, abort all, run a function), run
      between steps in order. It is bounded by `max_requests` live requests, each of which
      puts at most one add and one abort in it.
    - out: per loop, an `_Outbox` holding at most `max_unread_steps` steps' events not yet
      handled on the loop, drained there by one `call_soon_threadsafe` per batch into each
      request's asyncio queue. With the default of one, the engine computes step N+1 while the
      loop writes step N's tokens, and hands N+1 over once those are written: measured with
      300 streams on 2 cores, a deeper hand-over only had both threads fight over the GIL
      (slower steps and a slower event loop).

    The engine's event timestamps are taken inside the engine, on the one `now_ns` clock, as
    on the event-loop path.
    """

    def __init__(
        self, engine: LLMEngine, max_requests: int = 1 << 16, max_unread_steps: int = 1
    ) -> None:
        self.engine = engine
        self.max_requests = max_requests
        self.max_unread_steps = max_unread_steps
        # the engine's gauges as of the end of the last step or command, published for readers
        # on other threads (the server's /metrics): a frozen object, replaced whole
        self.stats = EngineGauges()
        self._commands: list[Callable[[], None]] = []
        self._commands_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(max_requests)
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self._outboxes_lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="inferlab-engine", daemon=True)

    def start(self) -> None:
        self._publish_stats()
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current step; requests still open get a Failed event."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- from any thread --------------------------------------------------------------------

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread between steps; its result as a future
        (`await asyncio.wrap_future(...)` on a loop, `.result()` elsewhere)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:
                    future.set_exception(exc)

        self._submit(command)
        return future

    def abort_all(self, reason: str) -> concurrent.futures.Future[int]:
        """Abort every open request, each with a final `Failed(reason)` event, and free its KV
        memory; the future holds how many there were."""

        def abort_all(engine: LLMEngine) -> int:
            aborted = list(self._sinks)
            self._fail(aborted, reason)
            return len(aborted)

        return self.call(abort_all)

    # ---- on an event loop -------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        request_id = request.request_id
        if self._stopping.is_set():
            yield Failed(request_id, -1, now_ns(), "the engine is shut down")
            return
        if not self._slots.acquire(blocking=False):
            yield Failed(
                request_id,
                -1,
                now_ns(),
                f"the engine thread holds its limit of {self.max_requests} requests",
            )
            return
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        outbox = self._outbox(asyncio.get_running_loop())
        done = False
        try:
            self._submit(lambda: self._add(request, outbox, queue))
            remaining = request.sampling.n  # a request with n samples finishes n times
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, Failed):
                    done = True
                    return
                if isinstance(event, TERMINAL_EVENTS):
                    remaining -= 1
                    if remaining == 0:
                        done = True
                        return
        finally:
            self._slots.release()
            if not done:  # the consumer went away early: abort it, on the engine thread
                self._submit(lambda: self._abort(request_id))

    def _outbox(self, loop: asyncio.AbstractEventLoop) -> _Outbox:
        with self._outboxes_lock:
            for old in [other for other in self._outboxes if other.is_closed()]:
                del self._outboxes[old]
            outbox = self._outboxes.get(loop)
            if outbox is None:
                outbox = self._outboxes[loop] = _Outbox(loop, self.max_unread_steps)
            return outbox

    def _submit(self, command: Callable[[], None]) -> None:
        with self._commands_lock:
            self._commands.append(command)
        self._wake.set()

    # ---- on the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._run_commands()
            if not engine.has_unfinished_requests():
                self._publish_stats()
                self._wake.wait()
                self._wake.clear()  # commands put after this are seen by the next round
                continue
            try:
                events = engine.step()
            except Exception as exc:  # the engine is in doubt: fail what is open, not hang
                self._fail(list(self._sinks), f"engine error: {type(exc).__name__}: {exc}")
                events = []
            self._deliver(events)
            self._publish_stats()
        self._run_commands()  # answer pending calls; adds after stop fail below
        self._fail(list(self._sinks), "the engine was shut down")
        self._publish_stats()

    def _run_commands(self) -> None:
        with self._commands_lock:
            commands, self._commands = self._commands, []
        for command in commands:
            command()

    def _add(
        self, request: GenerationRequest, outbox: _Outbox, queue: asyncio.Queue[RequestEvent]
    ) -> None:
        engine = self.engine
        sink = _Sink(outbox, queue, request.sampling.n)
        if self._stopping.is_set():
            self._post(sink, [Failed(request.request_id, -1, now_ns(), "the engine is shut down")])
            return
        try:
            engine.add_request(
                request.request_id, request.prompt, request.sampling, priority=request.priority
            )
        except (ValueError, TypeError, EngineDeadError) as exc:
            self._post(
                sink,
                [Failed(request.request_id, engine.step_counter, now_ns(), str(exc))],
            )
            return
        self._sinks[request.request_id] = sink

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)  # nobody reads its events any more
        if self.engine.has_request(request_id):
            self.engine.abort_request(request_id)

    def _fail(self, request_ids: list[str], reason: str) -> None:
        """End these requests with `Failed(reason)` and free their KV memory."""
        engine = self.engine
        failed: list[tuple[_Sink, RequestEvent]] = []
        for request_id in request_ids:
            sink = self._sinks.pop(request_id, None)
            if engine.has_request(request_id):
                engine.abort_request(request_id)
            if sink is not None:
                failed.append((sink, Failed(request_id, engine.step_counter, now_ns(), reason)))
        self._send(failed)

    def _deliver(self, events: list[RequestEvent]) -> None:
        """A step's events to their requests' loops; finished requests are forgotten."""
        routed = []
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue  # aborted: its consumer is gone
            if isinstance(event, Failed):
                del self._sinks[event.request_id]
            elif isinstance(event, Finished):
                sink.remaining -= 1
                if sink.remaining == 0:
                    del self._sinks[event.request_id]
            routed.append((sink, event))
        self._send(routed)

    def _post(self, sink: _Sink, events: list[RequestEvent]) -> None:
        self._send([(sink, event) for event in events])

    def _send(self, routed: list[tuple[_Sink, RequestEvent]]) -> None:
        """One hand-over per loop for all of `routed`."""
        batches: dict[
            int, tuple[_Outbox, list[tuple[asyncio.Queue[RequestEvent], RequestEvent]]]
        ] = {}
        for sink, event in routed:
            batches.setdefault(id(sink.outbox), (sink.outbox, []))[1].append((sink.queue, event))
        for outbox, items in batches.values():
            if not outbox.put(items, self._stopping):
                self._drop_loop(outbox)

    def _drop_loop(self, outbox: _Outbox) -> None:
        """The loop is closed: abort its requests (no one can read them) and forget it."""
        for request_id in [r for r, s in self._sinks.items() if s.outbox is outbox]:
            self._abort(request_id)
        with self._outboxes_lock:
            if self._outboxes.get(outbox.loop) is outbox:
                del self._outboxes[outbox.loop]

    def _publish_stats(self) -> None:
        self.stats = self.engine.gauges()
