"""Fields OpenAI defines that change nothing for a local server (`store`, `metadata`,
`service_tier`, `reasoning_effort`, ...) are accepted and ignored, as vLLM does: with a
realistic value each gives 200 and the same greedy tokens as without it, through the `openai`
SDK and raw httpx; a value of the wrong type, or one that asks for something the server cannot
give, is still a 400 naming the field. A real uvicorn server on loopback, model=tiny."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tiny_server import CHAT, COMPLETIONS, OPTIONS, PROMPT

from serving.testing import RunningServer, serve_engine

MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]
GREEDY: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}

#: each ignored chat field with a value a real client sends
CHAT_HINTS: dict[str, Any] = {
    "store": True,
    "metadata": {"experiment": "ablation-3", "owner": "lab"},
    "service_tier": "auto",
    "reasoning_effort": "low",
    "verbosity": "medium",
    "modalities": ["text"],
    "prediction": None,
    "prompt_cache_key": "session-42",
    "prompt_cache_retention": "in_memory",
    "safety_identifier": "user-hash-9f2c",
    "user": "alice",
    "top_logprobs": 0,
}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def chat_text(client: httpx.Client, **extra: Any) -> str:
    response = client.post(CHAT, json={**GREEDY, "messages": MESSAGES, **extra})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def assert_refused(response: httpx.Response, param: str, code: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert param.split(".")[0] in error["message"], error


@pytest.mark.parametrize("field", sorted(CHAT_HINTS))
def test_each_ignored_chat_field_changes_nothing(client: httpx.Client, field: str) -> None:
    plain = chat_text(client)
    assert plain  # a greedy answer to compare against
    assert chat_text(client, **{field: CHAT_HINTS[field]}) == plain


def test_all_ignored_fields_at_once_streaming_too(client: httpx.Client) -> None:
    plain = chat_text(client)
    assert chat_text(client, **CHAT_HINTS) == plain
    with client.stream(
        "POST", CHAT, json={**GREEDY, "messages": MESSAGES, **CHAT_HINTS, "stream": True}
    ) as response:
        assert response.status_code == 200
        body = response.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_the_sdk_sends_them_as_typed_arguments(sdk: openai.OpenAI, client: httpx.Client) -> None:
    plain = chat_text(client)
    got = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0,
        store=False,
        metadata={"run": "7"},
        service_tier="default",
        reasoning_effort="minimal",
        verbosity="low",
        modalities=["text"],
        prediction=None,
        prompt_cache_key="k",
        safety_identifier="s",
        user="u",
        top_logprobs=0,
    )
    assert got.choices[0].message.content == plain
    # completions: OpenAI defines `user` there (the rest are chat's)
    want = client.post(COMPLETIONS, json={**GREEDY, "prompt": PROMPT}).json()
    completion = sdk.completions.create(prompt=PROMPT, user="alice", **GREEDY)
    assert completion.choices[0].text == want["choices"][0]["text"]


BAD_VALUES: list[tuple[dict[str, Any], str, str]] = [
    ({"metadata": 5}, "metadata", "invalid_type"),
    ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"store": "yes"}, "store", "invalid_type"),
    ({"service_tier": "gold"}, "service_tier", "invalid_value"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ({"verbosity": 3}, "verbosity", "invalid_value"),
    ({"modalities": "text"}, "modalities", "invalid_type"),
    ({"modalities": ["video"]}, "modalities[0]", "invalid_value"),
    ({"prompt_cache_key": 42}, "prompt_cache_key", "invalid_type"),
    ({"safety_identifier": ["a"]}, "safety_identifier", "invalid_type"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "invalid_value"),
    ({"user": 7}, "user", "invalid_type"),
    ({"top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"top_logprobs": "0"}, "top_logprobs", "invalid_type"),
    # well-formed, but they ask for what the server cannot give
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    (
        {"prediction": {"type": "content", "content": "x"}},
        "prediction",
        "unsupported_parameter",
    ),
    # alternatives without logprobs: true (OpenAI and vLLM refuse them too)
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"logprobs": False, "top_logprobs": 20}, "top_logprobs", "invalid_value"),
]


@pytest.mark.parametrize(
    ("extra", "param", "code"), BAD_VALUES, ids=[f"{p}-{c}" for _, p, c in BAD_VALUES]
)
def test_a_bad_value_is_a_400_naming_the_field(
    client: httpx.Client, extra: dict[str, Any], param: str, code: str
) -> None:
    response = client.post(CHAT, json={**GREEDY, "messages": MESSAGES, **extra})
    assert_refused(response, param, code)


def test_top_logprobs_without_logprobs_says_what_is_allowed(client: httpx.Client) -> None:
    response = client.post(CHAT, json={**GREEDY, "messages": MESSAGES, "top_logprobs": 5})
    message = response.json()["error"]["message"]
    assert "needs logprobs: true" in message and "allowed without it: null or 0" in message


@pytest.mark.parametrize("field", ["store", "metadata", "reasoning_effort", "prediction"])
def test_chat_only_fields_stay_unknown_on_completions(client: httpx.Client, field: str) -> None:
    # OpenAI's /v1/completions does not define them: unknown there, as OpenAI answers
    value = CHAT_HINTS[field]
    response = client.post(COMPLETIONS, json={**GREEDY, "prompt": PROMPT, field: value})
    assert_refused(response, field, "unknown_parameter")


def test_fields_openai_does_not_define_stay_unknown(client: httpx.Client) -> None:
    response = client.post(CHAT, json={**GREEDY, "messages": MESSAGES, "bogus": 1})
    assert_refused(response, "bogus", "unknown_parameter")


def test_the_sdk_surfaces_a_bad_hint_as_bad_request(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"metadata": 5},
        )
    assert (refused.value.code, refused.value.param) == ("invalid_type", "metadata")


@pytest.mark.parametrize("key", [" 5", "+5", "1_0", "\u0665", "5 ", "0x5", "1" * 21])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_refused(
    client: httpx.Client, key: str
) -> None:
    """Hostile pass (issue 39): Python's int() took " 5", "+5", "1_0" and "٥" (an Arabic-Indic
    five) as token ids; OpenAI's keys are token ids written in ASCII digits."""
    response = client.post(COMPLETIONS, json={**GREEDY, "prompt": PROMPT, "logit_bias": {key: 1}})
    assert_refused(response, "logit_bias", "invalid_value")
    assert "not a token id" in response.json()["error"]["message"]


