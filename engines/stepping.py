"""The one stepping adapter: an in-process engine that computes in steps, behind the harness's
async `Backend` interface. Every in-process backend (built-in, Hugging Face, llama.cpp) uses it
and supplies only what differs: how a request is added, how one step is taken, how a request is
aborted.

Two placements of the step loop, one contract for the events:

- `SteppedBackend`: the loop is a task on the caller's event loop (the harness runs this way).
  It yields once between steps, so a request submitted mid-step is admitted at the next step
  boundary. A step may compute on the adapter's one worker thread (`_in_worker`), leaving the
  loop free meanwhile, and hand events over from there (`_post`).
- `SteppingThread`: the engine steps in a thread of its own and event loops talk to it through
  thread-safe hand-overs (`inferlab serve` runs the built-in engine this way). A thread is
  enough because torch's ops and the C kernels release the GIL.

Either way: each request's events reach its stream in the order the engine made them, with the
timestamps the engine took (on the one `now_ns` clock); a request refused at submission ends
with one `Failed`; a step that raises fails the requests it leaves in doubt and the loop goes
on; a stream closed early aborts its request; closing the backend stops the loop and the
thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engines.base import (
    Backend,
    Failed,
    Finished,
    GenerationRequest,
    Prompt,
    RequestEvent,
    StepRecord,
    now_ns,
)
from engines.sampling_params import SamplingParams

T = TypeVar("T")


def samples_left(event: RequestEvent, remaining: int) -> int:
    """A request's samples still open after `event`: none after a `Failed`, one fewer after
    a `Finished` (a request with n samples finishes n times)."""
    if isinstance(event, Failed):
        return 0
    return remaining - 1 if isinstance(event, Finished) else remaining


# ---- the step loop on the caller's event loop ------------------------------------------------


class SteppedBackend(Backend):
    """A backend whose engine steps in a task on the caller's event loop. Subclasses supply
    `_submit`, `_has_work`, `_step` and `_abort`; the adapter owns the requests' streams, the
    loop, the worker thread, failure handling and shutdown."""

    #: What `_submit` raises to refuse a request: its message becomes the request's `Failed`.
    refusals: tuple[type[Exception], ...] = (ValueError, TypeError)
    #: The name of the worker thread a step computes in (`_in_worker`).
    worker_name = "step"

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._wake: asyncio.Event | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: ThreadPoolExecutor | None = None

    # ---- what each backend supplies ---------------------------------------------------------

    @abstractmethod
    def _submit(self, request: GenerationRequest) -> list[RequestEvent]:
        """Queue `request` for the next steps; the events it has at once (Arrived...). Raises
        one of `refusals` (a message naming the field) to refuse it."""

    @abstractmethod
    def _has_work(self) -> bool:
        """Is there a step to take? (False: the loop waits for the next submission.)"""

    @abstractmethod
    async def _step(self) -> list[RequestEvent]:
        """Take one step; its events. A request it fails is ended by its `Failed` event."""

    @abstractmethod
    def _abort(self, request_id: str) -> None:
        """Nobody reads the request's events any more: stop its work, free its memory."""

    def _event_step(self) -> int:
        """The step number of events made between steps (a refusal, a failed step)."""
        return -1

    # ---- the requests' streams --------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        request_id = request.request_id
        if request_id in self._streams:
            reason = f"request_id: {request_id!r} is already in use"
            yield Failed(request_id, self._event_step(), now_ns(), reason)
            return
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._streams[request_id] = queue
        remaining = request.sampling.n
        try:
            try:
                self._deliver(self._submit(request))
            except self.refusals as exc:
                remaining = 0
                yield Failed(request_id, self._event_step(), now_ns(), str(exc))
                return
            self._wake_stepping()
            while remaining:
                event = await queue.get()
                remaining = samples_left(event, remaining)
                yield event
        finally:
            del self._streams[request_id]
            if remaining:  # the consumer went away early
                self._abort(request_id)

    def _deliver(self, events: list[RequestEvent]) -> None:
        """Events to their requests' streams (on the loop); a closed stream's are dropped."""
        streams = self._streams
        for event in events:
            queue = streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def _post(self, events: list[RequestEvent], record: StepRecord | None = None) -> None:
        """From the worker thread: hand a step's events to the loop in one call, its record
        first, so that a run never ends with its last step unrecorded (step observers run on
        the loop)."""
        assert self._loop is not None, "_post is for a step running in _in_worker"
        self._loop.call_soon_threadsafe(self._deliver_step, events, record)

    def _deliver_step(self, events: list[RequestEvent], record: StepRecord | None) -> None:
        if record is not None:
            self.emit_step(record)
        self._deliver(events)

    # ---- the loop ---------------------------------------------------------------------------

    def _wake_stepping(self) -> None:
        if self._step_task is None or self._step_task.done():
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._step_task = self._loop.create_task(self._step_loop(self._wake))
        assert self._wake is not None
        self._wake.set()

    async def _step_loop(self, wake: asyncio.Event) -> None:
        while True:
            if not self._has_work():
                wake.clear()
                await wake.wait()
                continue
            try:
                events = await self._step()
            except Exception as exc:  # the engine is in doubt: fail what is open, not hang
                events = self._fail_open(f"engine error: {type(exc).__name__}: {exc}")
            self._deliver(events)
            await asyncio.sleep(0)  # let arrivals and consumers run between steps

    def _fail_open(self, reason: str) -> list[RequestEvent]:
        failed: list[RequestEvent] = []
        for request_id in list(self._streams):
            self._abort(request_id)
            failed.append(Failed(request_id, self._event_step(), now_ns(), reason))
        return failed

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the worker thread (one: steps run one at a time) while the loop
        goes on serving arrivals and streams."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.worker_name)
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _stop_stepping(self, wait_for_worker: bool) -> None:
        """Stop the loop and the worker (`wait_for_worker`: until a step in flight is done);
        the streams still open end with a `Failed`, not waiting for steps that never come."""
        if self._step_task is not None:
            self._step_task.cancel()
        if self._worker is not None:
            self._worker.shutdown(wait=wait_for_worker, cancel_futures=True)
        self._end_open_streams("the backend was closed")

    def _end_open_streams(self, reason: str) -> None:
        """Each open stream's `Failed(reason)`, put on its loop (close() may run on another
        thread). Nothing is aborted: the engine is being closed with everything it holds."""
        loop = self._loop
        if not self._streams or loop is None or loop.is_closed():
            return
        failed: list[RequestEvent] = [
            Failed(request_id, self._event_step(), now_ns(), reason) for request_id in self._streams
        ]
        if _running_loop() is loop:
            self._deliver(failed)
        else:
            loop.call_soon_threadsafe(self._deliver, failed)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called outside any event loop
        return None


