"""Generated tokens' logprobs through the server, in OpenAI's and vLLM's layouts: completions'
legacy `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` and chat's
`{"content": [ChatCompletionTokenLogprob]}`, streaming and not, with the engine's own values
(`LLM.generate(..., SamplingParams(logprobs=k))`), read back by the `openai` SDK; completions'
`echo`; token texts for byte tokens. A real uvicorn server on loopback, model=tiny."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tiny_server import CHAT, COMPLETIONS, OPTIONS, PROMPT

from engines.base import TokenLogprob
from engines.builtin import LLM, SamplingParams
from models.tokenizer import default_tokenizer
from serving.logprobs_format import (
    TokenTexts,
    _raw_bytes,
    chat_logprobs,
    completion_logprobs,
)
from serving.testing import RunningServer, serve_engine

MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]
GREEDY: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
K = 3


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def engine_logprobs() -> list[TokenLogprob]:
    """The engine's own logprobs for PROMPT, greedy, with the server's options."""
    with LLM("tiny", **OPTIONS) as llm:
        params = SamplingParams(max_tokens=8, temperature=0, logprobs=K)
        found = llm.generate(PROMPT, params)[0].outputs[0].logprobs
    assert found is not None and len(found) == 8
    return found


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def stream_chunks(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def joined_completion_logprobs(chunks: list[dict[str, Any]]) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["logprobs"] is None:
                assert choice.get("token_ids", []) == [] and choice["text"] == ""
                continue
            for key, values in joined.items():
                values.extend(choice["logprobs"][key])
    return joined


def utf8_of(token: str) -> list[int]:
    """A token's bytes: its UTF-8, or those a `bytes:\\xNN...` token names."""
    if token.startswith("bytes:"):
        return list(bytes.fromhex(token.removeprefix("bytes:").replace("\\x", "")))
    return list(token.encode("utf-8"))


# ---- /v1/completions ----------------------------------------------------------------------


def test_completion_logprobs_are_the_engines(
    client: httpx.Client, engine_logprobs: list[TokenLogprob]
) -> None:
    body = post(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT, "logprobs": K})
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert list(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert logprobs["token_logprobs"] == [p.logprob for p in engine_logprobs]
    texts = TokenTexts(default_tokenizer())
    assert logprobs["tokens"] == [texts.text(p.token_id) for p in engine_logprobs]
    for position, top in zip(engine_logprobs, logprobs["top_logprobs"], strict=True):
        # the sampled token first, then the k most likely (k + 1 entries at most)
        want = {texts.text(position.token_id): position.logprob}
        want.update({texts.text(i): lp for i, lp in position.top})
        assert top == want and next(iter(top)) == texts.text(position.token_id)
        assert K <= len(top) <= K + 1
    # vLLM's offsets: from 0, each adding the previous token's text length
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
    )
    if not any(t.startswith("bytes:") for t in logprobs["tokens"]):
        assert "".join(logprobs["tokens"]) == choice["text"]


def test_completion_logprobs_stream_as_they_are_returned(
    client: httpx.Client, engine_logprobs: list[TokenLogprob]
) -> None:
    request = {**GREEDY, "prompt": PROMPT, "logprobs": K}
    whole = post(client, COMPLETIONS, request)["choices"][0]["logprobs"]
    chunks = stream_chunks(client, COMPLETIONS, request)
    assert joined_completion_logprobs(chunks) == whole
    assert [p.logprob for p in engine_logprobs] == whole["token_logprobs"]
    # each chunk's logprobs are its own tokens'
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["logprobs"] is not None:
                assert len(choice["logprobs"]["tokens"]) >= 1


def test_logprobs_zero_gives_the_sampled_token_only(client: httpx.Client) -> None:
    logprobs = post(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT, "logprobs": 0})["choices"][0][
        "logprobs"
    ]
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top == {token: value}


def test_without_logprobs_the_field_stays_null(client: httpx.Client) -> None:
    body = post(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT})
    assert body["choices"][0]["logprobs"] is None
    for chunk in stream_chunks(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT}):
        assert all(c["logprobs"] is None for c in chunk["choices"])


