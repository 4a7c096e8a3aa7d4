"""The OpenAI-compatible server (serving/): responses match the engine's direct output, usage
is right, bad requests get 400 with OpenAI's error body, /metrics is Prometheus text whose
counters move. A real uvicorn server on loopback, model=tiny."""

from __future__ import annotations

import json
import math
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_server import CHAT, COMPLETIONS, OPTIONS, PROMPT

from engines.builtin import LLM, EngineConfig, SamplingParams
from engines.builtin.backend import BuiltinBackend
from serving import ServerConfig
from serving import cli as serve_cli
from serving.auth import is_loopback
from serving.testing import RunningServer, serve_engine, serve_in_thread

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS, ServerConfig(max_queue_len=16)) as running:
        yield running


@pytest.fixture(scope="module")
def direct() -> LLM:
    """The same engine options and dummy weights, driven in process."""
    return LLM(model="tiny", **OPTIONS)


# ---- helpers ----------------------------------------------------------------------------------


def sse_payloads(response: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body, checking the framing: `data: ...` blocks separated
    by blank lines, ending with `data: [DONE]`."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    blocks = blocks[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]"
    assert "data: [DONE]" not in blocks[:-1]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def stream(client: httpx.Client, path: str, payload: dict[str, Any]) -> list[Any]:
    return sse_payloads(client.post(path, json={**payload, "stream": True}))


def assert_error(response: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert isinstance(error["message"], str) and error["message"]
    assert not error["message"].startswith("SamplingParams."), error  # the client's names
    assert (error["param"], error["code"]) == (param, code), error


def usage_of(expected: list[Any]) -> dict[str, int]:
    prompt = len(expected[0].prompt_token_ids)
    completion = sum(len(o.token_ids) for r in expected for o in r.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# ---- completions ------------------------------------------------------------------------------


def test_completion_greedy_matches_engine(client: httpx.Client, direct: LLM) -> None:
    expected = direct.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}

    body = client.post("/v1/completions", json=payload).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny"
    assert body["choices"] == [
        {
            "index": 0,
            "text": expected[0].text,
            "logprobs": None,
            "finish_reason": expected[0].finish_reason,
        }
    ]
    assert body["usage"] == usage_of(expected)

    chunks = stream(
        client, "/v1/completions", {**payload, "stream_options": {"include_usage": True}}
    )
    *token_chunks, finish, usage = chunks
    assert len(token_chunks) == len(expected[0].token_ids)  # one chunk per token
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == expected[0].text
    assert all(
        c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in token_chunks
    )
    assert finish["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": expected[0].finish_reason,
    }
    assert usage["choices"] == [] and usage["usage"] == usage_of(expected)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "text_completion"

    plain = stream(client, "/v1/completions", payload)  # no include_usage: no usage field
    assert all("usage" not in c for c in plain)
    assert all("token_ids" not in c["choices"][0] for c in plain)  # not asked for
    assert "".join(c["choices"][0]["text"] for c in plain) == expected[0].text


def test_seeded_parallel_sampling_matches_engine(client: httpx.Client, direct: LLM) -> None:
    params = dict(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=7, n=2)
    expected = direct.generate(PROMPT, SamplingParams(**params))
    texts = [o.text for o in expected[0].outputs]
    assert texts[0] != texts[1]  # the samples really differ, so the check below means something

    body = client.post("/v1/completions", json={"prompt": PROMPT, **params}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == texts
    assert body["usage"] == usage_of(expected)

    streamed = ["", ""]
    for chunk in stream(client, "/v1/completions", {"prompt": PROMPT, **params}):
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts


@pytest.mark.parametrize(
    "prompts",
    [["Hello there", "Once upon"], [[5, 6, 7, 8, 9], [42, 43]]],
    ids=["texts", "token-id-lists"],
)
def test_several_prompts_match_engine(
    client: httpx.Client, direct: LLM, prompts: list[Any]
) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    expected = [direct.generate(p, greedy)[0] for p in prompts]
    body = client.post(
        "/v1/completions", json={"prompt": prompts, "max_tokens": 6, "temperature": 0}
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [e.text for e in expected]
    prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
    completion_tokens = sum(len(e.token_ids) for e in expected)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def test_stop_string_and_exact_lengths_match_engine(client: httpx.Client, direct: LLM) -> None:
    free = direct.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ].text
    stop = free[4:7]
    assert stop.strip(), f"pick a visible stop string from {free!r}"
    expected = direct.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))[
        0
    ]
    assert expected.finish_reason == "stop"
    payload = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop}
    body = client.post("/v1/completions", json=payload).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = stream(client, "/v1/completions", payload)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text

    # ignore_eos + min_tokens: benchmark clients' way of asking for an exact length
    exact = {
        "prompt": PROMPT,
        "max_tokens": 20,
        "min_tokens": 20,
        "ignore_eos": True,
        "temperature": 0,
    }
    body = client.post("/v1/completions", json=exact).json()
    assert body["usage"]["completion_tokens"] == 20
    assert body["choices"][0]["finish_reason"] == "length"


