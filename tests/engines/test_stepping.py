"""The stepping adapter (engines/stepping.py) every in-process backend steps through: events
reach their streams in order with the engine's own timestamps, a refusal or a failed step ends
only the requests it concerns, and a stream closed early aborts its request. Checked on a
scripted backend, and on the built-in one where it once went wrong."""

from __future__ import annotations

import asyncio

from engines.base import Failed, Finished, GenerationRequest, RequestEvent, Tokens
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from engines.stepping import SteppedBackend

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Scripted(SteppedBackend):
    """Each step gives every open request one token stamped 1000 x the step number (not the
    adapter's clock); a request finishes at its max_tokens; the step `fail_at` raises."""

    def __init__(self, fail_at: int = -1) -> None:
        super().__init__()
        self.open: dict[str, int] = {}  # request id -> tokens left
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at = fail_at

    def load(self) -> None:
        pass

    def _submit(self, request: GenerationRequest) -> list[RequestEvent]:
        if request.prompt == "bad":
            raise ValueError("prompt: 'bad' is invalid; allowed: anything else")
        self.open[request.request_id] = request.sampling.max_tokens
        return []

    def _has_work(self) -> bool:
        return bool(self.open)

    async def _step(self) -> list[RequestEvent]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("boom")
        events: list[RequestEvent] = []
        for request_id in list(self.open):
            self.open[request_id] -= 1
            events.append(Tokens(request_id, self.steps, 1000 * self.steps, (self.steps,)))
            if self.open[request_id] == 0:
                del self.open[request_id]
                events.append(Finished(request_id, self.steps, 1000 * self.steps, "length", 1, 4))
        return await self._in_worker(lambda: events)  # through the worker thread, as HF does

    def _abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.open.pop(request_id, None)


async def collect(backend: SteppedBackend, request: GenerationRequest) -> list[RequestEvent]:
    return [event async for event in backend.generate(request)]


def test_events_keep_the_engines_order_and_timestamps() -> None:
    backend = Scripted()

    async def run() -> list[list[RequestEvent]]:
        requests = [GenerationRequest(f"r{i}", "p", GREEDY) for i in range(3)]
        return await asyncio.gather(*(collect(backend, r) for r in requests))

    try:
        streams = asyncio.run(run())
    finally:
        backend.close()
    for events in streams:
        assert [e.time_ns for e in events] == [1000, 2000, 3000, 4000, 4000]
        assert isinstance(events[-1], Finished)


def test_a_refused_request_and_a_failed_step_end_only_their_requests() -> None:
    backend = Scripted(fail_at=2)

    async def run() -> tuple[list[RequestEvent], list[RequestEvent], list[RequestEvent]]:
        refused = await collect(backend, GenerationRequest("bad", "bad", GREEDY))
        failed = await collect(backend, GenerationRequest("r1", "p", GREEDY))
        later = await collect(backend, GenerationRequest("r2", "p", GREEDY))
        return refused, failed, later

    refused, failed, later = asyncio.run(run())
    assert len(refused) == 1 and isinstance(refused[0], Failed)
    assert "prompt: 'bad' is invalid" in refused[0].error
    assert isinstance(failed[-1], Failed) and "engine error: RuntimeError: boom" in failed[-1].error
    assert backend.aborted == ["r1"]  # the failed step's open request was aborted
    assert isinstance(later[-1], Finished) and len(later) == 5  # the loop goes on


def test_a_stream_closed_early_aborts_its_request_only() -> None:
    backend = Scripted()

    async def run() -> list[RequestEvent]:
        early = backend.generate(GenerationRequest("early", "p", GREEDY))
        other = asyncio.ensure_future(collect(backend, GenerationRequest("other", "p", GREEDY)))
        await anext(early)
        await early.aclose()  # the consumer goes away after one token
        return await other

    other = asyncio.run(run())
    assert backend.aborted == ["early"]
    assert isinstance(other[-1], Finished)


def test_a_request_id_in_use_is_refused_and_the_first_request_goes_on() -> None:
    """Before: the refused duplicate took the first request's stream with it and aborted it,
    so the first one never ended."""
    backend = BuiltinBackend(EngineConfig(model="tiny", num_threads=1, max_model_len=64))
    backend.load()

    async def run() -> tuple[list[RequestEvent], list[RequestEvent]]:
        first = backend.generate(GenerationRequest("r", [5, 6, 7], GREEDY))
        events = [await anext(first)]
        duplicate = await collect(backend, GenerationRequest("r", [8, 9], GREEDY))

        async def rest() -> list[RequestEvent]:
            return [event async for event in first]

        return events + await asyncio.wait_for(rest(), timeout=60), duplicate

    try:
        first, duplicate = asyncio.run(run())
    finally:
        backend.close()
    assert len(duplicate) == 1 and isinstance(duplicate[0], Failed)
    assert "request_id: 'r' is already in use" in duplicate[0].error
    assert isinstance(first[-1], Finished) and first[-1].num_output_tokens == 4


def test_closing_the_backend_ends_the_streams_still_open() -> None:
    """Before: close() cancelled the step loop and a consumer still reading waited forever."""
    backend = BuiltinBackend(EngineConfig(model="tiny", num_threads=1, max_model_len=256))
    backend.load()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def run() -> list[RequestEvent]:
        stream = backend.generate(GenerationRequest("open", [5, 6, 7], long))
        first = await anext(stream)
        backend.close()

        async def rest() -> list[RequestEvent]:
            return [event async for event in stream]

        return [first, *await asyncio.wait_for(rest(), timeout=30)]

    events = asyncio.run(run())
    assert isinstance(events[-1], Failed) and "the backend was closed" in events[-1].error