def test_each_of_n_choices_has_its_own_logprobs(client: httpx.Client) -> None:
    body = post(
        client,
        COMPLETIONS,
        {"prompt": [PROMPT, "Once upon"], "max_tokens": 5, "n": 2, "seed": 7, "logprobs": 2},
    )
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == 5 == len(logprobs["token_logprobs"])
        assert all(v <= 0 for v in logprobs["token_logprobs"])


# ---- /v1/chat/completions -----------------------------------------------------------------


def test_chat_logprobs_are_the_engines(client: httpx.Client) -> None:
    request = {**GREEDY, "messages": MESSAGES, "return_token_ids": True}
    body = post(client, CHAT, {**request, "logprobs": True, "top_logprobs": K})
    content = body["choices"][0]["logprobs"]["content"]
    # the same prompt ids through completions: the same values and alternatives
    ids = body["prompt_token_ids"]
    plain = post(client, COMPLETIONS, {**GREEDY, "prompt": ids, "logprobs": K})
    legacy = plain["choices"][0]["logprobs"]
    assert [entry["logprob"] for entry in content] == legacy["token_logprobs"]
    assert [entry["token"] for entry in content] == legacy["tokens"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for entry, top in zip(content, legacy["top_logprobs"], strict=True):
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["bytes"] == utf8_of(entry["token"])
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == K
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True)  # most likely first
        assert {a["token"]: a["logprob"] for a in alternatives}.items() <= top.items()
        assert all(a["bytes"] == utf8_of(a["token"]) for a in alternatives)


def test_chat_logprobs_stream_per_chunk(client: httpx.Client) -> None:
    request = {**GREEDY, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    whole = post(client, CHAT, request)["choices"][0]["logprobs"]["content"]
    streamed: list[Any] = []
    for chunk in stream_chunks(client, CHAT, request):
        for choice in chunk["choices"]:
            if choice["logprobs"] is None:  # the role chunk and the end chunk: no tokens
                assert not choice["delta"].get("content")
                continue
            streamed.extend(choice["logprobs"]["content"])
    assert streamed == whole


def test_chat_logprobs_true_alone_gives_no_alternatives(client: httpx.Client) -> None:
    body = post(client, CHAT, {**GREEDY, "messages": MESSAGES, "logprobs": True})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(entry["top_logprobs"] == [] for entry in content)
    plain = post(client, CHAT, {**GREEDY, "messages": MESSAGES, "top_logprobs": 0})
    assert plain["choices"][0]["logprobs"] is None


# ---- the openai SDK -------------------------------------------------------------------------


def test_the_sdk_reads_every_logprobs_field(server: RunningServer) -> None:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as sdk:
        completion = sdk.completions.create(prompt=PROMPT, logprobs=2, **GREEDY)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == 8
        assert logprobs.tokens and logprobs.text_offset and logprobs.top_logprobs
        chat = sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        chat_lp = chat.choices[0].logprobs
        assert chat_lp is not None and chat_lp.content is not None
        top = chat_lp.content[0].top_logprobs
        assert len(top) == 2 and top[0].logprob >= top[1].logprob and top[0].bytes
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
        streamed = [
            entry.logprob
            for chunk in stream
            for choice in chunk.choices
            if choice.logprobs is not None and choice.logprobs.content
            for entry in choice.logprobs.content
        ]
        assert streamed == [entry.logprob for entry in chat_lp.content]


# ---- echo ---------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client: httpx.Client) -> None:
    plain = post(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT})["choices"][0]["text"]
    echoed = post(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT, "echo": True})
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["usage"]["completion_tokens"] == 8
    chunks = stream_chunks(client, COMPLETIONS, {**GREEDY, "prompt": PROMPT, "echo": True})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0].startswith(PROMPT)  # in the first chunk, as vLLM sends it
    assert "".join(texts) == PROMPT + plain


