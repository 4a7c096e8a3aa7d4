"""The built-in engine behind the harness's async `Backend` interface.

One task runs the engine's step loop on the caller's event loop; `generate` queues a request
and yields its events as steps produce them. Because a step runs to completion before the loop
yields, a request that arrives mid-step is admitted at the next step boundary, so queueing
delay is real. Closing a request's stream early aborts it and frees its KV memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engines.base import (
    TERMINAL_EVENTS,
    Backend,
    Failed,
    GenerationRequest,
    RequestEvent,
    now_ns,
)
from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine


class BuiltinBackend(Backend):
    name = "builtin"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config.validate()
        self.engine: LLMEngine | None = None
        self._queues: dict[str, asyncio.Queue[RequestEvent]] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None

    def load(self) -> None:
        self.engine = LLMEngine(self.config)
        self.engine.step_observers.append(self.emit_step)

    @property
    def tokenizer(self):
        assert self.engine is not None, "load() first"
        return self.engine.tokenizer

    def describe(self) -> dict[str, Any]:
        assert self.engine is not None, "load() first"
        return {"backend": self.name, **self.engine.describe()}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        assert self.engine is not None, "load() first"
        self._ensure_loop()
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._queues[request.request_id] = queue
        try:
            try:
                self.engine.add_request(request.request_id, request.prompt, request.sampling,
                                        priority=request.priority)
            except (ValueError, TypeError) as exc:
                yield Failed(request.request_id, self.engine.scheduler.step_counter, now_ns(),
                             str(exc))
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
                    events.append(Failed(request_id, engine.scheduler.step_counter, now_ns(),
                                         f"engine error: {type(exc).__name__}: {exc}"))
            for event in events:
                queue = self._queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            await asyncio.sleep(0)  # let arrivals and consumers run between steps

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine = None
