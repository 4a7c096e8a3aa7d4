"""TTFT through `inferlab serve` on loopback vs in process, same engine options, same prompts.

    .venv/bin/python scripts/bench_server_ttft.py model=small engine.dtype=fp32 \\
        --requests 100 --prompt-len 64 --max-tokens 4

Requests go one at a time (batch 1), so the difference is the serving path's overhead: HTTP,
JSON, SSE and the client, not queueing. In process: the built-in backend's async stream, TTFT
from submitting the request to receiving its first token event. Through the server: a
subprocess running `inferlab serve` with the same overrides, an httpx streaming client, TTFT
from sending the request to receiving the first SSE chunk (measured twice: with httpx, as the
harness's openai backend sends, and with a minimal raw HTTP/1.1 client that shows what the
server alone adds). Issue 7's target: the server's TTFT p50 within 5 ms of the in-process one.
Prints a table and, with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.base import GenerationRequest, Tokens, now_ns  # noqa: E402
from engines.sampling_params import SamplingParams  # noqa: E402
from serving.cli import build_backend, warm_up  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def in_process_ttfts(backend: Any, prompts: list[list[int]],
                           max_tokens: int) -> list[float]:
    ttfts = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sent = now_ns()
        first = None
        async for event in backend.generate(GenerationRequest(f"bench-{i}", prompt, sampling)):
            if first is None and isinstance(event, Tokens):
                first = now_ns()
        assert first is not None
        ttfts.append((first - sent) / 1e6)
    return ttfts


async def server_ttfts(base_url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    ttfts = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        for prompt in prompts:
            payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}
            sent = now_ns()
            first = None
            async with client.stream("POST", "/v1/completions", json=payload) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = now_ns()
            assert first is not None
            ttfts.append((first - sent) / 1e6)
    return ttfts


async def raw_server_ttfts(host: str, port: int, prompts: list[list[int]],
                           max_tokens: int) -> list[float]:
    """The same requests from a minimal HTTP/1.1 client on one keep-alive connection: what
    the server adds, without httpx's own per-request cost."""
    reader, writer = await asyncio.open_connection(host, port)
    ttfts = []
    try:
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True, "stream": True}).encode()
            request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                       "Content-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            sent = now_ns()
            writer.write(request)
            buffer = b""
            while b"data: {" not in buffer:
                buffer += await _read(reader)
            ttfts.append((now_ns() - sent) / 1e6)
            while not buffer.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
                buffer += await _read(reader)
    finally:
        writer.close()
    return ttfts


async def _read(reader: asyncio.StreamReader) -> bytes:
    data = await reader.read(65536)
    if not data:
        raise ConnectionError("the server closed the connection")
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(overrides: list[str], port: int, timeout_s: float = 300) -> subprocess.Popen:
    command = [sys.executable, "-m", "harness.cli", "serve", *overrides, "host=127.0.0.1",
               f"port={port}", "log_level=warning"]
    process = subprocess.Popen(command, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {command}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not become healthy in time")


def summary(name: str, ttfts: list[float]) -> dict[str, float]:
    return {"name": name, "p50_ms": statistics.median(ttfts), "p90_ms": percentile(ttfts, 0.9),
            "mean_ms": statistics.fmean(ttfts), "min_ms": min(ttfts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="engine/model overrides, as for serve")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    backend, _ = build_backend(args.overrides)
    backend.load()
    warm_up(backend)
    assert backend.engine is not None
    vocab = backend.engine.tokenizer.vocab_size
    prompts = make_prompts(args.warmup + args.requests, args.prompt_len, vocab, args.seed)
    in_process = asyncio.run(in_process_ttfts(backend, prompts, args.max_tokens))
    backend.close()  # free its memory before the server builds its own engine

    port = free_port()
    server = start_server(args.overrides, port)
    try:
        served = asyncio.run(server_ttfts(f"http://127.0.0.1:{port}", prompts,
                                          args.max_tokens))
        served_raw = asyncio.run(raw_server_ttfts("127.0.0.1", port, prompts,
                                                  args.max_tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)

    rows = [summary("in process", in_process[args.warmup:]),
            summary("server, httpx client", served[args.warmup:]),
            summary("server, raw client", served_raw[args.warmup:])]
    delta = rows[1]["p50_ms"] - rows[0]["p50_ms"]
    delta_raw = rows[2]["p50_ms"] - rows[0]["p50_ms"]
    print(f"TTFT over {args.requests} requests, prompt {args.prompt_len} tokens, batch 1, "
          f"overrides: {' '.join(args.overrides) or '(defaults)'}")
    print(f"{'':22} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9} {'min ms':>9}")
    for row in rows:
        print(f"{row['name']:22} {row['p50_ms']:9.2f} {row['p90_ms']:9.2f} "
              f"{row['mean_ms']:9.2f} {row['min_ms']:9.2f}")
    for name, value in (("httpx client", delta), ("raw client", delta_raw)):
        verdict = "meets" if value <= 5.0 else "misses"
        print(f"server ({name}) - in process, p50: {value:+.2f} ms ({verdict} the 5 ms target)")
    if args.out:
        args.out.write_text(json.dumps({"overrides": args.overrides, "args": {
            k: v for k, v in vars(args).items() if k not in ("out", "overrides")},
            "rows": rows, "p50_delta_ms": delta, "p50_delta_raw_ms": delta_raw}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
