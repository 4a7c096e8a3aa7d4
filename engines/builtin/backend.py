"""The built-in engine behind the harness's async `Backend` interface, through the stepping
adapter (engines/stepping.py). The engine's step loop runs one of two ways:

- On the caller's event loop (the default; the harness runs this way). A task steps the engine
  and yields once between steps, so a request submitted mid-step is admitted at the next step
  boundary and queueing delay is real. Submissions made in one go (an offline workload) all
  land before the next step, so batches are deterministic.
- In a thread of its own (`start_engine_thread()`; `inferlab serve` runs this way, as vLLM's
  engine core runs apart from its API server). The event loop then never waits for a step: it
  reads new requests and writes tokens while the engine computes. See `EngineThread`.

Either way `generate` yields a request's events as steps produce them, with the engine's own
timestamps, and closing a request's stream early aborts it and frees its KV memory.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any, cast

from engines.base import (
    BackendCapabilities,
    Failed,
    Finished,
    GenerationRequest,
    RequestEvent,
    is_chat,
    now_ns,
)
from engines.builtin.config import EngineConfig
from engines.builtin.engine import EngineDeadError, LLMEngine
from engines.builtin.factory import build_engine
from engines.builtin.step_stats import EngineGauges
from engines.stepping import SteppedBackend, SteppingThread
from engines.tool_calls import ToolUse, tool_prompt


class BuiltinBackend(SteppedBackend):
    name = "builtin"
    refusals = (ValueError, TypeError, EngineDeadError)
    capabilities = BackendCapabilities(quality_probe="engine")

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        self.config = config  # checked when it was built
        self.engine: LLMEngine | None = None
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

    def served_adapters(self) -> tuple[str, ...]:
        assert self.engine is not None, "load() first"
        lora = self.engine.lora
        return () if lora is None else lora.names

    def start_engine_thread(self, max_requests: int = 1 << 16) -> EngineThread:
        """From now on step the engine in a thread of its own (idempotent). Afterwards only
        that thread may call the engine's stateful methods; use `engine_thread.call`."""
        assert self.engine is not None, "load() first"
        if self.engine_thread is None:
            if self._step_task is not None and not self._step_task.done():
                raise RuntimeError("the engine is already stepping on an event loop")
            self.engine_thread = EngineThread(self.engine, max_requests, refusals=self.refusals)
            self.engine_thread.start()
        return self.engine_thread

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        assert self.engine is not None, "load() first"
        if request.tools is not None:
            return self._generate_with_tools(request, request.tools)
        return self._generate(request)

    def _generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        if self.engine_thread is not None:
            return self.engine_thread.generate(request)
        return super().generate(request)

    async def _generate_with_tools(
        self, request: GenerationRequest, tools: ToolUse
    ) -> AsyncIterator[RequestEvent]:
        """The tools rendered into the chat prompt, the tool choice's grammar on the
        sampling, and each answer's tool calls parsed out of its text, as `inferlab serve`
        does (engines/tool_calls.py)."""
        try:
            if not is_chat(request.prompt):
                raise ValueError(
                    "tools: a request with tools needs a chat prompt (a list of messages)"
                )
            messages, template_tools = tool_prompt(
                list(request.prompt), tools, self.tokenizer.renders_tools
            )
            prompt = self.tokenizer.encode_chat(messages, True, template_tools)
            sampling = tools.constrain(request.sampling)
        except ValueError as exc:
            yield Failed(request.request_id, self._event_step(), now_ns(), str(exc))
            return
        events = cast(
            AsyncGenerator[RequestEvent, None],
            self._generate(replace(request, prompt=prompt, sampling=sampling)),
        )
        async with aclosing(events):  # closing this stream closes (aborts) the engine's
            async for event in events:
                if isinstance(event, Finished):
                    event = replace(event, tool_output=tools.output(event.text))
                yield event

    # ---- on the caller's event loop: the adapter's hooks ----------------------------------

    def _submit(self, request: GenerationRequest) -> list[RequestEvent]:
        assert self.engine is not None, "load() first"
        self.engine.add_request(
            request.request_id,
            request.prompt,
            request.sampling,
            priority=request.priority,
            lora_name=request.lora,
        )
        return []  # Arrived and Tokenized come with the next step's events

    def _has_work(self) -> bool:
        assert self.engine is not None
        return self.engine.has_unfinished_requests()

    async def _step(self) -> list[RequestEvent]:
        assert self.engine is not None
        return self.engine.step()

    def _abort(self, request_id: str) -> None:
        engine = self.engine  # None once closed
        if engine is not None and engine.has_request(request_id):
            engine.abort_request(request_id)

    def _event_step(self) -> int:
        return -1 if self.engine is None else self.engine.step_counter

    def failure(self) -> str | None:
        return None if self.engine is None else self.engine.failure

    def close(self) -> None:
        if self.engine_thread is not None:
            self.engine_thread.stop()
            self.engine_thread = None
        self._stop_stepping(wait_for_worker=False)
        if self.engine is not None:
            self.engine.close()  # ends its other tensor-parallel ranks, if any
        self.engine = None


class EngineThread(SteppingThread[LLMEngine]):
    """The built-in engine stepped in a thread of its own (engines/stepping.py), publishing its
    gauges for readers on other threads (the server's /metrics)."""

    def __init__(self, engine: LLMEngine, *args: Any, **kwargs: Any) -> None:
        super().__init__(engine, *args, **kwargs)
        # as of the end of the last step or command: a frozen object, replaced whole
        self.stats = EngineGauges()

    def _publish_stats(self) -> None:
        self.stats = self.engine.gauges()
