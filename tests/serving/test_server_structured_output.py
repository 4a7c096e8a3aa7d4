"""Structured output through `inferlab serve`: OpenAI's `response_format` (json_object,
json_schema, through the `openai` SDK's `beta.chat.completions.parse` with a Pydantic model),
vLLM's `structured_outputs` and `guided_*` fields on both routes, streamed too; the choices
are the engine's own; a constraint the backend cannot compile, or two at once, is a 400 naming
the field the client sent. A real uvicorn server, model=tiny."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from tiny_server import CHAT, COMPLETIONS, OPTIONS, PROMPT

from engines.builtin import LLM, SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from serving.testing import RunningServer, serve_engine

pytest.importorskip("xgrammar")

MESSAGES: list[Any] = [{"role": "user", "content": "Describe a pet."}]


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    kind: Literal["cat", "dog", "fish"]
    indoor: bool


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS) as running:
        yield running


def test_the_sdks_parse_returns_a_validated_pydantic_object(server: RunningServer) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as sdk:
        completion = sdk.beta.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=60, temperature=0
        )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet)
    assert Pet.model_validate_json(message.content or "") == message.parsed


def test_the_routes_give_the_engines_own_guided_outputs(client: httpx.Client) -> None:
    regex = StructuredOutputsParams(regex=r"[0-9]{2}:[0-9]{2}")
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=regex)
    with LLM("tiny", **OPTIONS) as llm:
        expected = llm.generate(PROMPT, params)[0].text
    for extra in ({"structured_outputs": {"regex": regex.regex}}, {"guided_regex": regex.regex}):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}
        response = client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"choice": ["red", "green", "blue"]}},
        {"guided_choice": ["up", "down"]},
        {"guided_json": Pet.model_json_schema()},
    ],
)
def test_streamed_equals_whole_and_is_valid(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, **extra}
    whole = client.post(CHAT, json=body)
    assert whole.status_code == 200, whole.text
    text = whole.json()["choices"][0]["message"]["content"]
    streamed = ""
    with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice["delta"].get("content") or ""
    assert streamed == text
    choices = extra.get("structured_outputs", {}).get("choice") or extra.get("guided_choice")
    if choices:
        assert text in choices
    elif whole.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(
    client: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, **extra}
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_text_response_format_changes_nothing(client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    text = client.post(CHAT, json={**body, "response_format": {"type": "text"}})
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"] == plain
