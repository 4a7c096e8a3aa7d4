"""Fuzzing `inferlab serve`'s two POST routes with hypothesis (issue 15): request-shaped JSON
whose every field may hold any value (lone surrogates, huge numbers, NaN/Infinity, wrong types),
raw bytes, invalid UTF-8 and deep nesting. Whatever arrives: no 5xx, every refusal is OpenAI's
error body, no stream carries an error event, and the server still answers /health after it.
A real uvicorn server on loopback, model=tiny, a short context so that accepted requests
generate little."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import ServerConfig
from serving.testing import RunningServer, serve_engine

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    device="cpu",
    max_model_len=48,
    max_num_seqs=4,
    kv_cache="paged",
    kv_cache_memory_bytes=1 << 20,
    num_threads=1,
)
ROUTES = ("/v1/completions", "/v1/chat/completions")
# About 20 s on two shared cores; INFERLAB_FUZZ_EXAMPLES=5000 for a deeper search by hand.
# deadline=None: a request's time is the server's, not the test's.
FUZZ = settings(
    max_examples=int(os.environ.get("INFERLAB_FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- strategies -------------------------------------------------------------------------------

# text with lone surrogates (json.dumps writes them as \ud800 escapes), and ordinary text
texts = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec=None, categories=["Cs", "Ll", "Nd", "Zs", "So"]), max_size=6),
)
numbers = st.one_of(
    st.integers(-3, 70),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.integers(10**300, 10**400),
    st.floats(),
    st.floats(-2, 2),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right kind, sometimes anything at all."""
    return st.one_of(plausible, plausible, anything)


token_ids = st.lists(st.one_of(st.integers(0, 300), st.integers()), min_size=0, max_size=6)
prompts = st.one_of(texts, st.lists(texts, max_size=3), token_ids, st.lists(token_ids, max_size=3))
content = st.one_of(
    texts,
    st.none(),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", ""])}, optional={"text": field(texts)}
        ),
        max_size=2,
    ),
)
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["user", "user", "system", "assistant", "wizard"])),
        "content": field(content),
    },
    optional={"name": field(texts)},
)
# Every field a request may hold; a body is a valid request with a few of these added, so that a
# strange value in one field reaches the code behind the checks of all the others.
FIELDS = {
    "model": field(st.sampled_from(["tiny", "other"])),
    "max_tokens": field(st.integers(-2, 60)),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-2, 5000)),
    "n": field(st.integers(-1, 4)),
    "seed": field(st.integers(-(2**64), 2**65)),
    "stop": field(st.one_of(texts, st.lists(texts, max_size=3))),
    "stream": field(st.booleans()),
    "stream_options": field(
        st.fixed_dictionaries(
            {},
            optional={
                "include_usage": field(st.booleans()),
                "continuous_usage_stats": field(st.booleans()),
            },
        )
    ),
    "min_tokens": field(st.integers(-1, 70)),
    "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(token_ids),
    "return_token_ids": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "presence_penalty": field(st.floats()),
    "logit_bias": field(st.dictionaries(texts, numbers, max_size=2)),
    "user": field(texts),
    "use_beam_search": field(st.booleans()),
    "beam_width": field(st.none() | st.integers(-1, 5)),
    "length_penalty": field(st.floats()),
    "early_stopping": field(st.sampled_from([True, False, "never", "always", 1, None])),
}
COMPLETION_FIELDS = {
    **FIELDS,
    "echo": field(st.booleans()),
    "logprobs": field(st.none() | st.integers(-1, 21)),
    "best_of": field(st.integers(-1, 3)),
}
CHAT_FIELDS = {
    **FIELDS,
    "max_completion_tokens": field(st.integers(-2, 60)),
    "response_format": field(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
        | st.builds(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}, anything)
    ),
    "guided_regex": field(texts),
    "guided_choice": field(st.lists(texts, max_size=3)),
    "structured_outputs": field(
        st.dictionaries(st.sampled_from(["regex", "choice", "json"]), anything, max_size=2)
    ),
    "tools": field(st.lists(anything, max_size=1)),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route and the bytes to send to it."""
    route = draw(st.sampled_from(ROUTES))
    if route == ROUTES[0]:
        data, fields = {"prompt": draw(field(prompts))}, COMPLETION_FIELDS
    else:
        data, fields = {"messages": draw(field(st.lists(message, max_size=3)))}, CHAT_FIELDS
    data["max_tokens"] = draw(st.integers(1, 8))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        data[name] = draw(fields[name])
    if draw(st.integers(0, 4)) == 0:  # a key OpenAI's API does not define
        data[draw(texts)] = draw(anything)
    # ensure_ascii: lone surrogates become \ud800 escapes; allow_nan: NaN/Infinity literals
    return route, json.dumps(data, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def broken_bytes(draw: st.DrawFn) -> tuple[str, bytes]:
    """Raw bytes, a request with invalid UTF-8 spliced in, or arrays/objects nested deep."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["raw", "utf8", "deep"]))
    if kind == "raw":
        return route, draw(st.binary(max_size=64))
    if kind == "utf8":
        valid = json.dumps(
            {"prompt": "Hello there", "messages": [{"role": "user", "content": "Hi"}]}
        ).encode()
        at = draw(st.integers(0, len(valid)))
        junk = draw(st.binary(min_size=1, max_size=4).filter(lambda b: max(b) >= 0x80))
        return route, valid[:at] + junk + valid[at:]
    depth = draw(st.one_of(st.integers(1, 300), st.integers(300, 100_000)))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a": ', b"}")]))
    nested = opener * depth + b"1" + closer * depth
    where = draw(
        st.sampled_from(
            [b"%s", b'{"prompt": %s}', b'{"messages": %s}', b'{"prompt": "hi", "tools": %s}']
        )
    )
    return route, where.replace(b"%s", nested)


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS, ServerConfig(max_queue_len=4)) as running:
        yield running


def check(client: httpx.Client, route: str, body: bytes) -> None:
    with client.stream(
        "POST", route, content=body, headers={"content-type": "application/json"}
    ) as response:
        text = response.read().decode()
    assert response.status_code < 500, (response.status_code, text, body[:300])
    if response.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
        assert error["message"] and error["type"] == "invalid_request_error", text
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        assert '"error"' not in text, (text[-300:], body[:300])  # a failure inside a 200
    health = client.get("/health")
    assert health.status_code == 200, health.text


@FUZZ
@given(case=bodies())
def test_request_shaped_bodies_never_fail_the_server(
    client: httpx.Client, case: tuple[str, bytes]
) -> None:
    check(client, *case)


@FUZZ
@given(case=broken_bytes())
def test_broken_bytes_and_deep_nesting_never_fail_the_server(
    client: httpx.Client, case: tuple[str, bytes]
) -> None:
    check(client, *case)


def test_the_server_is_idle_after_the_fuzzing(server: RunningServer) -> None:
    """Nothing the fuzzing sent is left admitted or running (no leak from refused requests)."""
    serving = server.serving
    assert serving.in_flight == 0
    assert not serving.engine.has_unfinished_requests()