def test_return_token_ids_as_vllm_sends_them(client: httpx.Client, direct: LLM) -> None:
    want = direct.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0]
    for path, payload in ((COMPLETIONS, {"prompt": PROMPT}), (CHAT, {"messages": MESSAGES})):
        if path == CHAT:
            want = direct.generate(MESSAGES, SamplingParams(max_tokens=6, temperature=0.0))[0]
        payload = {**payload, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        body = client.post(path, json=payload).json()
        choice = body["choices"][0]
        assert choice["token_ids"] == want.token_ids
        prompt_ids = choice["prompt_token_ids"] if path == COMPLETIONS else body["prompt_token_ids"]
        assert prompt_ids == want.prompt_token_ids

        chunks = stream(client, path, payload)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
        first = [
            c for c in chunks if "prompt_token_ids" in c or "prompt_token_ids" in c["choices"][0]
        ]
        assert len(first) == 1 and first[0] is chunks[0]  # only in the first chunk
        where = chunks[0] if path == CHAT else chunks[0]["choices"][0]
        assert where["prompt_token_ids"] == want.prompt_token_ids


def test_a_speculating_server_streams_every_kept_token(direct: LLM) -> None:
    """Speculative decoding behind the server: a step's kept drafts stream as one chunk per
    token, and the text and token ids are the engine's without speculation."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    options = {**OPTIONS, "speculative_config": ngram}
    rng = random.Random(2)
    stretch = [rng.randrange(10, 4000) for _ in range(6)]
    prompt = [rng.randrange(10, 4000) for _ in range(5)] + stretch * 3  # lookups find drafts
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    want = direct.generate([prompt], greedy)[0]
    speculated = LLM(model="tiny", **options).generate([prompt], greedy)[0].metrics
    assert speculated.spec_accepted_tokens > 1  # some step streams a burst
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    try:
        with (
            serve_in_thread(backend, ServerConfig()) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as client,
        ):
            payload = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
            chunks = stream(client, COMPLETIONS, {**payload, "return_token_ids": True})
    finally:
        backend.close()
    *token_chunks, _finish = chunks
    assert [c["choices"][0]["token_ids"] for c in token_chunks] == [[t] for t in want.token_ids]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == want.text


# ---- chat -------------------------------------------------------------------------------------


def test_chat_matches_engine(client: httpx.Client, direct: LLM) -> None:
    expected = direct.generate(MESSAGES, SamplingParams(max_tokens=8, temperature=0.0))
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}

    body = client.post("/v1/chat/completions", json=payload).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "logprobs": None,
            "message": {"role": "assistant", "content": expected[0].text},
            "finish_reason": expected[0].finish_reason,
        }
    ]
    assert body["usage"] == usage_of(expected)

    # content as a list of text parts is the same conversation
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    body = client.post("/v1/chat/completions", json={**payload, "messages": parts}).json()
    assert body["choices"][0]["message"]["content"] == expected[0].text

    chunks = stream(
        client, "/v1/chat/completions", {**payload, "stream_options": {"include_usage": True}}
    )
    role, *token_chunks, finish, usage = chunks
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(token_chunks) == len(expected[0].token_ids)
    assert "".join(c["choices"][0]["delta"]["content"] for c in token_chunks) == expected[0].text
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == expected[0].finish_reason
    assert usage["choices"] == [] and usage["usage"] == usage_of(expected)


PENALTIES: dict[str, Any] = {
    "presence_penalty": 1.2,
    "frequency_penalty": 0.6,
    "repetition_penalty": 1.4,
    "min_p": 0.05,
    "allowed_token_ids": list(range(40, 400)),
    "bad_words": ["the"],
}


def test_penalties_and_masks_match_engine(client: httpx.Client, direct: LLM) -> None:
    """Penalties, min_p, logit_bias (token-id string keys, as OpenAI sends them) and vLLM's
    allowed_token_ids / bad_words give the engine's own tokens, on both routes."""
    bias = {"41": 3.0, "300": -100.0}
    params = SamplingParams(
        max_tokens=10,
        temperature=0.8,
        seed=9,
        logit_bias={int(k): v for k, v in bias.items()},
        **PENALTIES,
    )
    common = {"max_tokens": 10, "temperature": 0.8, "seed": 9, "logit_bias": bias, **PENALTIES}
    want = direct.generate(PROMPT, params)[0].outputs[0].token_ids
    body = post_json(client, COMPLETIONS, {"prompt": PROMPT, "return_token_ids": True, **common})
    assert body["choices"][0]["token_ids"] == want
    assert set(want) <= set(PENALTIES["allowed_token_ids"])
    want = direct.generate(MESSAGES, params)[0].outputs[0].token_ids
    body = post_json(client, CHAT, {"messages": MESSAGES, "return_token_ids": True, **common})
    assert body["choices"][0]["token_ids"] == want


def post_json(client: httpx.Client, path: str, payload: dict[str, Any]) -> Any:
    response = client.post(path, json=payload)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_max_completion_tokens(client: httpx.Client) -> None:
    body = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_completion_tokens": 3, "ignore_eos": True},
    ).json()
    assert body["usage"]["completion_tokens"] == 3


