"""The server under load on loopback: 200 concurrent streams all complete with every token and
leak no KV block; a client that disconnects aborts its request and frees its blocks; overload
gets 503 with OpenAI's error body, never a crash or a hang. model=tiny, paged KV."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from engines.builtin import LLM, EngineConfig, SamplingParams
from engines.builtin.backend import BuiltinBackend
from engines.builtin.kv_cache import PagedKVCacheManager
from serving import ServerConfig
from serving.testing import RunningServer, serve_in_thread

OPTIONS: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=1024,
                               max_num_seqs=256, kv_cache="paged",
                               kv_cache_memory_bytes=16 << 20)
NUM_STREAMS = 200
MAX_TOKENS = 8


@contextmanager
def start(options: dict[str, Any], config: ServerConfig) -> Iterator[RunningServer]:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **options}))
    backend.load()
    with serve_in_thread(backend, config) as running:
        yield running
    backend.close()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with start(OPTIONS, ServerConfig(max_queue_len=64)) as running:
        yield running


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def assert_idle_and_no_kv_leaked(server: RunningServer) -> None:
    """Every block back in the pool, no sequence left anywhere, admission count back to 0."""
    serving = server.serving
    engine = serving.engine
    kv = engine.kv
    assert isinstance(kv, PagedKVCacheManager)
    assert wait_until(lambda: not engine.has_unfinished_requests() and serving.in_flight == 0)
    assert kv.pool.num_in_use == 0
    assert kv.pool.num_free == kv.layout.num_blocks - 1  # all but the null block
    assert kv.block_tables == {} and kv.num_blocks_in_use == 0
    assert engine.sequences == {}
    assert kv.bytes_reserved() == 0


async def read_stream(client: httpx.AsyncClient, prompt: str) -> tuple[str, int, dict[str, Any]]:
    """(text, number of token chunks, usage) of one streaming completion."""
    payload = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, chunks, usage, done = "", 0, None, False
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["usage"] is not None:
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            if choice["finish_reason"] is None:
                text += choice["text"]
                chunks += 1
            else:
                assert choice["finish_reason"] == "length"
    assert done and usage is not None
    return text, chunks, usage


def test_200_concurrent_streams_every_token_no_leak(server: RunningServer) -> None:
    prompts = [f"Request {i} says hello" for i in range(NUM_STREAMS)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # One batched call: this engine's greedy output does not depend on batch composition
    # (tests/test_batching.py), and the server batches these requests its own way.
    expected = LLM(model="tiny", **OPTIONS).generate(prompts, greedy)

    async def run_all() -> list[Any]:
        limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     limits=limits) as client:
            return await asyncio.gather(*(read_stream(client, p) for p in prompts),
                                        return_exceptions=True)

    batch_sizes: list[int] = []
    server.serving.backend.step_observers.append(lambda step: batch_sizes.append(step.num_seqs))
    started = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {NUM_STREAMS} failed, first: {failures[0]!r}"
    for (text, chunks, usage), want in zip(results, expected, strict=True):
        assert chunks == MAX_TOKENS  # every token arrived as its own chunk
        assert usage == {"prompt_tokens": len(want.prompt_token_ids),
                         "completion_tokens": MAX_TOKENS,
                         "total_tokens": len(want.prompt_token_ids) + MAX_TOKENS}
        assert text == want.text
    assert elapsed < 60, f"{NUM_STREAMS} streams took {elapsed:.1f} s"
    assert_idle_and_no_kv_leaked(server)
    # one engine loop batched requests from different connections together
    assert max(batch_sizes) > 1, batch_sizes
    assert sum(batch_sizes) >= NUM_STREAMS * MAX_TOKENS


def test_disconnect_mid_stream_aborts_and_frees_kv(server: RunningServer) -> None:
    metrics = server.serving.metrics
    aborted_before = metrics.requests_aborted.get()
    generated_before = metrics.generation_tokens.get()
    payload = {"prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True,
               "stream": True}

    with httpx.Client(base_url=server.base_url, timeout=30) as client, \
            client.stream("POST", "/v1/completions", json=payload) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(filter(None, lines), range(3), strict=False)]
        assert len(received) == 3 and all(line.startswith("data: ") for line in received)
        kv = server.serving.engine.kv
        assert isinstance(kv, PagedKVCacheManager)
        assert kv.pool.num_in_use > 0  # the request holds blocks while it streams
    # leaving the block closed the connection mid-stream

    assert wait_until(lambda: metrics.requests_aborted.get() == aborted_before + 1)
    assert_idle_and_no_kv_leaked(server)
    assert metrics.generation_tokens.get() - generated_before < 1000  # it stopped early


def test_disconnect_of_a_non_streaming_request_aborts_it(server: RunningServer) -> None:
    metrics = server.serving.metrics
    aborted_before = metrics.requests_aborted.get()
    payload = {"prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True}

    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            request = asyncio.ensure_future(client.post("/v1/completions", json=payload))
            assert await asyncio.to_thread(
                wait_until, lambda: server.serving.engine.kv.num_blocks_in_use > 0)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_early())
    assert wait_until(lambda: metrics.requests_aborted.get() == aborted_before + 1)
    assert_idle_and_no_kv_leaked(server)


def test_overload_gets_503_then_recovers() -> None:
    options = {**OPTIONS, "max_num_seqs": 2}
    with start(options, ServerConfig(max_queue_len=1)) as server:  # admits 3 sequences
        metrics = server.serving.metrics
        long = {"prompt": "Tell me everything.", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=long) as first, \
                    client.stream("POST", "/v1/completions", json=long) as second, \
                    client.stream("POST", "/v1/completions", json=long) as queued:
                assert [r.status_code for r in (first, second, queued)] == [200, 200, 200]
                assert server.serving.in_flight == 3
                for body in ({"prompt": "one more"},
                             {"prompt": "one more", "stream": True},
                             {"prompt": ["two", "prompts"]}):
                    refused = client.post("/v1/completions", json=body)
                    assert refused.status_code == 503
                    assert refused.headers["retry-after"] == "1"
                    error = refused.json()["error"]
                    assert (error["type"], error["code"]) == ("server_error",
                                                              "server_overloaded")
                    assert set(error) == {"message", "type", "param", "code"}
                assert metrics.requests_rejected.get() == 3
                # a request larger than the server could ever admit is the client's error
                too_big = client.post("/v1/completions", json={"prompt": "x", "n": 4})
                assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"
            # all three disconnected (one of them still queued): all aborted, KV freed
            assert wait_until(lambda: metrics.requests_aborted.get() == 3)
            assert_idle_and_no_kv_leaked(server)
            ok = client.post("/v1/completions", json={"prompt": "again", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            assert client.get("/health").status_code == 200
