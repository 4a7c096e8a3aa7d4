"""Tool calls on /v1/chat/completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`):
a named function and `required` are enforced by a grammar, so every call the server returns
names a defined function and its arguments validate against that function's schema (checked
with jsonschema), through the `openai` SDK, whole and streamed; `auto` parses Hermes blocks out
of free output; a conversation with calls and results continues; bad tools and choices are 400s
naming the field. A real uvicorn server, model=tiny (random weights: the grammar does the
work)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from tiny_server import CHAT, OPTIONS

from engines.tool_calls import ToolUse
from serving.testing import RunningServer, serve_engine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    # the tools' description makes a longer prompt than the other server tests'
    with serve_engine({**OPTIONS, "max_model_len": 1024, "kv_cache_memory_bytes": 8 << 20}) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
        yield client


def assert_valid_calls(calls: list[Any], count: int | None = None) -> None:
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a forced function
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls or [], 1)
    assert choice.message.tool_calls[0].function.name == "get_time"  # type: ignore[index]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_one_valid_call_whole_and_streamed(
    sdk: openai.OpenAI, temperature: float
) -> None:
    options: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=temperature,
        seed=4,
    )
    whole = sdk.chat.completions.create(**options).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert_valid_calls(whole.message.tool_calls or [], 1)
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in sdk.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""  # type: ignore[union-attr]
                call["arguments"] += delta.function.arguments or ""  # type: ignore[union-attr]
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [streamed[0]["name"], streamed[0]["arguments"]] == [
        whole.message.tool_calls[0].function.name,  # type: ignore[index]
        whole.message.tool_calls[0].function.arguments,  # type: ignore[index]
    ]


def test_a_conversation_with_a_call_and_its_result_continues(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    ).choices[0]
    call = (first.message.tool_calls or [])[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    reply = sdk.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_none_and_auto_answer_in_text(client: httpx.Client) -> None:
    for choice in ("none", "auto"):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 6}
        response = client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert isinstance(message["content"], str) and "tool_calls" not in message


def test_auto_parses_hermes_blocks() -> None:
    tools = ToolUse.of([_tool("get_time", TIME)], "auto", None)
    assert tools is not None
    text = 'Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    content, calls = tools.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "utc"})
    ]
    assert tools.parse("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    assert tools.parse("no calls") == ("no calls", [])


def _tool(name: str, parameters: dict[str, Any]) -> Any:
    from engines.tool_calls import ToolDefinition

    return ToolDefinition.model_validate(
        {"type": "function", "function": {"name": name, "parameters": parameters}}
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(
    client: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_the_sdks_pydantic_function_tool_parses_its_arguments(sdk: openai.OpenAI) -> None:
    """openai.pydantic_function_tool + beta.chat.completions.parse: the call's arguments come
    back parsed into the model (the SDK checks them with Pydantic)."""
    import pydantic

    class GetTime(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        zone: Literal["utc", "cet"]

    completion = sdk.beta.chat.completions.parse(
        model="tiny",
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetTime)],
        tool_choice={"type": "function", "function": {"name": "GetTime"}},
        max_tokens=40,
        temperature=0,
    )
    call = (completion.choices[0].message.tool_calls or [])[0]
    assert isinstance(call.function.parsed_arguments, GetTime)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (  # a function's parameters xgrammar cannot compile, under a named choice
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function.parameters",
        ),
        (  # parameters that are not an object schema (OpenAI's rule)
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (  # a malformed call in the history was a 500
            {
                "messages": [
                    *MESSAGES,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "type": "function", "function": "x"}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function",
        ),
    ],
)
def test_malformed_tools_and_history_are_400s_naming_the_field(
    client: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


#: Qwen2's way with tools, shortened: the tools in a system block, calls as <tool_call> JSON
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments }}}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_reads_tools_gets_them(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With a tokenizer whose chat template renders `tools` (Qwen2's way), the server passes
    the tools and the history's calls to it instead of describing them in a system message:
    the prompt is the template's, token for token."""
    from engines.builtin import LLM

    folder = tmp_path_factory.mktemp("tools_tokenizer")
    with LLM("tiny", **OPTIONS) as llm:
        llm.tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOLS_TEMPLATE})
    )
    options = {**OPTIONS, "tokenizer": str(folder), "max_model_len": 1024}
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "noon", "tool_call_id": "c1"},
    ]
    with serve_engine({**options, "kv_cache_memory_bytes": 8 << 20}) as server:
        tokenizer = server.serving.engine.tokenizer
        assert tokenizer.renders_tools
        expected = tokenizer.encode_chat(history, True, [dict(t) for t in TOOLS])
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            body = {"messages": history, "tools": TOOLS, "max_tokens": 2}
            response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    assert "<tools>" in tokenizer.decode(expected, skip_special_tokens=False)
