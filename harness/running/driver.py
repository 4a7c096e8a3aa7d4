"""The driver sends each workload request to the backend at its arrival time and turns the
events that come back into request, token and step rows.

Open loop (default): each request is sent at its arrival time, whatever is in flight. Capped
open loop (`max_concurrency=M`, vLLM's `--request-rate R --max-concurrency M`): at most M
requests are in flight; one that arrives while M are waits for a free slot (first come, first
served) and is sent when one frees. Closed loop (`concurrency=C`): C requests are kept in
flight; the next is sent when one finishes. Multi-turn sessions: a request that `follows`
another is due its `arrival_s` (think time) after that turn finished, with the conversation so
far prepended to its prompt; under a cap each turn waits for a slot of its own.

Times in the rows are seconds since the run's start (`t0`), all from the backend's one clock.
Arrival is the time the workload asked for (for a closed loop or a follow-up turn: the moment
it became due); `sent_s` is when the request was actually handed over (their difference is the
driver's lateness, recorded, never hidden; under a cap it includes the wait for a slot).

Phase columns partition a request's life (docs/run_folder.md): lateness (sent - arrival),
`tokenize_s` (tokenized - sent), `queue_s` (scheduled - tokenized), `prefill_s` (first token -
scheduled), `decode_s` (last - first token); they add up to the end-to-end latency.
`detokenize_s` is the engine's own measure of text decoding, which happens inside the prefill
and decode steps (a part of them, not a further phase).

A run may be given its start `t0` (a moment on the driver's clock, normally just ahead): the
driver waits for it, so that several drivers in other processes start together and their rows
share one time origin (harness/running/clients.py).

Cancellation: a request the workload cancels (`WorkloadRequest.cancel_after_s`) has its stream
closed that long after it was sent (the backend's generator is cancelled: an in-process engine
aborts the request and frees its KV memory, an HTTP client closes the response); its row says
`cancelled`, the reason in `error`, and its tokens so far stay in the tokens table. A request
that finishes first is simply ok. Later turns of a cancelled turn's session go on, with the
reply as far as it came.

Bounds (`RunBounds`: run.max_duration_s, run.max_errors, run.stop_on_saturation): when one is
hit the driver stops sending (closed-loop slots, open-loop arrivals, requests waiting for a
slot under a cap and later turns of sessions alike), lets the requests in flight run for the
grace period, then cancels those still running with the bound as the reason. Every request
sent has a row (ok, failed or cancelled); `num_unsent` counts the workload's requests without
one; `stopped_by`, `stop_reason` and `saturation` (the detector's evidence) say why.

The clock and the sleep are injectable so a scripted backend can drive the driver in virtual
time. The driver also times its own work (event handling, building rows, the sinks it feeds)
with `time.perf_counter_ns`, whatever the clock: `overhead_ns` against the run's `wall_ns`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from engines.base import (
    Backend,
    DisaggregatedFacts,
    Failed,
    Finished,
    Preempted,
    PrefillChunk,
    Scheduled,
    StepRecord,
    Tokenized,
    Tokens,
    is_chat,
    now_ns,
)
from engines.tool_calls import ToolCallOutput
from harness.measuring.metrics import expert_imbalance
from harness.run_folder import DISAGGREGATED_COLUMNS
from harness.running.interrupts import deferred
from harness.running.saturation import SaturationConfig, SaturationDetector
from workloads.request import WorkloadRequest

RowSink = Callable[[str, dict[str, Any]], None]
Clock = Callable[[], int]
Sleep = Callable[[float], Awaitable[Any]]


@dataclass
class RequestTrace:
    item: WorkloadRequest
    arrival_ns: int
    sent_ns: int = 0
    tokenized_ns: int | None = None
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    finished_ns: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0  # Tokens events seen
    output_tokens_reported: int | None = None  # what the backend says (a server's usage)
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    cached_prompt_tokens_host: int | None = None  # None: the backend does not say
    cached_prompt_tokens_disk: int | None = None
    disaggregated: DisaggregatedFacts | None = None  # engine.disaggregation=pd
    prefill_tokens_computed: int = 0  # over every chunk, recomputation after preemption too
    detokenize_ns: int | None = None
    spec_steps: int | None = None  # None: the backend does not say
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    structured_compile_ns: int | None = None
    structured_cache_hit: bool | None = None
    structured_forced_tokens: int | None = None
    tool_output: ToolCallOutput | None = None  # a request with tools: its calls
    finish_reason: str | None = None
    error: str | None = None
    cancelled: str | None = None  # why the driver closed the stream (its row is `cancelled`)
    samples_left: int = 1  # samples not finished yet (a request with n samples finishes n times)
    token_rows: list[dict[str, Any]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""

    def row(self, t0: int) -> dict[str, Any]:
        def rel(ns: int | None) -> float | None:
            return None if ns is None else (ns - t0) / 1e9

        def span(start: int | None, end: int | None) -> float | None:
            return None if start is None or end is None else (end - start) / 1e9

        ok = self.error is None and self.cancelled is None
        queue_from = self.tokenized_ns if self.tokenized_ns is not None else self.sent_ns

        request = self.item.request
        enforced = request.sampling.structured_outputs
        constraint = enforced or self.item.expected_format
        return {
            "request_id": request.request_id,
            "status": "cancelled"
            if self.cancelled is not None
            else ("failed" if self.error is not None else "ok"),
            "error": self.cancelled if self.cancelled is not None else self.error,
            "finish_reason": self.finish_reason,
            "arrival_s": rel(self.arrival_ns),
            "sent_s": rel(self.sent_ns),
            "tokenized_s": rel(self.tokenized_ns),
            "scheduled_s": rel(self.scheduled_ns),
            "first_token_s": rel(self.first_token_ns),
            "last_token_s": rel(self.last_token_ns),
            "finished_s": rel(self.finished_ns),
            "prompt_tokens_requested": self.item.prompt_tokens_requested,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens_requested": request.sampling.max_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_reported": self.output_tokens_reported,
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_preemptions": self.num_preemptions,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "cached_prompt_tokens_host": self.cached_prompt_tokens_host,
            "cached_prompt_tokens_disk": self.cached_prompt_tokens_disk,
            **_disaggregated_columns(self.disaggregated),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "tokenize_s": span(self.sent_ns, self.tokenized_ns),
            "queue_s": span(queue_from, self.scheduled_ns),
            "prefill_s": span(self.scheduled_ns, self.first_token_ns) if ok else None,
            "decode_s": span(self.first_token_ns, self.last_token_ns) if ok else None,
            "detokenize_s": None
            if self.detokenize_ns is None or not ok
            else self.detokenize_ns / 1e9,
            "spec_steps": self.spec_steps,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_acceptance_rate": (self.spec_accepted_tokens or 0) / self.spec_draft_tokens
            if self.spec_draft_tokens
            else None,
            "spec_mean_accepted_length": ((self.spec_accepted_tokens or 0) + self.spec_steps)
            / self.spec_steps
            if self.spec_steps
            else None,
            "prefix_group": request.prefix_group,
            "session_id": request.session_id,
            "turn": request.turn,
            "lora": request.lora,
            "structured": None if constraint is None else constraint.kind,
            "structured_enforced": None if constraint is None else enforced is not None,
            # whether the output satisfies its constraint (jsonschema for a schema); None for
            # a free request, or one that did not finish
            "structured_valid": None
            if constraint is None or not ok
            else constraint.matches(self.output_text),
            "structured_compile_s": None
            if self.structured_compile_ns is None
            else self.structured_compile_ns / 1e9,
            "structured_cache_hit": self.structured_cache_hit,
            "structured_forced_tokens": self.structured_forced_tokens,
            **self._tool_columns(ok),
        }

    def _tool_columns(self, ok: bool) -> dict[str, Any]:
        """A request with tools: its tool choice, how many calls it made, and whether they
        are valid (each names an offered function, its arguments satisfy that function's
        schema): judged where calls were due (required, a named function) or made (auto)."""
        tools = self.item.request.tools
        if tools is None:
            return {"tool_choice": None, "tool_calls": None, "tool_calls_valid": None}
        calls = () if self.tool_output is None else self.tool_output.calls
        judged = ok and (tools.mode in ("required", "named") or bool(calls))
        return {
            "tool_choice": tools.named if tools.mode == "named" else tools.mode,
            "tool_calls": len(calls) if ok else None,
            "tool_calls_valid": (bool(calls) and tools.calls_valid(calls)) if judged else None,
        }


#: The fewest finished requests before a fraction `max_errors` applies: the first failure of
#: a run is not yet a rate.
MAX_ERRORS_MIN_FINISHED = 20


@dataclass(frozen=True)
class RunBounds:
    """When the driver stops before the workload's end (harness/running/run_config.py's
    RunConfig holds the options and their checks)."""

    max_duration_s: float | None = None  # seconds after the start; None: no bound
    grace_s: float = 10.0  # after a stop, in-flight requests may finish this long
    #: >= 1: stop once that many requests have failed; in (0, 1): once that fraction of the
    #: finished ones has (after MAX_ERRORS_MIN_FINISHED of them); None: no bound
    max_errors: float | None = None
    saturation: SaturationConfig | None = None  # None: not watched

    @property
    def any(self) -> bool:
        return (
            self.max_duration_s is not None
            or self.max_errors is not None
            or self.saturation is not None
        )


class Driver:
    """Runs one workload against one loaded backend, emitting rows to `sink`."""

    def __init__(
        self,
        backend: Backend,
        sink: RowSink,
        on_request_done: Callable[[RequestTrace], None] | None = None,
        clock: Clock = now_ns,
        sleep: Sleep = asyncio.sleep,
        bounds: RunBounds | None = None,
    ) -> None:
        self.backend = backend
        self.bounds = bounds or RunBounds()
        self.sink = sink
        self.on_request_done = on_request_done
        self.clock = clock
        self.sleep = sleep
        self.t0 = 0
        self.overhead_ns = 0  # the driver's own work, perf_counter_ns, accumulated
        self.wall_ns = 0  # the whole drive, perf_counter_ns
        self.slots: asyncio.Semaphore | None = None  # a capped open loop's, per run
        # per run: why it stopped early (None: it did not), and its counts
        self.stopped_by: str | None = None  # "saturation" | "max_duration_s" | "max_errors"
        self.stop_reason: str | None = None
        self.saturation: dict[str, Any] | None = None  # the detector's evidence
        self.num_planned = 0
        self.num_rows = 0  # requests with a row (sent, or failed as a failed turn's follower)
        self.num_failed = 0
        self.num_cancelled = 0
        self.first_error: str | None = None  # the first failed request's, for max_errors
        self.num_sent = 0  # requests handed to the backend
        self.num_failed_unsent = 0  # later turns failed with their session, never sent

    @property
    def num_unsent(self) -> int:
        """The workload's requests never sent because the run stopped (a failed session's
        later turns have rows). A run interrupted (Ctrl-C, SIGTERM) drops the rows of the
        requests in flight: those were sent, and are not counted here."""
        return self.num_planned - self.num_sent - self.num_failed_unsent

    @property
    def overhead_fraction(self) -> float | None:
        """The driver's own work (events, rows, sinks) / the run's wall time."""
        return self.overhead_ns / self.wall_ns if self.wall_ns > 0 else None

    def run(
        self,
        workload: list[WorkloadRequest],
        concurrency: int | None = None,
        max_concurrency: int | None = None,
        t0: int | None = None,
    ) -> int:
        """Drive the workload to completion; return t0 (ns) for relative times.

        `concurrency`: a closed loop of that many; `max_concurrency`: an open loop's cap on
        the requests in flight (None: none); `t0`: start then (on this driver's clock) rather
        than now."""
        for name, value in (("concurrency", concurrency), ("max_concurrency", max_concurrency)):
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} is invalid; allowed: an integer >= 1")
        if concurrency is not None and max_concurrency is not None:
            raise ValueError(
                f"max_concurrency: {max_concurrency} is invalid; allowed: None with a closed "
                f"loop (concurrency={concurrency} already is the number in flight)"
            )
        return asyncio.run(self._run(workload, concurrency, max_concurrency, t0))

    async def _run(
        self,
        workload: list[WorkloadRequest],
        concurrency: int | None,
        max_concurrency: int | None,
        t0: int | None = None,
    ) -> int:
        ids = {w.request_id for w in workload}
        orphans = [w.request_id for w in workload if w.follows and w.follows not in ids]
        if orphans:
            raise ValueError(
                f"workload: requests {orphans[:5]} follow requests that are not in the workload"
            )
        self.followers: dict[str, list[WorkloadRequest]] = defaultdict(list)
        for w in workload:
            if w.follows:
                self.followers[w.follows].append(w)
        roots = sorted((w for w in workload if not w.follows), key=lambda w: w.arrival_s)
        self.num_planned, self.num_rows, self.num_failed, self.num_cancelled = (
            len(workload),
            0,
            0,
            0,
        )
        self.num_sent = self.num_failed_unsent = 0
        self.stopped_by = self.stop_reason = self.saturation = self.first_error = None
        self._stopping = asyncio.Event()
        # request id -> (its trace, the task reading its stream), while it is in flight
        self._in_flight: dict[str, tuple[RequestTrace, asyncio.Task[Any]]] = {}
        self._outstanding = 0  # requests due and not finished (sent, or waiting for a slot)
        self._waiting: int | None = None  # the engine's queue at its last step record
        self._detector: SaturationDetector | None = None
        background: list[asyncio.Task[None]] = []
        self._background = background
        # asyncio's Semaphore wakes its waiters in the order they came and lets no newcomer
        # past one still waiting, so the slots go first come, first served
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
        if t0 is not None and t0 > self.clock():
            await self.sleep((t0 - self.clock()) / 1e9)
        wall_start = time.perf_counter_ns()
        self.t0 = self.clock() if t0 is None else t0
        observer = self._on_step
        self.backend.step_observers.append(observer)
        tasks: list[asyncio.Task[None]] = []
        bounds = self.bounds
        if bounds.max_duration_s is not None:
            background.append(asyncio.create_task(self._deadline(bounds.max_duration_s)))
        if bounds.saturation is not None:
            self._detector = SaturationDetector(bounds.saturation)
            background.append(asyncio.create_task(self._watch(self._detector)))
        try:
            if concurrency is None:
                for item in roots:
                    arrival = self.t0 + int(item.arrival_s * 1e9)
                    delay = (arrival - self.clock()) / 1e9
                    if delay > 0:
                        await self._pause(delay)
                    if self._stopping.is_set():
                        break
                    tasks.append(asyncio.create_task(self._session(item, arrival)))
            else:
                queue = deque(roots)
                tasks = [
                    asyncio.create_task(self._worker(queue))
                    for _ in range(min(concurrency, len(roots)))
                ]
            await asyncio.gather(*tasks)
        finally:
            for task in [*tasks, *background]:
                task.cancel()
            self.backend.step_observers.remove(observer)
            self.wall_ns = time.perf_counter_ns() - wall_start
        return self.t0

    async def _worker(self, queue: deque[WorkloadRequest]) -> None:
        """Closed loop: one slot of the concurrency; it carries a whole session at a time."""
        while queue and not self._stopping.is_set():
            await self._session(queue.popleft(), self.clock())

    async def _session(self, item: WorkloadRequest, arrival_ns: int) -> None:
        """Send `item`, then (after their think time) the turns that follow it."""
        trace = await self._one(item, arrival_ns)
        if trace is None:  # the run stopped before it was sent: so are its followers
            return
        followers = self.followers.get(item.request_id, [])
        await asyncio.gather(*(self._follow_up(trace, f) for f in followers))

    async def _follow_up(self, previous: RequestTrace, item: WorkloadRequest) -> None:
        due = (previous.finished_ns or self.clock()) + int(item.arrival_s * 1e9)
        delay = (due - self.clock()) / 1e9
        if delay > 0:
            await self._pause(delay)
        if self._stopping.is_set():  # unsent, as every later turn of the session
            return
        if previous.error is not None:
            self._fail_session(item, due, f"previous turn {previous.item.request_id} failed")
            return
        try:
            prompt = conversation(previous, item)
        except ValueError as exc:
            self._fail_session(item, due, str(exc))
            return
        await self._session(replace(item, request=replace(item.request, prompt=prompt)), due)

    def _fail_session(self, item: WorkloadRequest, due_ns: int, error: str) -> None:
        """A turn that cannot be sent fails, and so does every later turn of its session:
        each keeps its row, so nothing goes missing from the counts."""
        now = self.clock()
        self.num_failed_unsent += 1
        self._emit(RequestTrace(item, due_ns, sent_ns=now, finished_ns=now, error=error))
        for follower in self.followers.get(item.request_id, []):
            self._fail_session(follower, now, f"previous turn {item.request_id} failed")

    async def _one(self, item: WorkloadRequest, arrival_ns: int) -> RequestTrace | None:
        """Send `item` once a slot is free (at once without a cap), holding it until the end;
        None: the run stopped before it could be sent."""
        self._outstanding += 1
        try:
            async with self.slots if self.slots is not None else nullcontext():
                if self._stopping.is_set():
                    return None
                return await self._send(item, arrival_ns)
        finally:
            self._outstanding -= 1

    async def _send(self, item: WorkloadRequest, arrival_ns: int) -> RequestTrace:
        trace = RequestTrace(item, arrival_ns, sent_ns=self.clock())
        self.num_sent += 1
        trace.samples_left = item.request.sampling.n
        request_id = item.request_id
        task = asyncio.current_task()
        assert task is not None
        self._in_flight[request_id] = (trace, task)
        timer = None
        if item.cancel_after_s is not None:
            reason = f"cancelled by the workload {item.cancel_after_s:g} s after it was sent"
            timer = asyncio.create_task(self._cancel_later(request_id, item.cancel_after_s, reason))
        try:
            await self._read(trace)
        except asyncio.CancelledError:
            # ours (the request's cancel) is taken back; one from outside (the run torn down)
            # goes on
            if trace.cancelled is None or task.uncancel() > 0:
                raise
            trace.finished_ns = self.clock()
        except Exception as exc:  # a backend error fails this request, not the run
            trace.finished_ns = self.clock()
            if trace.cancelled is None:
                trace.error = f"{type(exc).__name__}: {exc}"
            elif task.uncancel() > 0:  # closing the stream raised: cancelled all the same
                raise
        finally:
            del self._in_flight[request_id]
            if timer is not None:
                timer.cancel()
        if trace.finished_ns is None:
            trace.error = "stream ended without a Finished event"
            trace.finished_ns = self.clock()
        self._emit(trace)
        return trace

    async def _read(self, trace: RequestTrace) -> None:
        """The request's events into its trace, until its stream ends."""
        request_id = trace.item.request_id
        async for event in self.backend.generate(trace.item.request):
            began = time.perf_counter_ns()
            if isinstance(event, Tokens):
                for token in event.token_ids:
                    trace.token_rows.append(
                        {
                            "request_id": request_id,
                            "index": trace.output_tokens,
                            "step": event.step,
                            "time_s": (event.time_ns - self.t0) / 1e9,
                            "token_id": token,
                        }
                    )
                    trace.output_tokens += 1
                trace.output_ids.extend(event.token_ids)
                trace.output_text += event.text
                if trace.first_token_ns is None:
                    trace.first_token_ns = event.time_ns
                    if self._detector is not None:  # TTFT from arrival: a cap's wait counts
                        self._detector.first_token(
                            (event.time_ns - self.t0) / 1e9,
                            (event.time_ns - trace.arrival_ns) / 1e9,
                        )
                trace.last_token_ns = event.time_ns
            elif isinstance(event, Tokenized):
                trace.tokenized_ns = event.time_ns
                trace.prompt_tokens = event.num_prompt_tokens
            elif isinstance(event, Scheduled):
                trace.scheduled_ns = event.time_ns
            elif isinstance(event, PrefillChunk):
                trace.num_prefill_chunks += 1
                trace.prefill_tokens_computed += event.num_tokens
                if trace.scheduled_ns is None:
                    trace.scheduled_ns = event.time_ns
            elif isinstance(event, Preempted):
                trace.num_preemptions += 1
            elif isinstance(event, Finished):
                trace.samples_left -= 1
                trace.finished_ns = event.time_ns
                trace.output_text = event.text or trace.output_text
                trace.tool_output = event.tool_output or trace.tool_output
                trace.finish_reason = event.finish_reason
                trace.cached_prompt_tokens = event.cached_prompt_tokens
                trace.cached_prompt_tokens_host = event.cached_prompt_tokens_host
                trace.cached_prompt_tokens_disk = event.cached_prompt_tokens_disk
                trace.disaggregated = event.disaggregated
                if event.structured_compile_ns is not None:
                    trace.structured_compile_ns = event.structured_compile_ns
                    trace.structured_cache_hit = event.structured_cache_hit
                    trace.structured_forced_tokens = event.structured_forced_tokens
                trace.num_preemptions = event.num_preemptions
                trace.output_tokens_reported = (
                    trace.output_tokens_reported or 0
                ) + event.num_output_tokens
                if trace.prompt_tokens is None:  # no Tokenized event (an HTTP backend)
                    trace.prompt_tokens = event.num_prompt_tokens
                # n samples finish n times: their decoding time adds up
                trace.detokenize_ns = (trace.detokenize_ns or 0) + event.detokenize_ns
                if event.spec_steps is not None:  # n samples finish n times: add up
                    trace.spec_steps = (trace.spec_steps or 0) + event.spec_steps
                    trace.spec_draft_tokens = (trace.spec_draft_tokens or 0) + (
                        event.spec_draft_tokens or 0
                    )
                    trace.spec_accepted_tokens = (trace.spec_accepted_tokens or 0) + (
                        event.spec_accepted_tokens or 0
                    )
            elif isinstance(event, Failed):
                trace.samples_left = 0
                trace.finished_ns = event.time_ns
                trace.error = event.error
            self.overhead_ns += time.perf_counter_ns() - began

    def _emit(self, trace: RequestTrace) -> None:
        began = time.perf_counter_ns()
        with deferred():  # a request's rows are written whole, never cut by Ctrl-C/SIGTERM
            for row in trace.token_rows:
                self.sink("tokens", row)
            self.sink("requests", trace.row(self.t0))
        self.num_rows += 1
        if trace.cancelled is not None:
            self.num_cancelled += 1
        elif trace.error is not None:
            self.num_failed += 1
            if self.first_error is None:
                self.first_error = f"{trace.item.request_id}: {' '.join(trace.error.split())}"
            self._check_errors()
        if self.on_request_done is not None:
            self.on_request_done(trace)
        self.overhead_ns += time.perf_counter_ns() - began

    # ---- cancelling and stopping ------------------------------------------------------------

    def _cancel(self, request_id: str, reason: str) -> None:
        """Close the request's stream, if it is still open, recording it cancelled for
        `reason`. A request whose every sample has finished (its stream closing) is left be."""
        entry = self._in_flight.get(request_id)
        if entry is None:
            return
        trace, task = entry
        if trace.cancelled is None and trace.samples_left > 0:
            trace.cancelled = reason
            task.cancel()

    async def _cancel_later(self, request_id: str, after_s: float, reason: str) -> None:
        await self.sleep(after_s)
        self._cancel(request_id, reason)

    async def _pause(self, delay_s: float) -> None:
        """Sleep, but only until the run stops, if a bound may stop it."""
        if not self.bounds.any:
            await self.sleep(delay_s)
            return
        if self._stopping.is_set():
            return
        sleeper = asyncio.ensure_future(self.sleep(delay_s))
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((sleeper, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopped.cancel()

    def _stop(self, by: str, reason: str, evidence: dict[str, Any] | None = None) -> None:
        """Send nothing more; after the grace period cancel what is still in flight."""
        if self._stopping.is_set():
            return
        self.stopped_by, self.stop_reason, self.saturation = by, reason, evidence
        self._stopping.set()
        self._background.append(asyncio.create_task(self._end_of_grace(reason)))

    async def _end_of_grace(self, reason: str) -> None:
        await self.sleep(self.bounds.grace_s)
        for request_id in list(self._in_flight):
            self._cancel(request_id, reason)

    async def _deadline(self, max_duration_s: float) -> None:
        await self.sleep(max(0.0, (self.t0 + max_duration_s * 1e9 - self.clock()) / 1e9))
        self._stop("max_duration_s", f"run.max_duration_s={max_duration_s:g} reached")

    def _check_errors(self) -> None:
        bound = self.bounds.max_errors
        if bound is None:
            return
        if bound >= 1:
            hit = self.num_failed >= bound
            what = f"{self.num_failed} requests failed"
        else:
            hit = (
                self.num_rows >= MAX_ERRORS_MIN_FINISHED
                and self.num_failed >= bound * self.num_rows
            )
            what = f"{self.num_failed} of {self.num_rows} finished requests failed"
        if hit:  # the first failure's error too: the cause, not only the count
            reason = f"run.max_errors={bound:g} reached: {what}; the first, {self.first_error}"
            self._stop("max_errors", reason)

    async def _watch(self, detector: SaturationDetector) -> None:
        """Sample the requests outstanding and ask the detector, until the run stops."""
        assert self.bounds.saturation is not None
        interval = self.bounds.saturation.sample_interval_s
        while not self._stopping.is_set():
            await self.sleep(interval)
            now = (self.clock() - self.t0) / 1e9
            detector.sample(now, self._outstanding, self._waiting)
            evidence = detector.saturated(now)
            if evidence is not None:
                reason = (
                    f"run.stop_on_saturation: the server stopped keeping up {now:.1f} s into "
                    "the run (requests outstanding and TTFT growing)"
                )
                self._stop("saturation", reason, evidence)

    def _on_step(self, record: StepRecord) -> None:
        began = time.perf_counter_ns()
        self._waiting = record.num_waiting
        row = {
            "step": record.step,
            "start_s": (record.start_ns - self.t0) / 1e9,
            "end_s": (record.end_ns - self.t0) / 1e9,
            "num_seqs": record.num_seqs,
            "num_prefill_seqs": record.num_prefill_seqs,
            "num_decode_seqs": record.num_decode_seqs,
            "prefill_tokens": record.prefill_tokens,
            "decode_tokens": record.decode_tokens,
            "padding_tokens": record.padding_tokens,
            "num_waiting": record.num_waiting,
            "kv_bytes_reserved": record.kv_bytes_reserved,
            "kv_bytes_used": record.kv_bytes_used,
            "num_preempted": record.num_preempted,
            "num_running": record.num_running,
            "kv_blocks_used": record.kv_blocks_used,
            "kv_blocks_shared": record.kv_blocks_shared,
            "kv_bytes_copied": record.kv_bytes_copied,
            "structured_rows": record.structured_rows,
            "structured_mask_s": record.structured_mask_ns / 1e9,
            "lora_adapters": record.lora_adapters,
            "lora_rows": record.lora_rows,
            "lora_rows_max": record.lora_rows_max,
            "moe_expert_tokens": list(record.moe_expert_tokens) or None,
            "moe_imbalance": expert_imbalance(record.moe_expert_tokens),
            "moe_experts_touched": record.moe_experts_touched,
            "moe_expert_s": record.moe_expert_ns / 1e9,
            "forward_s": record.forward_ns / 1e9,
            "kv_gather_s": record.kv_gather_ns / 1e9,
            "logits_tokens": record.logits_tokens,
            "attention_pairs": record.attention_pairs,
            "kv_tokens_read": record.kv_tokens_read,
            "kv_tokens_written": record.kv_tokens_written,
            "spec_draft_tokens": record.spec_draft_tokens,
            "spec_accepted_tokens": record.spec_accepted_tokens,
            "draft_s": record.draft_ns / 1e9,
            "spec_drafts_by_position": list(record.spec_drafts_by_position),
            "spec_accepted_by_position": list(record.spec_accepted_by_position),
            "comm_s": record.comm_ns / 1e9,
            "comm_bytes": record.comm_bytes,
            "broadcast_s": record.broadcast_ns / 1e9,
            "broadcast_bytes": record.broadcast_bytes,
            "kv_bytes_saved": record.kv_bytes_saved,
            "kv_bytes_loaded": record.kv_bytes_loaded,
            "kv_transfer_s": record.kv_transfer_ns / 1e9,
            "kv_disk_read_bytes": record.kv_disk_read_bytes,
            "kv_disk_read_s": record.kv_disk_read_ns / 1e9,
            "instance": record.instance or None,
        }
        self.sink("steps", row)
        self.overhead_ns += time.perf_counter_ns() - began


def conversation(previous: RequestTrace, item: WorkloadRequest) -> Any:
    """The prompt of a follow-up turn: the previous turn's prompt and reply, then the new part
    (for a turn answering tool calls, a tool message with the result of each call first)."""
    before, new = previous.item.request.prompt, item.request.prompt
    if item.tool_results is not None:
        return [*before, *tool_turn(previous, item.tool_results), *new]
    if is_chat(new):
        if not is_chat(before):
            raise ValueError(f"{item.request_id}: a chat turn cannot follow a non-chat prompt")
        return [*before, {"role": "assistant", "content": previous.output_text}, *new]
    if isinstance(new, list):
        if not isinstance(before, list) or (before and isinstance(before[0], dict)):
            raise ValueError(f"{item.request_id}: a token-id turn must follow a token-id prompt")
        return [*before, *previous.output_ids, *new]
    if not isinstance(before, str):
        raise ValueError(f"{item.request_id}: a text turn must follow a text prompt")
    return before + previous.output_text + new


def tool_turn(previous: RequestTrace, results: dict[str, str]) -> list[dict[str, Any]]:
    """The previous turn's answer with its tool calls, then each call's result as a tool
    message (a function the workload has no result for answers with an error, as a real
    tool runner would); ValueError when it made no call, which leaves nothing to answer."""
    output = previous.tool_output
    if not is_chat(previous.item.request.prompt) or output is None or not output.calls:
        raise ValueError(
            f"the previous turn {previous.item.request_id} made no tool call, so there is no "
            "result to send"
        )
    answers = []
    for call in output.calls:
        name = call["function"]["name"]
        result = results.get(name, json.dumps({"error": f"no function named {name!r}"}))
        answers.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return [output.message(), *answers]


def _disaggregated_columns(facts: DisaggregatedFacts | None) -> dict[str, Any]:
    """A disaggregated engine's request facts as columns (all None for a colocated one)."""

    def seconds(ns: int | None) -> float | None:
        return None if ns is None else ns / 1e9

    if facts is None:
        return dict.fromkeys(DISAGGREGATED_COLUMNS)
    return {
        "pd_prefill_instance": facts.prefill_instance,
        "pd_decode_instance": facts.decode_instance,
        "pd_kv_bytes": facts.kv_bytes,
        "pd_kv_transfer_s": seconds(facts.kv_transfer_ns),
        "pd_decode_queue_s": seconds(facts.decode_queue_ns),
        "pd_fallback": facts.fallback,
    }