def test_allowed_token_ids_left_empty_by_bad_words_or_min_tokens_are_a_400(
    client: httpx.Client,
) -> None:
    """Hostile pass (issue 39): such a request sampled token 0 (outside allowed_token_ids)
    until max_tokens, with a 200; now a 400 naming allowed_token_ids."""
    word = client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False})
    (hello,) = word.json()["tokens"]
    for extra in (
        {"allowed_token_ids": [hello], "bad_words": ["Hello"]},
        {"allowed_token_ids": [hello], "stop_token_ids": [hello], "min_tokens": 1},
    ):
        for route, body in ((COMPLETIONS, {"prompt": PROMPT}), (CHAT, {"messages": MESSAGES})):
            response = client.post(route, json={**GREEDY, **body, **extra, "stream": True})
            assert_refused(response, "allowed_token_ids", "invalid_value")
            assert "allowed: " in response.json()["error"]["message"]


def test_a_tiny_repetition_penalty_sampled_repeats_the_prompt_token(client: httpx.Client) -> None:
    """Hostile pass (issue 39): repetition_penalty 1e-308 (0 in float32) at temperature 1 gave
    NaN probabilities and token 0 four times; the seen token with a positive logit (the
    prompt's "Hello") is now all but certain, as greedy decoding picks it."""
    body = {"prompt": "Hello", "max_tokens": 4, "seed": 1, "return_token_ids": True}
    choices = [
        client.post(
            COMPLETIONS, json={**body, "repetition_penalty": 1e-308, "temperature": t}
        ).json()["choices"][0]
        for t in (0.0, 1.0)
    ]
    hello = choices[0]["prompt_token_ids"][-1]
    assert [c["token_ids"] for c in choices] == [[hello] * 4] * 2, choices
