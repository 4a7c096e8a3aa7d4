"""The engine stepped in its own thread (EngineThread) hands each step's events to the event
loop in slices: every request still gets all of its events, in order, and the same greedy
tokens as the engine stepped directly."""

from __future__ import annotations

import asyncio

from engines.base import Finished, GenerationRequest, RequestEvent, Tokens
from engines.builtin import LLM
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from engines.stepping import DRAIN_SLICE


def test_many_streams_get_every_event_in_order_across_slices() -> None:
    num_requests, max_tokens = 3 * DRAIN_SLICE + 5, 6  # each step's events span 4 slices
    options = dict(model="tiny", max_model_len=64, max_num_seqs=num_requests)
    prompts = [[10 + i, 20 + i % 7, 30 + i % 3] for i in range(num_requests)]
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = [out.token_ids for out in LLM(**options).generate(prompts, greedy)]

    backend = BuiltinBackend(EngineConfig(**options))
    backend.load()
    thread = backend.start_engine_thread()

    async def one(i: int) -> list[RequestEvent]:
        request = GenerationRequest(f"r{i}", prompts[i], greedy)
        return [event async for event in thread.generate(request)]

    async def run() -> list[list[RequestEvent]]:
        return await asyncio.gather(*(one(i) for i in range(num_requests)))

    try:
        streams = asyncio.run(run())
    finally:
        backend.close()
    for i, events in enumerate(streams):
        assert {event.request_id for event in events} == {f"r{i}"}
        assert isinstance(events[-1], Finished) and events[-1].num_output_tokens == max_tokens
        steps = [event.step for event in events if event.step >= 0]
        assert steps == sorted(steps)  # in the order the engine made them
        tokens = [t for event in events if isinstance(event, Tokens) for t in event.token_ids]
        assert tokens == expected[i]
