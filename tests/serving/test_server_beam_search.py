"""Beam search through the server (vLLM's `use_beam_search` extension, `length_penalty`,
`early_stopping`, our `beam_width`, and `best_of` as the width on /v1/completions as in vLLM
0.x): the choices are the engine's own best beams, through the `openai` SDK and streamed; what
beam search cannot honour is a 400 naming the field. `best_of` without beam search: the
engine's n most likely of best_of samples. A real uvicorn server, model=tiny."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tiny_server import CHAT, COMPLETIONS, OPTIONS, PROMPT

from engines.builtin import LLM, SamplingParams
from serving.testing import RunningServer, serve_engine

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, int, float], list[str]]:
    """The engine's own beams, in process: (n, width, length_penalty) -> texts, best first."""
    found = {}
    with LLM("tiny", **OPTIONS) as llm:
        for n, width, penalty in [(2, 2, 1.0), (2, 4, 1.0), (3, 4, 0.0)]:
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                use_beam_search=True,
                n=n,
                beam_width=width,
                length_penalty=penalty,
            )
            found[n, width, penalty] = [o.text for o in llm.generate(PROMPT, params)[0].outputs]
    return found


def texts(response: dict[str, Any]) -> list[str]:
    choices = sorted(response["choices"], key=lambda c: c["index"])
    return [c.get("text", c.get("message", {}).get("content")) for c in choices]


def test_completions_through_the_sdk_return_the_engines_beams(
    server: RunningServer, expected: dict[tuple[int, int, float], list[str]]
) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as sdk:
        for (n, width, penalty), beams in expected.items():
            completion = sdk.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                n=n,
                extra_body={
                    "use_beam_search": True,
                    "beam_width": width,
                    "length_penalty": penalty,
                },
            )
            assert [c.text for c in sorted(completion.choices, key=lambda c: c.index)] == beams
            assert completion.usage is not None
            assert completion.usage.completion_tokens == n * MAX_TOKENS  # tiny never stops


def test_best_of_is_the_beam_width_on_completions(
    client: httpx.Client, expected: dict[tuple[int, int, float], list[str]]
) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "use_beam_search": True}
    response = client.post(COMPLETIONS, json={**body, "best_of": 4})
    assert response.status_code == 200, response.text
    assert texts(response.json()) == expected[2, 4, 1.0]


def test_chat_streams_the_beams_at_the_end(
    client: httpx.Client, expected: dict[tuple[int, int, float], list[str]]
) -> None:
    """Chat through the template differs from the raw prompt, so this compares streamed with
    non-streamed chat: the same beams, each choice's text in its chunks."""
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "n": 2,
        "use_beam_search": True,
        "beam_width": 4,
        "early_stopping": "never",
    }
    whole = client.post(CHAT, json=body)
    assert whole.status_code == 200, whole.text
    streamed = ["", ""]
    with client.stream("POST", CHAT, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                    streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == texts(whole.json())
    assert all(streamed)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 2}, "logprobs"),
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["fox"]}, "stop"),
        ({"beam_width": 1, "n": 2}, "beam_width"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"best_of": 4, "beam_width": 2}, "best_of"),
        ({"beam_width": 64}, "beam_width"),  # past max_num_seqs
        ({"n": 9}, "n"),  # n beams past max_num_seqs: the client sent n, not beam_width
        ({"length_penalty": 1e300}, None),  # saturates: a 200, not a 500
    ],
)
def test_what_beam_search_cannot_honour_is_a_400_naming_it(
    client: httpx.Client, extra: dict[str, Any], param: str | None
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    response = client.post(COMPLETIONS, json=body)
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_best_of_without_beam_search_returns_the_engines_most_likely_samples(
    client: httpx.Client,
) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, n=2, best_of=5, seed=11, temperature=1.0)
    with LLM("tiny", **OPTIONS) as llm:
        expected = [o.text for o in llm.generate(PROMPT, params)[0].outputs]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "best_of": 5, "seed": 11}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert texts(response.json()) == expected
    for bad in ({"best_of": 1}, {"best_of": 10**6}, {"seed": 2**64 - 2}):
        refused = client.post(COMPLETIONS, json={**body, **bad})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == next(iter(bad)), refused.json()
