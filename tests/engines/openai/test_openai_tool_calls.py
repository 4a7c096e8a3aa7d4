"""engine=openai with tools (issue 40), against scripted answers: the request carries the
tools, the tool choice as OpenAI writes it and parallel_tool_calls where it changes the
default; streamed `delta.tool_calls` fragments (OpenAI's layout: an id and a name first, then
pieces of the arguments, two calls told apart by index) and a whole `message.tool_calls` are
read into the Finished event's tool calls, and their tokens count; a completions API refuses
tools, named."""

from __future__ import annotations

import json
from typing import Any

import httpx
from test_openai_prompt_logprobs import TINY, events_of, scripted_backend, sse

from engines.base import Failed, Finished, GenerationRequest, Tokens
from engines.openai.backend import OpenAIBackend
from engines.openai.config import OpenAIConfig
from engines.tool_calls import ToolUse

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time?"}]


def request(choice: Any = "required", parallel: bool | None = None) -> GenerationRequest:
    return GenerationRequest("r", MESSAGES, tools=ToolUse.of(TOOLS, choice, parallel))


def fragment(index: int, **function: str) -> dict[str, Any]:
    part: dict[str, Any] = {"index": index, "function": function}
    if "name" in function:
        part |= {"id": f"call_{index}", "type": "function"}
    return part


def chunk(*calls: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    delta = {"tool_calls": list(calls)} if calls else {}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


STREAMED = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    chunk(fragment(0, name="get_weather", arguments="")),
    chunk(fragment(0, arguments='{"city": ')),
    chunk(fragment(0, arguments='"Paris"}')),
    chunk(fragment(1, name="get_time", arguments="{}")),
    chunk(finish="tool_calls"),
)


def test_the_request_carries_the_tools_and_the_choice() -> None:
    bodies: list[dict[str, Any]] = []
    backend = scripted_backend(STREAMED, bodies, api="chat")
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in (("required", None), (named, False)):
        events_of(backend, request(choice, parallel))
    first, second = bodies
    assert first["tools"] == TOOLS and first["tool_choice"] == "required"
    assert first["messages"] == MESSAGES and "parallel_tool_calls" not in first
    assert second["tool_choice"] == named and second["parallel_tool_calls"] is False


def test_streamed_fragments_become_whole_calls_and_count_as_tokens() -> None:
    events = events_of(scripted_backend(STREAMED, [], api="chat"), request())
    end = events[-1]
    assert isinstance(end, Finished) and end.finish_reason == "tool_calls"
    assert end.tool_output is not None and end.tool_output.content is None
    assert [dict(c) for c in end.tool_output.calls] == [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]  # fmt: skip
    tools = request().tools
    assert tools is not None and tools.calls_valid(end.tool_output.calls)
    # the fragments are what the model wrote: each chunk of them counts, none is content
    tokens = [e for e in events if isinstance(e, Tokens)]
    assert len(tokens) == 4 and all(e.text == "" for e in tokens)
    assert end.num_output_tokens == sum(len(e.token_ids) for e in tokens)


def test_a_whole_response_with_tool_calls_is_read_too() -> None:
    whole = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {"id": "c", "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7},
    }  # fmt: skip
    reply = json.dumps(whole).encode()

    async def handle(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=reply, headers={"content-type": "application/json"})

    config = OpenAIConfig.from_config(
        {"base_url": "http://scripted/v1", "check_server": False, "api": "chat"}, TINY
    )
    backend = OpenAIBackend(config, TINY, transport=httpx.MockTransport(handle))
    backend.load()
    end = events_of(backend, request("auto"))[-1]
    assert isinstance(end, Finished) and end.tool_output is not None
    assert end.tool_output.content == "Checking." and len(end.tool_output.calls) == 1
    assert end.num_output_tokens == 7


def test_a_request_without_tools_has_no_tool_output() -> None:
    plain = sse({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    end = events_of(scripted_backend(plain, [], api="chat"), GenerationRequest("r", MESSAGES))[-1]
    assert isinstance(end, Finished) and end.tool_output is None


def test_a_completions_api_refuses_tools() -> None:
    bodies: list[dict[str, Any]] = []
    failed = events_of(scripted_backend(STREAMED, bodies, api="completions"), request())[-1]
    assert isinstance(failed, Failed) and not bodies
    assert "tools: engine.api=completions cannot offer the model tools" in failed.error
