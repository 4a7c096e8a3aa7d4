"""engine=openai against scripted servers: each server's documented SSE format (fixtures under
tests/fixtures/sse/), the request dialects, errors that fail one request alone, and metrics
that come out exact when the server's timings are known."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd
import pytest

from engines.base import Arrived, Failed, Finished, GenerationRequest, Tokenized, Tokens
from engines.openai.backend import UNKNOWN_TOKEN_ID, OpenAIBackend
from engines.openai.config import OpenAIConfig, OpenAIConfigError
from engines.openai.dialects import DIALECTS
from engines.openai.sse import SSEParser
from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from harness.measuring.metrics import compute_summary
from harness.run_folder import COLUMNS
from harness.running.driver import Driver
from models.tokenizer import default_tokenizer
from workloads.request import WorkloadRequest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "sse"
T0 = 1_000_000_000_000  # the fake clock's start, ns
TICK = 1_953_125  # 1/512 s in ns: times and their differences stay exact binary fractions
TINY = {"name": "tiny", "path": None, "tokenizer": None, "overrides": {}}


# ---- a scripted server --------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@dataclass
class Reply:
    pieces: list[tuple[int, bytes]] = field(default_factory=list)  # (absolute ns, one read)
    status: int = 200
    body: bytes = b""
    raise_after: Exception | None = None
    content_type: str = "text/event-stream"  # application/json: `body` as one whole answer


class ScriptedServer:
    """An httpx transport: each POST gets the `Reply` that `script` picks for its body; every
    read of a stream first moves the fake clock to that read's scripted time, so the backend's
    arrival timestamps are exactly the script's. No read is sent before `expected` requests
    have arrived, so every send happens at the same fake instant."""

    def __init__(
        self,
        clock: FakeClock,
        script: Callable[[dict[str, Any]], Reply],
        expected: int = 1,
        models: list[dict[str, Any]] | None = None,
        pages: dict[str, Any] | None = None,
    ) -> None:
        self.clock = clock
        self.script = script
        self.expected = expected
        self.models = models if models is not None else []
        self.pages = pages or {}  # GET path -> JSON, beside /v1/models (others: 404)
        self.bodies: list[dict[str, Any]] = []
        self.requests: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.method == "GET":
            if request.url.path.endswith("/v1/models"):
                return httpx.Response(200, json={"object": "list", "data": self.models})
            if request.url.path in self.pages:
                return httpx.Response(200, json=self.pages[request.url.path])
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(await request.aread())
        self.bodies.append(body)
        reply = self.script(body)
        if reply.status >= 400 or reply.content_type == "application/json":
            return httpx.Response(
                reply.status, content=reply.body, headers={"content-type": "application/json"}
            )
        return httpx.Response(
            200, content=self._stream(reply), headers={"content-type": "text/event-stream"}
        )

    async def _stream(self, reply: Reply) -> AsyncIterator[bytes]:
        for _ in range(10_000):
            if len(self.bodies) >= self.expected:
                break
            await asyncio.sleep(0)
        for at, data in reply.pieces:
            await asyncio.sleep(0)  # let other streams interleave
            self.clock.now = at
            yield data
        if reply.raise_after is not None:
            raise reply.raise_after


def fixture_reads(name: str) -> list[bytes]:
    """A fixture as network reads: one per SSE event (the header comments ride with the first)."""
    text = (FIXTURES / name).read_text()
    return [part.encode() + b"\n\n" for part in text.split("\n\n") if part.strip()]


def backend_for(scripted: ScriptedServer, clock: FakeClock, **options: Any) -> OpenAIBackend:
    options = {"base_url": "http://scripted/v1", "check_server": False, **options}
    backend = OpenAIBackend(
        OpenAIConfig.from_config(options, TINY), TINY, clock=clock, transport=scripted.transport
    )
    backend.load()
    return backend


def collect(backend: OpenAIBackend, *requests: GenerationRequest) -> dict[str, list[Any]]:
    async def one(request: GenerationRequest) -> list[Any]:
        return [event async for event in backend.generate(request)]

    async def run() -> list[list[Any]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return {r.request_id: events for r, events in zip(requests, asyncio.run(run()), strict=True)}


def request(
    rid: str = "r0",
    prompt: Any = (5, 6, 7),
    max_tokens: int = 4,
    ignore_eos: bool = True,
    **sampling: Any,
) -> GenerationRequest:
    prompt = list(prompt) if isinstance(prompt, tuple) else prompt
    return GenerationRequest(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0, **sampling),
    )


def of(events: list[Any], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


# ---- the SSE parser -----------------------------------------------------------------------


def test_sse_parser_follows_the_event_stream_rules() -> None:
    stream = (
        b": ping\r\nevent: update\r\ndata: a\r\ndata:  b\r\nid: 7\r\n\r\n"
        b'data: one\rdata: two\r\rdata: [DONE]\n\nerror: {"code": 500}\n\n'
        b"data: tail"
    )
    parser = SSEParser()
    events = parser.feed(stream) + parser.close()
    assert [(e.event, e.data, e.id) for e in events[:3]] == [
        ("update", "a\n b", "7"),
        ("message", "one\ntwo", "7"),
        ("message", "[DONE]", "7"),
    ]
    # (the last event id persists until a new `id:` line, as the standard says)
    assert events[2].is_done
    assert events[3].extra == {"error": '{"code": 500}'} and events[3].data == ""
    assert events[4].data == "tail"  # left pending at the close, returned by close()


def test_sse_parser_gives_the_same_events_however_the_bytes_are_cut() -> None:
    stream = (
        'data: {"text": "caf\u00e9 \u2014 \u6771\u4eac"}\r\n\r\n'
        "data: x\r\rdata: y\n\n: c\ndata: [DONE]\r\n\r\n"
    ).encode()
    whole = SSEParser().feed(stream)
    assert len(whole) == 4 and "\u6771\u4eac" in whole[0].data
    for size in (1, 2, 3, 5, 7):
        parser = SSEParser()
        events = []
        for start in range(0, len(stream), size):
            events += parser.feed(stream[start : start + size])
        assert [(e.event, e.data) for e in events] == [(e.event, e.data) for e in whole]


# ---- every fixture: events, token counts, finish reasons, timestamps ------------------------


@dataclass
class Case:
    fixture: str
    server: str
    api: str
    tokenizer: str
    token_ids: list[tuple[int, ...]] | None  # None: the tokenizer's ids of each text piece
    texts: list[str]
    finish_reason: str
    prompt_tokens: int | None  # None: counted by the test with the tokenizer
    output_tokens: int  # Finished.num_output_tokens: usage when present, else counted
    usage: bool


CASES = [
    Case(
        "vllm_completions_usage.sse",
        "vllm",
        "completions",
        "none",
        [(279,), (3363,), (315,), (3177,)],
        [" the", " city", " of", " light"],
        "length",
        3,
        4,
        True,
    ),
    Case(
        "vllm_chat_usage.sse",
        "vllm",
        "chat",
        "none",
        [(9906,), (1070, 0), (2650,)],
        ["Hello", " there!", " How"],
        "length",
        11,
        4,
        True,
    ),
    Case(
        "vllm_completions_nousage.sse",
        "vllm",
        "completions",
        "none",
        [(UNKNOWN_TOKEN_ID,)] * 3,
        [" the", " city", "."],
        "stop",
        3,
        3,
        False,
    ),
    Case(
        "sglang_completions_usage.sse",
        "sglang",
        "completions",
        "none",
        [(9843,), (5304,), (264,)],
        [" Once", " upon", " a"],
        "length",
        5,
        3,
        True,
    ),
    Case(
        "sglang_chat_nousage.sse",
        "sglang",
        "chat",
        "auto",
        None,
        ["Paris", " is", "."],
        "stop",
        None,
        3,
        False,
    ),
    # TGI counts the EOS token, sent as the empty closing chunk: one token per chunk matches
    Case(
        "tgi_chat_usage.sse",
        "tgi",
        "chat",
        "none",
        [(UNKNOWN_TOKEN_ID,)] * 3,
        ["OK", "!", ""],
        "stop",
        39,
        3,
        True,
    ),
    Case(
        "tgi_completions_nousage.sse",
        "tgi",
        "completions",
        "auto",
        None,
        [" Deep", " learning", " is"],
        "stop",
        None,
        0,
        False,
    ),
    Case(
        "llamacpp_chat_usage.sse",
        "llamacpp",
        "chat",
        "none",
        [(UNKNOWN_TOKEN_ID,)] * 2,
        ["Hi", " there"],
        "length",
        9,
        2,
        True,
    ),
    Case(
        "llamacpp_completions_nousage.sse",
        "llamacpp",
        "completions",
        "none",
        [(UNKNOWN_TOKEN_ID,)] * 3,
        [" Paris", " is", " big"],
        "length",
        3,
        3,
        False,
    ),
    # one chunk per token and no usage: counted one per chunk (its dialect's rule), even with
    # a tokenizer at hand whose pieces would give another count
    Case(
        "llama_cpp_python_completions.sse",
        "llama_cpp_python",
        "completions",
        "auto",
        [(UNKNOWN_TOKEN_ID,)] * 4,
        ["'s", " rays", ",", " which"],
        "length",
        None,
        4,
        False,
    ),
]
WHOLE_TOKENS = 4  # in llama_cpp_python_completions.sse


@pytest.mark.parametrize("case", CASES, ids=[c.fixture for c in CASES])
def test_fixture_stream_becomes_the_right_events(case: Case) -> None:
    clock = FakeClock()
    reads = fixture_reads(case.fixture)
    times = [T0 + (k + 1) * 8 * TICK for k in range(len(reads))]
    server = ScriptedServer(clock, lambda body: Reply(list(zip(times, reads, strict=True))))
    backend = backend_for(server, clock, server=case.server, api=case.api, tokenizer=case.tokenizer)
    ids_taken = case.api == "completions" and DIALECTS[case.server].token_prompts
    prompt: Any = [5, 6, 7] if ids_taken else "Hi"
    events = collect(backend, request(prompt=prompt, max_tokens=4))["r0"]

    assert isinstance(events[0], Arrived) and events[0].time_ns == T0
    tokens = of(events, Tokens)
    assert [t.text for t in tokens] == case.texts
    tok = default_tokenizer()
    expected_ids = case.token_ids or [
        tuple(tok.encode(t, add_special_tokens=False)) for t in case.texts
    ]
    assert [t.token_ids for t in tokens] == expected_ids
    # each token event carries the arrival time of the read that held its chunk
    data_of = [
        "\n".join(line for line in r.decode().splitlines() if not line.startswith(":"))
        for r in reads
    ]
    for t in tokens:
        text = json.dumps(t.text)
        read = next(
            k
            for k, d in enumerate(data_of)
            if any(
                f'"{key}":{space}{text}' in d for key in ("text", "content") for space in ("", " ")
            )
        )
        assert t.time_ns == times[read]
    [finished] = of(events, Finished)
    assert events[-1] is finished and not of(events, Failed)
    assert finished.finish_reason == case.finish_reason
    assert finished.text == "".join(case.texts)
    counted = sum(len(ids) for ids in expected_ids)
    assert finished.num_output_tokens == (case.output_tokens if case.usage else counted)
    if case.prompt_tokens is None:  # no usage: the client counted the prompt itself
        expected_prompt = len(tok.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        if case.api == "chat":
            expected_prompt = len(tok.encode_chat([{"role": "user", "content": prompt}]))
    else:
        expected_prompt = case.prompt_tokens
    [tokenized] = of(events, Tokenized)
    assert tokenized.num_prompt_tokens == finished.num_prompt_tokens == expected_prompt
    assert tokenized.time_ns == T0  # the send time: the server's tokenizing is not visible
    stats = backend.stats.snapshot()
    assert stats["requests_finished"] == 1 and stats["chunks"] == len(reads)
    assert stats["output_tokens_counted"] == counted
    assert stats["requests_with_usage"] == int(case.usage)
    assert stats["requests_usage_count_mismatch"] == 0  # the counting agrees with usage
    assert stats["client_overhead_per_chunk_mean_us"] > 0


def per_token_stream(texts: list[str], usage: int | None) -> list[tuple[int, bytes]]:
    """A completions stream with one chunk per token (text may be empty: held-back bytes or a
    skipped special token), a separate empty closing chunk, then usage (as inferlab serve)."""

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return (
            f"data: {json.dumps({'object': 'text_completion', 'choices': choices, **extra})}"
            "\n\n".encode()
        )

    pieces = [
        (T0 + (k + 1) * TICK, event([{"index": 0, "text": t, "finish_reason": None}]))
        for k, t in enumerate(texts)
    ]
    end = T0 + (len(texts) + 1) * TICK
    closing = event([{"index": 0, "text": "", "finish_reason": "length"}])
    if usage is not None:
        closing += event(
            [], usage={"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 3 + usage}
        )
    return [*pieces, (end, closing + b"data: [DONE]\n\n")]


def test_without_ids_the_rule_matching_usage_counts_each_chunk() -> None:
    texts = [" a", "", "bc", "\u00e9\u00e9"]
    tok = default_tokenizer()
    by_tokenizer = sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    # 4 content chunks (+1 with the empty closing one): the rules must give different totals
    assert by_tokenizer not in (len(texts), len(texts) + 1)
    for usage, tokenizer, rule, expected in [
        (len(texts), "auto", "chunk", [(UNKNOWN_TOKEN_ID,)] * 4),  # one per chunk matches
        (
            by_tokenizer,
            "auto",
            "tokenizer",
            [tuple(tok.encode(t, add_special_tokens=False)) for t in texts if t],
        ),
        (
            None,
            "auto",
            "tokenizer",  # no usage: the tokenizer
            [tuple(tok.encode(t, add_special_tokens=False)) for t in texts if t],
        ),
        (None, "none", "nonempty_chunk", [(UNKNOWN_TOKEN_ID,)] * 3),
    ]:
        clock = FakeClock()
        server = ScriptedServer(clock, lambda b, u=usage: Reply(per_token_stream(texts, u)))
        backend = backend_for(server, clock, server="generic", tokenizer=tokenizer)
        events = collect(backend, request())["r0"]
        tokens = of(events, Tokens)
        assert [t.token_ids for t in tokens] == expected, rule
        held = [T0 + (k + 1) * TICK for k, t in enumerate(texts) if t or rule == "chunk"]
        assert [t.time_ns for t in tokens] == held  # each chunk keeps its arrival time
        [finished] = of(events, Finished)
        assert finished.num_output_tokens == (
            usage if usage is not None else sum(len(i) for i in expected)
        )
        assert backend.stats.snapshot()["requests_by_count_rule"] == {rule: 1}


def test_parallel_samples_finish_once_each() -> None:
    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    def choice(index: int, text: str, ids: list[int], finish: str | None = None) -> bytes:
        return event(
            {
                "object": "text_completion",
                "choices": [
                    {"index": index, "text": text, "token_ids": ids, "finish_reason": finish}
                ],
            }
        )

    reads = [
        (T0 + TICK, choice(0, " a", [1]) + choice(1, " b", [2])),
        (T0 + 2 * TICK, choice(1, " c", [3], "length")),
        (T0 + 3 * TICK, choice(0, " d", [4], "stop") + b"data: [DONE]\n\n"),
    ]
    clock = FakeClock()
    server = ScriptedServer(clock, lambda b: Reply(reads))
    events = collect(backend_for(server, clock), request(max_tokens=2, n=2))["r0"]
    assert server.bodies[0]["n"] == 2
    by_index = {i: [t.token_ids for t in of(events, Tokens) if t.index == i] for i in (0, 1)}
    assert by_index == {0: [(1,), (4,)], 1: [(2,), (3,)]}
    finished = {f.index: f for f in of(events, Finished)}
    assert {i: (f.finish_reason, f.num_output_tokens, f.text) for i, f in finished.items()} == {
        0: ("stop", 2, " a d"),
        1: ("length", 2, " b c"),
    }


# ---- errors: each fails its own request ---------------------------------------------------


@pytest.mark.parametrize(
    "fixture,status,needle",
    [
        ("vllm_http_400.json", 400, "maximum context length is 2048 tokens"),
        ("tgi_http_422.json", 422, "Input validation error"),
    ],
)
def test_http_error_fails_the_request_with_status_and_body(
    fixture: str, status: int, needle: str
) -> None:
    clock = FakeClock()
    body = (FIXTURES / fixture).read_bytes()
    server = ScriptedServer(clock, lambda b: Reply(status=status, body=body))
    backend = backend_for(server, clock)
    events = collect(backend, request())["r0"]
    [failed] = of(events, Failed)
    assert events[-1] is failed
    assert f"HTTP {status}" in failed.error and needle in failed.error
    assert backend.stats.snapshot()["requests_failed"] == 1


@pytest.mark.parametrize(
    "fixture,server_name,needle",
    [
        ("vllm_stream_error.sse", "vllm", "InternalServerError 500: The engine died unexpectedly."),
        ("llamacpp_stream_error.sse", "llamacpp", "server_error 500: the context is full"),
    ],
)
def test_error_event_mid_stream_fails_the_request(
    fixture: str, server_name: str, needle: str
) -> None:
    clock = FakeClock()
    reads = fixture_reads(fixture)
    server = ScriptedServer(
        clock, lambda b: Reply([(T0 + (k + 1) * TICK, r) for k, r in enumerate(reads)])
    )
    events = collect(backend_for(server, clock, server=server_name, tokenizer="none"), request())[
        "r0"
    ]
    assert len(of(events, Tokens)) == 1 and not of(events, Finished)
    [failed] = of(events, Failed)
    assert events[-1] is failed and needle in failed.error
    assert failed.time_ns == T0 + 2 * TICK  # when the error arrived


def test_timeout_and_truncated_stream_fail_with_a_reason() -> None:
    clock = FakeClock()
    reads = fixture_reads("vllm_completions_usage.sse")

    def script(body: dict[str, Any]) -> Reply:
        if body["prompt"] == [1]:
            return Reply([(T0 + TICK, reads[0])], raise_after=httpx.ReadTimeout("silence"))
        return Reply([(T0 + TICK, reads[0])])  # closes after one chunk, no finish, no [DONE]

    server = ScriptedServer(clock, script, expected=2)
    out = collect(
        backend_for(server, clock, timeout_s=5),
        request("slow", prompt=(1,)),
        request("cut", prompt=(2,)),
    )
    assert "timeout (engine.timeout_s=5)" in of(out["slow"], Failed)[0].error
    assert of(out["cut"], Failed)[0].error == (
        "stream closed (no [DONE]) without a finish_reason after 1 tokens"
    )
    for events in out.values():  # the token that did arrive is kept, at its own time
        assert [(t.token_ids, t.time_ns) for t in of(events, Tokens)] == [((279,), T0 + TICK)]
        assert isinstance(events[-1], Failed) and not of(events, Finished)


def test_unsendable_prompt_fails_alone_with_a_clear_reason() -> None:
    clock = FakeClock()
    server = ScriptedServer(clock, lambda b: Reply())
    backend = backend_for(server, clock, server="tgi", tokenizer="none")
    [failed] = collect(backend, request())["r0"]
    assert isinstance(failed, Failed)
    assert "needs a tokenizer" in failed.error and "engine.tokenizer" in failed.error
    assert server.bodies == []


# ---- a request succeeds only when the server said how it finished ---------------------------


def data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def completion_chunk(text: str, finish: str | None = None) -> bytes:
    return data(
        {
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}],
        }
    )


def at(*reads: bytes) -> list[tuple[int, bytes]]:
    return [(T0 + (k + 1) * TICK, r) for k, r in enumerate(reads)]


FAILURE_SHAPES: dict[str, tuple[Reply, str]] = {
    # llama-cpp-python cuts a stream for the next request: [DONE] and no finish_reason
    "done_without_finish_reason": (
        Reply(at(*fixture_reads("llama_cpp_python_interrupted.sse"))),
        "stream ended without a finish_reason after 4 tokens",
    ),
    "closed_mid_stream": (
        Reply(
            at(completion_chunk(" a")),
            raise_after=httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            ),
        ),
        "HTTP error on POST http://scripted/v1/completions: RemoteProtocolError: peer closed",
    ),
    "closed_without_done": (
        Reply(at(completion_chunk(" a"), completion_chunk(" b"))),
        "stream closed (no [DONE]) without a finish_reason after 2 tokens",
    ),
    "http_500": (
        Reply(
            status=500,
            body=b'{"error":{"message":"list index out of range","type":"internal_server_error"}}',
        ),
        'HTTP 500 from POST http://scripted/v1/completions: {"error":{"message":"list index',
    ),
    "error_event": (
        Reply(
            at(
                completion_chunk(" a"),
                data(
                    {
                        "error": {
                            "message": "out of memory",
                            "type": "InternalServerError",
                            "code": 500,
                        }
                    }
                ),
                b"data: [DONE]\n\n",
            )
        ),
        "server error in stream: InternalServerError 500: out of memory",
    ),
    "not_streamed_without_finish_reason": (
        Reply(
            content_type="application/json",
            body=json.dumps(
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": " a b", "finish_reason": None}],
                }
            ).encode(),
        ),
        "response (not streamed) without a finish_reason after 1 tokens",
    ),
    "malformed_chunk": (
        Reply(at(data({"object": "text_completion", "choices": ["a"]}), b"data: [DONE]\n\n")),
        "server error in stream: malformed SSE data (AttributeError",
    ),
}


@pytest.mark.parametrize("shape", list(FAILURE_SHAPES))
def test_every_unfinished_answer_is_a_failed_request(shape: str) -> None:
    reply, needle = FAILURE_SHAPES[shape]
    clock = FakeClock()
    server = ScriptedServer(
        clock,
        lambda b: reply if b["prompt"][0] == ord("x") else vllm_stream("a", SCHEDULE["a"], 6),
        expected=2,
    )
    backend = backend_for(server, clock, tokenizer="none")
    frames = run_driver(backend, workload(["a", "x"]), clock)
    requests = frames["requests"].set_index("request_id")
    assert requests.loc["a", "status"] == "ok"
    assert requests.loc["x", "status"] == "failed"
    assert requests.loc["x", "error"].startswith(needle), requests.loc["x", "error"]
    summary = compute_summary(frames["requests"], frames["tokens"], frames["steps"])
    assert (summary["num_completed"], summary["num_failed"]) == (1, 1)
    live = backend.describe()["client"]
    assert (live["requests_finished"], live["requests_failed"]) == (1, 1)


def test_an_interrupting_server_at_concurrency_two_fails_every_cut_stream() -> None:
    """llama-cpp-python ends the running stream with [DONE] (no finish_reason) whenever another
    request waits: at concurrency 2, 7 of 8 requests were cut and used to count as successes
    with 1 output token each."""
    clock = FakeClock()
    interrupted = fixture_reads("llama_cpp_python_interrupted.sse")
    whole = fixture_reads("llama_cpp_python_completions.sse")
    sent: list[int] = []

    def script(body: dict[str, Any]) -> Reply:
        sent.append(1)
        reads = whole if len(sent) == 8 else interrupted  # only the last one runs alone
        return Reply([(clock.now + (k + 1) * TICK, r) for k, r in enumerate(reads)])

    server = ScriptedServer(clock, script)
    backend = backend_for(server, clock, server="llama_cpp_python")
    items = workload(list("abcdefgh"))
    rows: dict[str, list[dict[str, Any]]] = {"requests": [], "tokens": [], "steps": []}
    Driver(backend, lambda table, row: rows[table].append(row), clock=clock).run(
        items, concurrency=2
    )
    requests = pd.DataFrame(rows["requests"], columns=COLUMNS["requests"])
    assert (requests["status"] == "failed").sum() == 7
    failed = requests[requests["status"] == "failed"]
    assert set(failed["error"]) == {"stream ended without a finish_reason after 4 tokens"}
    [ok] = requests[requests["status"] == "ok"].itertuples()
    assert ok.finish_reason == "length" and ok.output_tokens == WHOLE_TOKENS
    summary = compute_summary(
        requests,
        pd.DataFrame(rows["tokens"], columns=COLUMNS["tokens"]),
        pd.DataFrame(rows["steps"], columns=COLUMNS["steps"]),
    )
    assert (summary["num_completed"], summary["num_failed"]) == (1, 7)


def test_a_whole_json_answer_with_a_finish_reason_is_a_success() -> None:
    clock = FakeClock()
    answers = {
        "completions": {
            "object": "text_completion",
            "choices": [{"index": 0, "text": " a b", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        },
        "chat": {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " a b"},
                    "finish_reason": "stop",
                }
            ],
        },
    }
    for api, answer in answers.items():
        server = ScriptedServer(
            clock,
            lambda b, a=answer: Reply(content_type="application/json", body=json.dumps(a).encode()),
        )
        clock.now = T0 + 5 * TICK  # the answer arrives at once: every token at this time
        events = collect(
            backend_for(server, clock, api=api, tokenizer="auto"), request(prompt="Hi")
        )["r0"]
        [finished] = of(events, Finished)
        assert not of(events, Failed) and finished.text == " a b"
        assert finished.finish_reason == answer["choices"][0]["finish_reason"]
        tokens = of(events, Tokens)
        assert {t.time_ns for t in tokens} == {T0 + 5 * TICK}
        usage = answer.get("usage")
        assert finished.num_output_tokens == (
            usage["completion_tokens"] if usage else sum(len(t.token_ids) for t in tokens)
        )


# ---- request dialects ---------------------------------------------------------------------


def sent_body(
    server_name: str, api: str = "completions", prompt: Any = (5, 6, 7), **sampling: Any
) -> dict[str, Any]:
    clock = FakeClock()
    reads = fixture_reads("vllm_completions_usage.sse")
    server = ScriptedServer(clock, lambda b: Reply([(T0 + TICK, b"".join(reads))]))
    backend = backend_for(
        server, clock, server=server_name, api=api, tokenizer="auto", extra_body={"priority": 3}
    )
    collect(backend, request(prompt=prompt, max_tokens=4, **sampling))
    [body] = server.bodies
    assert body["model"] == "tiny" and body["stream"] is True and body["priority"] == 3
    assert body["stream_options"] == {"include_usage": True}
    return body


def test_vllm_and_sglang_ask_for_exact_lengths_and_token_ids() -> None:
    for name in ("vllm", "sglang"):
        body = sent_body(name, top_k=5, stop_token_ids=[9])
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 4
        assert body["return_token_ids"] is True and body["prompt"] == [5, 6, 7]
        assert body["top_k"] == 5 and body["stop_token_ids"] == [9]
    body = sent_body("vllm", ignore_eos=False, min_tokens=2)
    assert "ignore_eos" not in body and body["min_tokens"] == 2


def test_llamacpp_asks_with_n_predict_and_turns_its_own_samplers_off() -> None:
    body = sent_body("llamacpp")
    assert body["n_predict"] == body["max_tokens"] == 4 and body["ignore_eos"] is True
    assert (body["top_k"], body["top_p"], body["min_p"]) == (0, 1.0, 0.0)
    assert "return_token_ids" not in body and "min_tokens" not in body


def test_tgi_and_generic_send_only_what_they_accept() -> None:
    body = sent_body("tgi")
    tok = default_tokenizer()
    assert body["prompt"] == tok.decode([5, 6, 7], skip_special_tokens=False)  # text only
    assert "ignore_eos" not in body and "top_p" not in body and "top_k" not in body
    generic = sent_body("generic", top_k=3)
    assert set(generic) == {
        "model",
        "stream",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stream_options",
        "priority",
    }


def test_llama_cpp_python_gets_text_and_min_tokens_and_its_samplers_off() -> None:
    body = sent_body("llama_cpp_python")
    tok = default_tokenizer()
    # it refuses token-id prompts (pydantic: `prompt: str | list[str]`): the ids go as text
    assert body["prompt"] == tok.decode([5, 6, 7], skip_special_tokens=False)
    # no ignore_eos and n_predict there; min_tokens masks its EOS until max_tokens are out
    assert body["min_tokens"] == body["max_tokens"] == 4
    assert (body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"]) == (
        0,
        1.0,
        0.0,
        1.0,
    )
    assert not {"n_predict", "ignore_eos", "return_token_ids"} & set(body)
    assert "min_tokens" not in sent_body("llama_cpp_python", ignore_eos=False)


def test_chat_api_sends_messages_and_completions_renders_chat_prompts() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert sent_body("vllm", api="chat", prompt=messages)["messages"] == messages
    assert sent_body("vllm", api="chat", prompt="Hey")["messages"] == [
        {"role": "user", "content": "Hey"}
    ]
    tok = default_tokenizer()
    assert sent_body("vllm", prompt=messages)["prompt"] == tok.encode_chat(messages)
    assert sent_body("tgi", prompt=messages)["prompt"] == tok.apply_chat_template(messages)


def test_beam_search_is_sent_to_vllm_and_counted_as_dropped_elsewhere() -> None:
    beams = {"use_beam_search": True, "beam_width": 4, "n": 2, "length_penalty": 0.5}
    body = sent_body("vllm", **beams)
    assert (body["use_beam_search"], body["beam_width"], body["n"]) == (True, 4, 2)
    assert (body["length_penalty"], body["early_stopping"]) == (0.5, False)
    assert "use_beam_search" not in sent_body("vllm", n=2)
    for server in ("sglang", "llamacpp", "tgi", "generic"):
        assert "use_beam_search" in DIALECTS[server].refused(SamplingParams(**beams))


def test_penalties_and_masks_are_sent_where_the_server_reads_them() -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {7: 3.0},
        "allowed_token_ids": [7, 8, 9],
        "bad_words": ["no"],
    }
    body = sent_body("vllm", **fields)
    assert body["logit_bias"] == {"7": 3.0}
    assert {k: body[k] for k in fields if k != "logit_bias"} == {
        k: v for k, v in fields.items() if k != "logit_bias"
    }
    generic = sent_body("generic", **fields)
    assert (generic["presence_penalty"], generic["frequency_penalty"]) == (0.5, -0.5)
    assert "repetition_penalty" not in generic and "min_p" not in generic
    assert DIALECTS["generic"].refused(SamplingParams(**fields)) == [
        "min_p", "repetition_penalty", "allowed_token_ids", "bad_words"
    ]  # fmt: skip
    assert sent_body("llamacpp", min_p=0.1)["min_p"] == 0.1
    assert DIALECTS["vllm"].refused(SamplingParams(n=1, best_of=3)) == ["best_of"]


def test_structured_outputs_are_sent_as_each_server_reads_them() -> None:
    regex = StructuredOutputsParams(regex="[0-9]+")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert sent_body("vllm", structured_outputs=regex)["structured_outputs"] == {"regex": "[0-9]+"}
    vllm = sent_body("vllm", structured_outputs=StructuredOutputsParams(json=schema))
    assert vllm["structured_outputs"] == {"json": schema} and "response_format" not in vllm
    generic = sent_body("generic", structured_outputs=StructuredOutputsParams(json=schema))
    assert generic["response_format"]["json_schema"]["schema"] == schema
    objects = sent_body("tgi", structured_outputs=StructuredOutputsParams(json_object=True))
    assert objects["response_format"] == {"type": "json_object"}
    clock = FakeClock()
    server = ScriptedServer(clock, lambda b: Reply([]))
    backend = backend_for(server, clock, server="generic")
    events = collect(backend, request(prompt="Hi", structured_outputs=regex))["r0"]
    failed = [e for e in events if isinstance(e, Failed)]
    assert failed and "structured_outputs.regex: the generic dialect" in failed[0].error
    assert not server.bodies


def test_dropped_sampling_fields_are_counted() -> None:
    clock = FakeClock()
    reads = fixture_reads("tgi_chat_usage.sse")
    server = ScriptedServer(clock, lambda b: Reply([(T0 + TICK, b"".join(reads))]))
    backend = backend_for(server, clock, server="tgi", api="chat")
    collect(backend, request(prompt="Hi", top_k=4))
    assert backend.stats.snapshot()["dropped_sampling_fields"] == {"top_k": 1, "ignore_eos": 1}


# ---- exact metrics through the real driver --------------------------------------------------


def vllm_stream(rid: str, chunks: list[tuple[int, list[int]]], prompt_len: int) -> Reply:
    """A vLLM completions stream: (tick, token ids) per chunk, the last one finishing."""

    def event(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    pieces = []
    for k, (tick, ids) in enumerate(chunks):
        last = k == len(chunks) - 1
        choice = {
            "index": 0,
            "text": "".join(f" t{i}" for i in ids),
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "token_ids": ids,
        }
        pieces.append(
            (T0 + tick * TICK, event({"id": rid, "object": "text_completion", "choices": [choice]}))
        )
    end = T0 + (chunks[-1][0] + 1) * TICK
    total = sum(len(ids) for _, ids in chunks)
    usage = {
        "prompt_tokens": prompt_len,
        "completion_tokens": total,
        "total_tokens": prompt_len + total,
    }
    pieces.append(
        (
            end,
            event({"id": rid, "object": "text_completion", "choices": [], "usage": usage})
            + b"data: [DONE]\n\n",
        )
    )
    return Reply(pieces)


SCHEDULE = {  # request -> (tick, token ids) per chunk; one tick is 1/512 s
    "a": [(32, [11]), (64, [12]), (96, [13]), (128, [14])],
    "b": [(96, [21]), (112, [22]), (128, [23]), (144, [24])],
    "c": [(64, [31, 32]), (128, [33, 34])],  # coalesced: two tokens per chunk
}


def workload(ids: list[str]) -> list[WorkloadRequest]:
    return [WorkloadRequest(request(rid, prompt=[ord(rid)] * 6), 0.0, 6) for rid in ids]


def run_driver(
    backend: OpenAIBackend, items: list[WorkloadRequest], clock: FakeClock
) -> dict[str, pd.DataFrame]:
    rows: dict[str, list[dict[str, Any]]] = {"requests": [], "tokens": [], "steps": []}
    # the driver's clock is the backend's, as in a real run (both engines.base.now_ns)
    Driver(backend, lambda table, row: rows[table].append(row), clock=clock).run(items)
    return {t: pd.DataFrame(rows[t], columns=COLUMNS[t]) for t in rows}


def test_metrics_on_a_scripted_server_are_exact() -> None:
    clock = FakeClock()
    server = ScriptedServer(
        clock,
        lambda b: (lambda rid: vllm_stream(rid, SCHEDULE[rid], 6))(chr(b["prompt"][0])),
        expected=3,
    )
    backend = backend_for(server, clock)
    frames = run_driver(backend, workload(["a", "b", "c"]), clock)
    requests = frames["requests"].set_index("request_id")
    seconds = {
        rid: [tick / 512 for tick, ids in chunks for _ in ids] for rid, chunks in SCHEDULE.items()
    }
    for rid, times in seconds.items():
        row = requests.loc[rid]
        assert row["status"] == "ok" and row["finish_reason"] == "length"
        assert (row["arrival_s"], row["sent_s"], row["tokenized_s"]) == (0.0, 0.0, 0.0)
        assert row["first_token_s"] == times[0] and row["last_token_s"] == times[-1]
        assert row["output_tokens"] == row["output_tokens_requested"] == 4
        assert row["prompt_tokens"] == 6
        assert row["finished_s"] == (SCHEDULE[rid][-1][0] + 1) / 512
    tokens = frames["tokens"]
    assert list(tokens[tokens["request_id"] == "c"]["time_s"]) == seconds["c"]
    assert list(tokens[tokens["request_id"] == "c"]["token_id"]) == [31, 32, 33, 34]

    summary = compute_summary(frames["requests"], frames["tokens"], frames["steps"])
    ttft = np.array([t[0] for t in seconds.values()])
    e2e = np.array([t[-1] for t in seconds.values()])
    tpot = np.array([(t[-1] - t[0]) / 3 for t in seconds.values()])
    itl = np.concatenate([np.diff(t) for t in seconds.values()])
    assert sorted(itl) == sorted([1 / 16] * 3 + [1 / 32] * 3 + [0.0, 1 / 8, 0.0])
    exact = pytest.approx
    assert summary["ttft_mean_s"] == exact(ttft.mean(), abs=1e-12)
    assert summary["ttft_p50_s"] == exact(np.percentile(ttft, 50), abs=1e-12)
    assert summary["ttft_p99_s"] == exact(np.percentile(ttft, 99), abs=1e-12)
    assert summary["e2e_mean_s"] == exact(e2e.mean(), abs=1e-12)
    assert summary["tpot_mean_s"] == exact(tpot.mean(), abs=1e-12)
    assert summary["itl_mean_s"] == exact(itl.mean(), abs=1e-12)
    assert summary["itl_p50_s"] == exact(np.percentile(itl, 50), abs=1e-12)
    assert summary["itl_max_s"] == exact(itl.max(), abs=1e-12)
    assert summary["duration_s"] == exact(0.28125, abs=1e-12)  # last token at 144/512 s
    assert summary["output_tok_per_s"] == exact(12 / 0.28125, abs=1e-9)
    assert (summary["num_completed"], summary["num_failed"]) == (3, 0)
    assert summary["input_tokens_total"] == 18 and summary["output_tokens_total"] == 12
    live = backend.describe()["client"]
    assert live["requests_finished"] == 3 and live["chunks"] == 5 + 5 + 3  # + usage/[DONE]
    assert live["output_tokens_usage"] == live["output_tokens_counted"] == 12


def test_one_bad_request_fails_alone() -> None:
    clock = FakeClock()
    http_error = (FIXTURES / "vllm_http_400.json").read_bytes()
    stream_error = fixture_reads("vllm_stream_error.sse")

    def script(body: dict[str, Any]) -> Reply:
        rid = chr(body["prompt"][0])
        if rid == "x":
            return Reply(status=400, body=http_error)
        if rid == "y":
            return Reply([(T0 + (k + 1) * TICK, r) for k, r in enumerate(stream_error)])
        return vllm_stream(rid, SCHEDULE[rid], 6)

    server = ScriptedServer(clock, script, expected=4)
    backend = backend_for(server, clock)
    frames = run_driver(backend, workload(["a", "x", "b", "y"]), clock)
    requests = frames["requests"].set_index("request_id")
    assert list(requests.loc[["a", "b"], "status"]) == ["ok", "ok"]
    assert list(requests.loc[["a", "b"], "output_tokens"]) == [4, 4]
    assert requests.loc["x", "status"] == "failed" and "HTTP 400" in requests.loc["x", "error"]
    assert "The engine died unexpectedly." in requests.loc["y", "error"]
    summary = compute_summary(frames["requests"], frames["tokens"], frames["steps"])
    assert (summary["num_completed"], summary["num_failed"]) == (2, 2)
    assert summary["ttft_mean_s"] == pytest.approx((32 / 512 + 96 / 512) / 2, abs=1e-12)
    live = backend.describe()["client"]
    assert (live["requests_finished"], live["requests_failed"]) == (2, 2)


def test_warmup_requests_stay_out_of_the_client_figures() -> None:
    clock = FakeClock()
    server = ScriptedServer(clock, lambda b: vllm_stream("a", SCHEDULE["a"], 3), expected=2)
    backend = backend_for(server, clock)
    collect(backend, request("warmup-r0"), request("r1"))
    live = backend.describe()["client"]
    assert live["requests_finished"] == 1 and live["chunks"] == 5


# ---- configuration and the server check ---------------------------------------------------


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"api": "responses"}, "engine.api: 'responses' is invalid; allowed: completions|chat"),
        ({"server": "ollama"}, "allowed: vllm|sglang|tgi|llamacpp|llama_cpp_python|generic|auto"),
        ({"server": "auto", "check_server": False}, "'auto' asks the server which it is at load"),
        ({"base_url": "localhost:8000"}, "engine.base_url"),
        ({"timeout_s": 0}, "engine.timeout_s: 0 is invalid"),
        ({"max_connections": 0}, "engine.max_connections: 0 is invalid; allowed: an integer >= 1"),
        ({"api_key_env": "sk-12345"}, "the NAME of an environment variable"),
        ({"api_key_env": "INFERLAB_TEST_UNSET_KEY"}, "INFERLAB_TEST_UNSET_KEY is not set"),
        ({"include_usage": "yes"}, "engine.include_usage: 'yes' is invalid; allowed: true|false"),
        ({"batching": "static"}, "unknown option(s) ['batching']"),
    ],
)
def test_bad_options_name_the_field_and_the_allowed_values(
    options: dict[str, Any], needle: str
) -> None:
    with pytest.raises(OpenAIConfigError, match=None) as info:
        OpenAIConfig.from_config(options, TINY)
    assert needle in str(info.value)


def test_load_checks_the_server_and_sends_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLAB_TEST_KEY", "sk-test-123")
    clock = FakeClock()
    reads = fixture_reads("vllm_completions_usage.sse")
    server = ScriptedServer(
        clock,
        lambda b: Reply([(T0 + TICK, b"".join(reads))]),
        models=[{"id": "tiny", "object": "model", "max_model_len": 512}],
    )
    backend = backend_for(server, clock, check_server=True, api_key_env="INFERLAB_TEST_KEY")
    facts = backend.describe()
    assert facts["max_model_len"] == 512 and facts["server_models"] == ["tiny"]
    collect(backend, request())
    assert all(r.headers["authorization"] == "Bearer sk-test-123" for r in server.requests)
    assert "sk-test-123" not in json.dumps(facts)

    other = ScriptedServer(clock, lambda b: Reply(), models=[{"id": "llama", "object": "model"}])
    with pytest.raises(ValueError, match=r"engine.model: 'tiny' is not served .* \['llama'\]"):
        backend_for(other, clock, check_server=True)


LLAMA_CPP_PYTHON_CARD = {"id": "tiny", "object": "model", "owned_by": "me", "permissions": []}
DETECTIONS = [
    # requested, models' owned_by, other pages, dialect used, detected
    ("llamacpp", "me", {}, "llama_cpp_python", "llama_cpp_python"),
    ("llamacpp", "llamacpp", {}, "llamacpp", "llamacpp"),
    ("auto", "vllm", {}, "vllm", "vllm"),
    ("auto", "inferlab", {}, "vllm", "vllm"),
    ("auto", "sglang", {}, "sglang", "sglang"),
    (
        "auto",
        "someone",
        {"/openapi.json": {"info": {"title": "\U0001f999 llama.cpp Python API"}}},
        "llama_cpp_python",
        "llama_cpp_python",
    ),
    ("auto", "system", {"/info": {"router": "text-generation-router"}}, "tgi", "tgi"),
    ("auto", "openai", {}, "generic", None),
    ("vllm", "me", {}, "vllm", "llama_cpp_python"),  # a named server is used as named
]


@pytest.mark.parametrize(
    "requested,owner,pages,used,detected", DETECTIONS, ids=[f"{d[0]}-{d[1]}" for d in DETECTIONS]
)
def test_the_server_that_answers_picks_the_dialect(
    requested: str,
    owner: str,
    pages: dict[str, Any],
    used: str,
    detected: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    reads = fixture_reads("llama_cpp_python_completions.sse")
    server = ScriptedServer(
        clock,
        lambda b: Reply(at(*reads)),
        pages=pages,
        models=[{**LLAMA_CPP_PYTHON_CARD, "owned_by": owner}],
    )
    with caplog.at_level("INFO", logger="engines.openai.backend"):
        backend = backend_for(server, clock, check_server=True, server=requested)
    facts = backend.describe()
    assert (facts["server"], facts["server_requested"], facts["server_detected"]) == (
        used,
        requested,
        detected,
    )
    assert facts["server_detection"].startswith(
        "GET http://scripted" if detected else "no known signature"
    )
    assert backend.dialect is DIALECTS[used]
    collect(backend, request())
    [body] = server.bodies
    assert isinstance(body["prompt"], list) == DIALECTS[used].token_prompts
    if requested == "vllm":  # kept as asked, and the mismatch said out loud
        assert any("answers as llama_cpp_python" in r.getMessage() for r in caplog.records)
    # only a dialect that is being chosen asks for pages beyond /v1/models
    asked = {r.url.path for r in server.requests if r.method == "GET"}
    assert asked <= (
        {"/v1/models"}
        | (set(pages) | {"/openapi.json", "/info"} if requested in ("auto", "llamacpp") else set())
    )
    if requested == "vllm":
        assert asked == {"/v1/models"}


def test_engine_openai_composes_from_the_config_group() -> None:
    from omegaconf import OmegaConf

    import configs
    from engines.backends import build_backend

    cfg = configs.compose(["engine=openai", "model=tiny", "engine.server=sglang"])
    config = OmegaConf.to_container(cfg, resolve=True)
    backend = build_backend(config["engine"], config["model"])  # validates, does not connect
    assert isinstance(backend, OpenAIBackend)
    assert (backend.config.model, backend.config.server) == ("tiny", "sglang")