# ---- the engine in a thread of its own -------------------------------------------------------


class ThreadedEngine(Protocol):
    """What `SteppingThread` calls on an engine (the built-in `LLMEngine` is one)."""

    @property
    def step_counter(self) -> int: ...

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingParams | None = ...,
        arrival_ns: int | None = ...,
        priority: int = ...,
        lora_name: str | None = ...,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestEvent]: ...


E = TypeVar("E", bound=ThreadedEngine)


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


class SteppingThread(Generic[E]):
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
    on the event-loop path. `_publish_stats` is where a subclass publishes what readers on
    other threads may read, after every step and command.
    """

    def __init__(
        self,
        engine: E,
        max_requests: int = 1 << 16,
        max_unread_steps: int = 1,
        refusals: tuple[type[Exception], ...] = (ValueError, TypeError),
    ) -> None:
        self.engine = engine
        self.max_requests = max_requests
        self.max_unread_steps = max_unread_steps
        self.refusals = refusals  # what add_request raises to refuse a request
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

    def call(self, fn: Callable[[E], T]) -> concurrent.futures.Future[T]:
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

        def abort_all(engine: E) -> int:
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
        remaining = request.sampling.n
        try:
            self._submit(lambda: self._add(request, outbox, queue))
            while remaining:
                event = await queue.get()
                remaining = samples_left(event, remaining)
                yield event
        finally:
            self._slots.release()
            if remaining:  # the consumer went away early: abort it, on the engine thread
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
                request.request_id,
                request.prompt,
                request.sampling,
                priority=request.priority,
                lora_name=request.lora,
            )
        except self.refusals as exc:
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
        """After every step, and when idle: publish what other threads may read."""
