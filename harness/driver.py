"""The driver sends each workload request to the backend at its arrival time and turns the
events that come back into request, token and step rows.

Times in the rows are seconds since the run's start (`t0`), all from the backend's one clock.
Arrival is the time the workload asked for; `sent_s` is when the request was actually handed
over (their difference is the driver's lateness, recorded, never hidden).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.base import (
    Backend,
    Failed,
    Finished,
    Preempted,
    PrefillChunk,
    Scheduled,
    StepRecord,
    Tokenized,
    Tokens,
    now_ns,
)
from workloads.request import WorkloadRequest

RowSink = Callable[[str, dict[str, Any]], None]


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
    output_tokens: int = 0
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    token_rows: list[dict[str, Any]] = field(default_factory=list)

    def row(self, t0: int) -> dict[str, Any]:
        def rel(ns: int | None) -> float | None:
            return None if ns is None else (ns - t0) / 1e9

        request = self.item.request
        return {
            "request_id": request.request_id,
            "status": "failed" if self.error is not None else "ok",
            "error": self.error,
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
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_preemptions": self.num_preemptions,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_group": request.prefix_group,
            "session_id": request.session_id,
            "turn": request.turn,
        }


class Driver:
    """Runs one workload against one loaded backend, emitting rows to `sink`."""

    def __init__(self, backend: Backend, sink: RowSink,
                 on_request_done: Callable[[RequestTrace], None] | None = None) -> None:
        self.backend = backend
        self.sink = sink
        self.on_request_done = on_request_done
        self.t0 = 0

    def run(self, workload: list[WorkloadRequest]) -> int:
        """Drive the workload to completion; return t0 (ns) for relative times."""
        return asyncio.run(self._run(workload))

    async def _run(self, workload: list[WorkloadRequest]) -> int:
        self.t0 = now_ns()
        observer = self._on_step
        self.backend.step_observers.append(observer)
        tasks: list[asyncio.Task[None]] = []
        try:
            for item in sorted(workload, key=lambda w: w.arrival_s):
                arrival = self.t0 + int(item.arrival_s * 1e9)
                delay = (arrival - now_ns()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(item, arrival)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            self.backend.step_observers.remove(observer)
        return self.t0

    async def _one(self, item: WorkloadRequest, arrival_ns: int) -> None:
        trace = RequestTrace(item, arrival_ns, sent_ns=now_ns())
        request_id = item.request_id
        try:
            async for event in self.backend.generate(item.request):
                if isinstance(event, Tokens):
                    for token in event.token_ids:
                        trace.token_rows.append({
                            "request_id": request_id, "index": trace.output_tokens,
                            "step": event.step, "time_s": (event.time_ns - self.t0) / 1e9,
                            "token_id": token,
                        })
                        trace.output_tokens += 1
                    if trace.first_token_ns is None:
                        trace.first_token_ns = event.time_ns
                    trace.last_token_ns = event.time_ns
                elif isinstance(event, Tokenized):
                    trace.tokenized_ns = event.time_ns
                    trace.prompt_tokens = event.num_prompt_tokens
                elif isinstance(event, Scheduled):
                    trace.scheduled_ns = event.time_ns
                elif isinstance(event, PrefillChunk):
                    trace.num_prefill_chunks += 1
                    if trace.scheduled_ns is None:
                        trace.scheduled_ns = event.time_ns
                elif isinstance(event, Preempted):
                    trace.num_preemptions += 1
                elif isinstance(event, Finished):
                    trace.finished_ns = event.time_ns
                    trace.finish_reason = event.finish_reason
                    trace.cached_prompt_tokens = event.cached_prompt_tokens
                    trace.num_preemptions = event.num_preemptions
                elif isinstance(event, Failed):
                    trace.finished_ns = event.time_ns
                    trace.error = event.error
        except Exception as exc:  # a backend error fails this request, not the run
            trace.finished_ns = now_ns()
            trace.error = f"{type(exc).__name__}: {exc}"
        if trace.finished_ns is None:
            trace.error = "stream ended without a Finished event"
            trace.finished_ns = now_ns()
        for row in trace.token_rows:
            self.sink("tokens", row)
        self.sink("requests", trace.row(self.t0))
        if self.on_request_done is not None:
            self.on_request_done(trace)

    def _on_step(self, record: StepRecord) -> None:
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
            "forward_s": record.forward_ns / 1e9,
        }
        self.sink("steps", row)