# ---- errors -----------------------------------------------------------------------------------

USER = [{"role": "user", "content": "x"}]
ERROR_CASES: list[tuple[str, Any, str | None, str]] = [
    (COMPLETIONS, b"{not json", None, "invalid_json"),
    (COMPLETIONS, b"[1, 2]", None, "invalid_json"),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, "model", "model_not_found"),
    (COMPLETIONS, {"prompt": [7] * 300}, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 300}, "max_tokens", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -2}, "top_k", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        "min_tokens",
        "invalid_value",
    ),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "invalid_type"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream", "invalid_type"),
    (COMPLETIONS, {"prompt": "hi", "stop": [1]}, "stop", "invalid_value"),
    (COMPLETIONS, {"prompt": 42}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": []}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ["text", [1, 2]]}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [999999]}, "prompt", "invalid_value"),
    (COMPLETIONS, {}, "prompt", "missing_required_parameter"),
    (COMPLETIONS, {"prompt": "hi", "bogus": 1}, "bogus", "unknown_parameter"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": True}, "logprobs", "invalid_type"),
    # penalties and masks (docs/sampling.md, Penalties): out of range names the field
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    (CHAT, {"messages": USER, "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    (CHAT, {"messages": USER, "min_p": 1.5}, "min_p", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias", "invalid_value"),
    (CHAT, {"messages": USER, "logit_bias": {"999999": 1}}, "logit_bias", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "invalid_value"),
    (CHAT, {"messages": USER, "allowed_token_ids": [10**7]}, "allowed_token_ids", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi", "bad_words": [" "]}, "bad_words", "invalid_value"),
    (
        COMPLETIONS,
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        "stream_options",
        "invalid_value",
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "stream": True, "stream_options": {"other": 1}},
        "stream_options.other",
        "unknown_parameter",
    ),
    (CHAT, {"messages": []}, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content", "unsupported_parameter"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    (CHAT, {"messages": USER, "logprobs": 1}, "logprobs", "invalid_type"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs", "invalid_value"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        "tools[0].function",
        "missing_required_parameter",
    ),
    # OpenAI defines these; the server has no such feature: unsupported, not unknown
    (
        CHAT,
        {"messages": USER, "web_search_options": {}},
        "web_search_options",
        "unsupported_parameter",
    ),
    # ignored on chat (test_server_openai_fields.py), but OpenAI's completions has no `store`
    (COMPLETIONS, {"prompt": "hi", "store": True}, "store", "unknown_parameter"),
    (
        CHAT,
        {"messages": USER, "functions": [{"name": "f"}]},
        "functions",
        "unsupported_parameter",
    ),
    (
        CHAT,
        {"messages": USER, "max_completion_tokens": 1000},
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (CHAT, {"messages": USER, "model": "other"}, "model", "model_not_found"),
    (
        CHAT,
        {"messages": USER, "max_completion_tokens": 0},
        "max_completion_tokens",
        "invalid_value",
    ),
    # sample 1 would seed with 2**64, which overflowed inside an engine step and failed every
    # request running beside it
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64 - 1, "n": 2}, "seed", "invalid_value"),
    # hostile bodies (issue 15): each of these was a 500 (or a 200) before
    (COMPLETIONS, b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\udc00"}]}',
        "messages[0].content",
        "invalid_value",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
        "messages[0].content[0].text",
        "invalid_value",
    ),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
        "messages[0].name",
        "invalid_value",
    ),
    (COMPLETIONS, b'{"prompt": "hi", "\\ud800": 1}', None, "invalid_value"),
    (COMPLETIONS, b'{"prompt": "hi", "model": "\\ud800"}', "model", "invalid_value"),
    (COMPLETIONS, b"[" * 1000 + b"]" * 1000, None, "invalid_json"),
    (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "invalid_json"),
    (
        CHAT,
        b'{"messages": [], "tools": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001,
        None,
        "invalid_json",
    ),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', None, "invalid_json"),
    (COMPLETIONS, b"\xff\xfe{\x00}\x00", None, "invalid_json"),  # UTF-16
    (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', None, "invalid_json"),
    (COMPLETIONS, b'{"prompt": "hi", "top_p": -Infinity}', None, "invalid_json"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None, "invalid_json"),
    (COMPLETIONS, b"", None, "invalid_json"),
    (COMPLETIONS, b"null", None, "invalid_json"),
    # an engine step turned top_k into a float: OverflowError, every request in the batch failed
    (COMPLETIONS, {"prompt": "hi", "top_k": 10**400}, "top_k", "invalid_value"),
    # empty prompts tokenized to [BOS] and were served
    (COMPLETIONS, {"prompt": ""}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ["ok", ""]}, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt", "invalid_value"),
    # a stop token outside the vocabulary can never be sampled: it was accepted and ignored
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids", "invalid_value"),
]


@pytest.mark.parametrize(
    ("path", "payload", "param", "code"),
    ERROR_CASES,
    ids=[f"{p.rsplit('/', 1)[-1]}-{c}-{param}" for p, _, param, c in ERROR_CASES],
)
def test_bad_requests_get_400_with_openai_error(
    client: httpx.Client,
    server: RunningServer,
    path: str,
    payload: Any,
    param: str | None,
    code: str,
) -> None:
    for streaming in (False, True):
        if isinstance(payload, bytes):
            response = client.post(
                path, content=payload, headers={"content-type": "application/json"}
            )
        else:
            body = dict(payload)
            if streaming and "stream" not in body and "stream_options" not in body:
                body["stream"] = True  # a stream is refused before it starts, with the same 400
            response = client.post(path, json=body)
        assert_error(response, 400, param, code)
    assert server.serving.in_flight == 0


def test_a_json_body_must_say_application_json(client: httpx.Client, server: RunningServer) -> None:
    """A web page can POST text/plain (or a typeless Blob, or a form) to another origin without
    a CORS preflight, so a body is read only when it says it is JSON: any site a user visits
    could otherwise drive a key-less localhost server. Before, every type was parsed (200)."""
    completion = json.dumps({"prompt": "Hi", "max_tokens": 1})
    chat = json.dumps({"messages": USER, "max_tokens": 1})
    refused = [
        "text/plain;charset=UTF-8",  # a browser's fetch(url, {method: "POST", body: "..."})
        "application/x-www-form-urlencoded",  # curl -d, an HTML form
        "multipart/form-data; boundary=x",
        "application/jsonl",
        "",
        None,  # no Content-Type: a Blob body without a type
    ]
    for path, body in ((COMPLETIONS, completion), (CHAT, chat)):
        for content_type in refused:
            headers = {} if content_type is None else {"content-type": content_type}
            response = client.post(
                path, content=body, headers={**headers, "origin": "https://x.example"}
            )
            assert_error(response, 415, None, "unsupported_media_type")
            message = response.json()["error"]["message"]
            said = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
            assert said in message and "application/json" in message, message
        for content_type in (
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
        ):
            ok = client.post(path, content=body, headers={"content-type": content_type})
            assert ok.status_code == 200, (content_type, ok.text)
    assert server.serving.in_flight == 0


def test_largest_seed_for_n_is_served(client: httpx.Client) -> None:
    body = client.post(
        COMPLETIONS,
        json={"prompt": PROMPT, "seed": 2**64 - 2, "n": 2, "max_tokens": 2, "temperature": 1.0},
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1], body


def test_n_on_a_static_batching_server_is_refused_before_the_stream() -> None:
    backend = BuiltinBackend(
        EngineConfig.from_dict(
            {"model": "tiny", **OPTIONS, "kv_cache": "contiguous", "batching": "static"}
        )
    )
    backend.load()
    try:
        with (
            serve_in_thread(backend) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as static_client,
        ):
            for stream_it in (False, True):
                response = static_client.post(
                    COMPLETIONS, json={"prompt": "hi", "n": 2, "max_tokens": 2, "stream": stream_it}
                )
                assert_error(response, 400, "n", "invalid_value")
                message = response.json()["error"]["message"]
                # the field by the name the client sent, not the engine's class
                assert message.startswith("n: 2 needs parallel sampling"), message
                assert "engine.batching=static" in message
            ok = static_client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            assert running.serving.in_flight == 0
    finally:
        backend.close()


def test_closing_the_sse_body_closes_the_generation_at_once() -> None:
    """A disconnect closes the body iterator; the generation under it (whose finally aborts the
    engine request) must close then, not when the garbage collector gets to it."""
    import asyncio

    from serving.formats import CompletionWriter, event_stream
    from serving.generation import ChoiceText

    closed: list[bool] = []

    async def pieces() -> Any:
        try:
            for i in range(100):
                yield ChoiceText(0, f" t{i}", (i,))
        finally:
            closed.append(True)

    async def main() -> None:
        source = pieces()  # held here, so only an explicit close can run its finally
        body = event_stream(source, CompletionWriter("cmpl-x", 0, "tiny", [[1, 2]], 1))
        first = await body.__anext__()
        assert first.startswith(b"data: {") and not closed
        await body.aclose()
        assert closed == [True]
        del source

    asyncio.run(main())


def test_models_health_and_unknown_route(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        ("tiny", "model", 256)
    ]
    assert client.get("/health").status_code == 200
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_models_retrieve(client: httpx.Client) -> None:
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get("/v1/models/tiny").json() == listed
    assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_as_vllm_sends_them(client: httpx.Client, path: str) -> None:
    """guidellm and AIPerf ask for usage in every chunk (vLLM's extension); each chunk's usage
    counts the tokens sent so far, the last chunk the whole request."""
    prompt = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    payload = {
        **prompt,
        "max_tokens": 5,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, last = stream(client, path, payload)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    sent = 0
    for chunk in chunks:
        sent += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"] == {
            "prompt_tokens": last["usage"]["prompt_tokens"],
            "completion_tokens": sent,
            "total_tokens": last["usage"]["prompt_tokens"] + sent,
        }
    assert sent == 5
    # continuous_usage_stats rides on include_usage, as in vLLM
    payload["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    assert all("usage" not in c for c in stream(client, path, payload))


def test_chat_content_may_be_empty_where_the_template_writes_the_roles(
    client: httpx.Client,
) -> None:
    body = client.post(
        CHAT, json={"messages": [{"role": "user", "content": ""}], "max_tokens": 2}
    ).json()
    assert body["usage"]["prompt_tokens"] > 1, body  # role markers: not an empty prompt


def test_a_chat_that_renders_to_nothing_is_an_empty_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **OPTIONS}))
    backend.load()
    assert backend.engine is not None
    # a checkpoint template that writes the contents alone (the tiny tokenizer's writes roles);
    # monkeypatched: the tokenizer is the process's shared default one, and a template left
    # behind changed every later test's chats
    monkeypatch.setattr(
        backend.engine.tokenizer,
        "_chat_template",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    try:
        with (
            serve_in_thread(backend) as running,
            httpx.Client(base_url=running.base_url, timeout=60) as plain,
        ):
            empty = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
            for stream_it in (False, True):
                assert_error(
                    plain.post(CHAT, json={"messages": empty, "stream": stream_it}),
                    400,
                    "messages",
                    "invalid_value",
                )
            ok = plain.post(
                CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            )
            assert ok.status_code == 200, ok.text
    finally:
        backend.close()


def test_a_body_over_the_limit_gets_413_before_it_is_read(client: httpx.Client) -> None:
    """A 15 MB prompt is refused from its Content-Length, unread and unparsed (tokenizing it
    took 35 s before); a chunked one is counted as it arrives."""
    headers = {"content-type": "application/json"}
    big = b'{"prompt": "' + b"x" * (15 << 20) + b'"}'
    for body in (big, big[:-1]):  # valid JSON or not: either way it is never parsed
        started = time.perf_counter()
        response = client.post(COMPLETIONS, content=body, headers=headers)
        assert time.perf_counter() - started < 5.0
        assert_error(response, 413, None, "request_too_large")
        assert "8388608 bytes" in response.json()["error"]["message"]
    pieces = iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)])
    chunked = client.post(CHAT, content=pieces, headers=headers)  # no Content-Length
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, None, "request_too_large")
    assert client.get("/health").status_code == 200