def test_echo_of_token_ids_and_several_prompts(client: httpx.Client) -> None:
    ids, once = (
        post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        for text in (PROMPT, "Once upon")
    )
    body = post(client, COMPLETIONS, {**GREEDY, "prompt": [ids, once], "echo": True, "n": 2})
    texts = [c["text"] for c in body["choices"]]
    assert texts[0].startswith(PROMPT) and texts[1].startswith(PROMPT)
    assert texts[2].startswith("Once upon") and texts[3].startswith("Once upon")


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(
    client: httpx.Client, server: RunningServer
) -> None:
    """lm-eval's loglikelihood request (local-completions): token ids, echo, logprobs=1,
    max_tokens=1, temperature 0. The answer lists every prompt token (the first with null
    logprobs, as vLLM writes it) with the engine's own prompt logprobs, then the generated
    token; lm-eval sums token_logprobs[ctxlen:-1]."""
    ids = post(client, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    request = {
        "model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
        "temperature": 0, "seed": 1234,
    }  # fmt: skip
    logprobs = post(client, COMPLETIONS, request)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0
    with LLM("tiny", **OPTIONS) as llm:
        both = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1)
        reference = llm.generate([ids], both)[0]
    assert reference.prompt_logprobs is not None
    expected = [e.logprob for e in reference.prompt_logprobs[1:] if e is not None]
    assert logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-6)
    scored = zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True)
    for value, top in scored:
        assert isinstance(top, dict) and 1 <= len(top) <= 2 and max(top.values()) >= value
    # streamed: the prompt's logprobs come in the first chunk, then the generated token's
    chunks = stream_chunks(client, COMPLETIONS, request)
    joined = joined_completion_logprobs(chunks)
    assert joined["token_logprobs"] == logprobs["token_logprobs"]
    assert joined["text_offset"] == logprobs["text_offset"]


def test_echo_with_logprobs_for_several_prompts_and_choices(client: httpx.Client) -> None:
    ids = post(client, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    body = post(
        client,
        COMPLETIONS,
        {**GREEDY, "prompt": [ids, ids[:3]], "echo": True, "logprobs": 0, "n": 2},
    )
    lengths = [len(c["logprobs"]["tokens"]) for c in body["choices"]]
    assert lengths == [len(ids) + 8, len(ids) + 8, 3 + 8, 3 + 8]
    first, second = (c["logprobs"]["token_logprobs"] for c in body["choices"][:2])
    assert first[: len(ids)] == second[: len(ids)]  # one prompt, scored once for both


# ---- token texts ----------------------------------------------------------------------------


def test_token_texts_name_partial_utf8_by_their_bytes() -> None:
    tokenizer = default_tokenizer()
    texts = TokenTexts(tokenizer)
    # the byte-level symbol for 0xE2 (a lead byte: not text alone)
    lead = tokenizer.backend.token_to_id("â")
    assert texts.text(lead) == "bytes:\\xe2" and texts.utf8(lead) == [0xE2]
    word = tokenizer.encode(" the", add_special_tokens=False)[0]
    assert texts.text(word) == tokenizer.decode([word]) and texts.utf8(word) == list(
        texts.text(word).encode()
    )
    assert texts.text(tokenizer.special.eos_ids[0]) == "<|eos|>"  # special tokens spelled out
    assert _raw_bytes("<0xF0>") == b"\xf0"  # SentencePiece byte fallback
    assert _raw_bytes("▁the") is None


def test_minus_infinity_is_written_as_openais_floor() -> None:
    texts = TokenTexts(default_tokenizer())
    position = TokenLogprob(300, -math.inf, 4000, ((301, -0.5), (300, -math.inf)))
    legacy = completion_logprobs([position], texts, text_offset=7)
    assert legacy.token_logprobs == [-9999.0] and legacy.text_offset == [7]
    chat = chat_logprobs([position], texts)
    assert chat.content is not None and chat.content[0].logprob == -9999.0
    assert json.dumps(legacy.model_dump())  # JSON has no -inf: it must serialize