# ---- a server with an API key, a body limit and a served name with a slash -------------------

API_KEY = "sk-test-0123456789"
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def guarded() -> Iterator[RunningServer]:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **OPTIONS}))
    backend.load()
    config = ServerConfig(
        api_key=API_KEY, max_body_bytes=BODY_LIMIT, served_model_name="org/tiny-chat"
    )
    with serve_in_thread(backend, config) as running:
        yield running
    backend.close()


def test_api_key_guards_every_v1_route(guarded: RunningServer) -> None:
    prompt = {"prompt": "Hi", "max_tokens": 2}
    routes = [
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/org/tiny-chat", None),
        ("POST", COMPLETIONS, prompt),
        ("POST", CHAT, {"messages": USER}),
        ("GET", "/v1/no-such-route", None),
    ]  # 401, not 404: no route map for strangers
    refused = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
        {"X-Api-Key": API_KEY},
    ]
    with httpx.Client(base_url=guarded.base_url, timeout=60) as c:
        for method, path, payload in routes:
            for headers in refused:
                response = c.request(method, path, json=payload, headers=headers)
                assert_error(response, 401, None, "invalid_api_key")
                assert response.headers["www-authenticate"] == "Bearer"
        for scheme in ("Bearer", "bearer"):
            ok = c.post(COMPLETIONS, json=prompt, headers={"Authorization": f"{scheme} {API_KEY}"})
            assert ok.status_code == 200, ok.text
        # probes and scrapers need no key
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_models_retrieve_with_a_slash_in_the_name(guarded: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=guarded.base_url, timeout=60, headers=auth) as c:
        card = c.get("/v1/models/org/tiny-chat").json()
        assert (card["id"], card["object"]) == ("org/tiny-chat", "model")
        assert_error(c.get("/v1/models/org"), 404, "model", "model_not_found")


def test_the_body_limit_is_exact(guarded: RunningServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=guarded.base_url, timeout=60, headers=auth) as c:

        def body(size: int) -> bytes:  # a short prompt padded with JSON whitespace
            head = b'{"max_tokens": 1, "prompt": "Hi"'
            return head + b" " * (size - len(head) - 1) + b"}"

        at_limit = c.post(COMPLETIONS, content=body(BODY_LIMIT))
        assert at_limit.status_code == 200, at_limit.text
        assert_error(
            c.post(COMPLETIONS, content=body(BODY_LIMIT + 1)), 413, None, "request_too_large"
        )
        chunked = c.post(
            COMPLETIONS, content=iter([body(BODY_LIMIT + 1)[:100], body(BODY_LIMIT + 1)[100:]])
        )
        assert_error(chunked, 413, None, "request_too_large")
        ok = c.post(COMPLETIONS, content=iter([body(BODY_LIMIT)[:100], body(BODY_LIMIT)[100:]]))
        assert ok.status_code == 200, ok.text


# ---- metrics ----------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_prometheus(text: str) -> tuple[dict[str, str], Samples]:
    """A strict reader of the text exposition format 0.0.4; fails on anything malformed."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: Samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}, line
            assert name not in types, f"{name} typed twice"
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, label_text, value = match.groups()
        labels = LABEL.findall(label_text or "")
        assert ",".join(f'{k}="{v}"' for k, v in labels) == (label_text or ""), line
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in types, f"{name} has no TYPE line before it"
        if types[family] != "histogram":
            assert family == name, line
        key = (name, frozenset(labels))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value)
    for family in (f for f, kind in types.items() if kind == "histogram"):
        # per series: vLLM's names carry model_name and engine labels
        series: dict[frozenset[tuple[str, str]], list[tuple[float, float]]] = {}
        for (n, labels), v in samples.items():
            if n == f"{family}_bucket":
                le = dict(labels)["le"]
                series.setdefault(labels - {("le", le)}, []).append((float(le), v))
        assert series, f"{family} has no buckets"
        for labels, buckets in series.items():
            buckets.sort()
            counts = [v for _, v in buckets]
            assert buckets[-1][0] == math.inf and counts == sorted(counts), family
            assert buckets[-1][1] == samples[(f"{family}_count", labels)], family
            assert (f"{family}_sum", labels) in samples, family
    return types, samples


def test_metrics_prometheus_text_and_counters_move(
    client: httpx.Client, server: RunningServer
) -> None:
    def scrape() -> Samples:
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        types, samples = parse_prometheus(response.text)
        for name, kind in [
            ("inferlab_num_requests_running", "gauge"),
            ("inferlab_num_requests_waiting", "gauge"),
            ("inferlab_kv_cache_usage_ratio", "gauge"),
            ("inferlab_prompt_tokens_total", "counter"),
            ("inferlab_generation_tokens_total", "counter"),
            ("inferlab_time_to_first_token_seconds", "histogram"),
            ("inferlab_inter_token_latency_seconds", "histogram"),
        ]:
            assert types.get(name) == kind, name
        return samples

    def value(samples: Samples, name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    before = scrape()
    body = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 7, "ignore_eos": True}
    ).json()
    client.post("/v1/completions", json={"prompt": PROMPT, "top_p": 5})  # a 400
    after = scrape()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("inferlab_prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert moved("inferlab_generation_tokens_total") == 7
    assert moved("inferlab_request_success_total", finished_reason="length") == 1
    assert moved("inferlab_time_to_first_token_seconds_count") == 1
    assert moved("inferlab_inter_token_latency_seconds_count") == 6
    assert moved("inferlab_e2e_request_latency_seconds_count") == 1
    assert moved("inferlab_time_to_first_token_seconds_sum") > 0
    assert moved("inferlab_requests_invalid_total") == 1
    # idle again: nothing running, nothing reserved
    assert value(after, "inferlab_num_requests_running") == 0
    assert value(after, "inferlab_kv_cache_usage_ratio") == 0
    assert value(after, "inferlab_kv_cache_capacity_bytes") > 0


# ---- the command --------------------------------------------------------------------------------


def test_serve_options_compose_like_run() -> None:
    backend, config = serve_cli.build_backend(
        [
            "model=tiny",
            "engine.kv_cache=paged",
            "variant=chunked",
            "port=9001",
            "max_queue_len=5",
            "served_model_name=my-model",
            "server.host=0.0.0.0",
        ]
    )
    assert backend.config.kv_cache == "paged" and backend.config.enable_chunked_prefill
    assert backend.config.model == "tiny"
    assert (config.host, config.port, config.max_queue_len, config.served_model_name) == (
        "0.0.0.0",
        9001,
        5,
        "my-model",
    )
    _, config = serve_cli.build_backend(["model=tiny"])
    assert (config.host, config.port, config.served_model_name) == ("127.0.0.1", 8000, "tiny")
    assert config.metrics_names == ("inferlab", "vllm")  # both by default
    for value, names in [
        ("[vllm]", ("vllm",)),
        ("vllm", ("vllm",)),
        ("[vllm,inferlab]", ("vllm", "inferlab")),
    ]:
        assert serve_cli.parse_args([f"metrics_names={value}"])[0].metrics_names == names
    assert config.profile_dir is None  # the profiler endpoints are off unless asked for
    assert (config.max_header_bytes, config.max_header_count) == (65536, 100)
    parsed = serve_cli.parse_args(["max_header_bytes=8192", "max_header_count=50"])[0]
    assert (parsed.max_header_bytes, parsed.max_header_count) == (8192, 50)
    assert serve_cli.parse_args(["profile_dir=profiles/1"])[0].profile_dir == "profiles/1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["workload.num_requests=3"], "workload.num_requests: not an option of `inferlab serve`"),
        (["justaword"], "'justaword': expected key=value"),
        (["port=abc"], "port: 'abc' is invalid; allowed: an integer in [0, 65535]"),
        (["port=70000"], "port: 70000 is invalid"),
        (["max_queue_len=-1"], "max_queue_len: -1 is invalid; allowed: an integer >= 0"),
        (["log_level=loud"], "log_level: 'loud' is invalid; allowed: critical|error"),
        (
            ["engine.kv_cache=foo"],
            "engine.kv_cache: 'foo' is invalid; allowed: none|contiguous|paged",
        ),
        (["engine.bogus=1"], "engine.bogus: unknown key; allowed: attention_backend|backend|"),
        (["model=nope"], "Could not find 'model/nope'"),
        (["model=hf"], "model.path"),
        (["engine.backend=hf"], "engine.backend: 'hf' cannot be served"),
        (["api_key= k"], "api_key: invalid; allowed: null or a non-empty string"),
        (["max_body_bytes=0"], "max_body_bytes: 0 is invalid; allowed: an integer >= 1"),
        (["max_body_bytes=8MB"], "max_body_bytes: '8MB' is invalid"),
        (["max_header_bytes=0"], "max_header_bytes: 0 is invalid; allowed: an integer >= 1"),
        (["max_header_count=many"], "max_header_count: 'many' is invalid; allowed: an integer"),
        (
            ["metrics_names=[prometheus]"],
            "metrics_names: ['prometheus'] is invalid; allowed: a non-empty list of distinct "
            "names from inferlab|vllm",
        ),
        (["metrics_names=[]"], "metrics_names: [] is invalid"),
        (["metrics_names=[vllm,vllm]"], "metrics_names: ['vllm', 'vllm'] is invalid"),
        # under a file it can never be created: this was found only at /start_profile (a 500)
        (["profile_dir=/dev/null/traces"], "profile_dir: '/dev/null/traces' is invalid"),
    ],
)
def test_serve_refuses_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlab serve: ") and message in err, err


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERLAB_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")  # deliberately not read (docs/serving.md)
    assert serve_cli.parse_args(["model=tiny"])[0].api_key is None
    monkeypatch.setenv("INFERLAB_API_KEY", "env-key")
    config, _ = serve_cli.parse_args(["model=tiny"])
    assert config.api_key == "env-key" and "env-key" not in repr(config)
    assert serve_cli.parse_args(["api_key=given"])[0].api_key == "given"  # the option wins
    assert serve_cli.parse_args(["api_key=null"])[0].api_key is None  # or turns it off
    assert serve_cli.parse_args(["api_key=12345"])[0].api_key == "12345"  # kept as text
    monkeypatch.setenv("INFERLAB_API_KEY", "key\n")
    with pytest.raises(serve_cli.UsageError, match="INFERLAB_API_KEY: invalid") as refused:
        serve_cli.parse_args([])
    assert "key" not in str(refused.value).replace("INFERLAB_API_KEY", "").replace("a key", "")


@pytest.mark.parametrize(
    ("argv", "warned"),
    [
        (["host=0.0.0.0"], True),
        (["host=127.0.0.1"], False),
        (["host=localhost"], False),
        (["host=0.0.0.0", "api_key=k"], False),
    ],
)
def test_a_public_address_without_a_key_warns_once(
    argv: list[str],
    warned: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("INFERLAB_API_KEY", raising=False)

    def stop(self: BuiltinBackend) -> None:
        raise RuntimeError("stopped before loading")

    monkeypatch.setattr(BuiltinBackend, "load", stop)
    assert serve_cli.main(["model=tiny", "port=0", *argv]) == 2
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "without an API key" in line]
    assert len(warnings) == warned, err
    if warned:
        assert warnings[0].startswith("inferlab serve: warning: listening on 0.0.0.0")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("my-host", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.slow
def test_inferlab_serve_command_end_to_end() -> None:
    """The real command in its own process: starts, serves, stops cleanly on SIGTERM."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "serve",
        "model=tiny",
        "engine.kv_cache=paged",
        "engine.max_model_len=128",
        "engine.device=cpu",
        "engine.num_threads=1",
        f"port={port}",
        "log_level=warning",
        "served_model_name=tiny-served",
    ]
    process = subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "inferlab serve did not become healthy"
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-served"
            payload = {"model": "tiny-served", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
            assert (
                client.post("/v1/completions", json=payload).json()["usage"]["completion_tokens"]
                == 3
            )
            chunks = stream(client, "/v1/completions", payload)
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 3 + ["length"]
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells it
    assert process.returncode in (0, -signal.SIGTERM), output
    assert "Traceback" not in output, output
