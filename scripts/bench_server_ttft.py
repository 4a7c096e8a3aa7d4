"""TTFT through `inferlab serve` on loopback: vs in process at batch 1, and as the client sees
it vs as the server reports it while other streams decode.

    .venv/bin/python scripts/bench_server_ttft.py model=small engine.dtype=fp32 \\
        --requests 100 --prompt-len 64 --max-tokens 4 --background-streams 4

1. Batch 1 (issue 7): requests one at a time, so the difference is the serving path's overhead
   (HTTP, JSON, SSE, the client), not queueing. In process: the built-in backend's async
   stream, TTFT from submitting the request to its first token event. Through the server: a
   subprocess running `inferlab serve` with the same overrides, TTFT from sending the request
   to receiving the first SSE chunk, with httpx (as the harness's openai backend sends) and
   with a minimal raw HTTP/1.1 client (what the server alone adds). Target: p50 within 5 ms.
2. Under decode load (issue 15): `--background-streams` long streams keep decoding while the
   same requests go one at a time; for each, the client's TTFT (raw client) and the server's
   own (the rise of `inferlab_time_to_first_token_seconds_sum` across the request, from
   /metrics). Before the engine left the event loop, a request waited for the step in
   progress before the server even read it, and the server's TTFT left that wait out. Target:
   the two p50s within 5 ms. Probes during which a background stream restarted (a second
   TTFT observation) are dropped and counted.

`--server-cwd DIR` runs `inferlab serve` from another checkout (before/after comparisons).
Prints tables and, with --out, writes JSON. Exit status 0 when every target it measured is
met, 1 otherwise (`make check-server-ttft`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# the most a p50 TTFT through the server may exceed the one it is compared with (issues 7, 15)
TARGET_MS = 5.0
sys.path.insert(0, str(ROOT))

from script_args import parse_args_checking_out, refuse  # noqa: E402

from engines.base import GenerationRequest, Tokens, now_ns  # noqa: E402
from engines.sampling_params import SamplingParams  # noqa: E402
from harness.arguments import at_least  # noqa: E402
from models.files import write_output_text  # noqa: E402
from serving.cli import build_backend, warm_up  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def in_process_ttfts(backend: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
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
            payload = stream_payload(prompt, max_tokens)
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


async def raw_server_ttfts(
    host: str, port: int, prompts: list[list[int]], max_tokens: int
) -> list[float]:
    """The same requests from a minimal HTTP/1.1 client on one keep-alive connection: what
    the server adds, without httpx's own per-request cost."""
    reader, writer = await asyncio.open_connection(host, port)
    ttfts = []
    try:
        for prompt in prompts:
            ttfts.append(await _raw_ttft(reader, writer, _post(host, prompt, max_tokens)))
    finally:
        writer.close()
    return ttfts


async def _raw_ttft(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> float:
    """Sends a streaming request and reads its whole response; ms to its first data chunk."""
    sent = now_ns()
    writer.write(request)
    buffer = b""
    while b"data: {" not in buffer:
        buffer += await _read(reader)
    ttft_ms = (now_ns() - sent) / 1e6
    await _read_to_end(reader, buffer)
    return ttft_ms


async def _read_to_end(reader: asyncio.StreamReader, buffer: bytes) -> None:
    while not buffer.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's last chunk
        buffer += await _read(reader)


async def _read(reader: asyncio.StreamReader) -> bytes:
    data = await reader.read(65536)
    if not data:
        raise ConnectionError("the server closed the connection")
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def loaded_ttfts(
    host: str,
    port: int,
    prompts: list[list[int]],
    max_tokens: int,
    background: int,
    background_tokens: int,
) -> tuple[list[tuple[float, float]], int]:
    """(client TTFT, server TTFT) in ms per request, sent one at a time on a raw keep-alive
    connection while `background` long streams decode; and how many probes were dropped."""
    stop = asyncio.Event()

    async def decode_forever(index: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        request = _post(host, prompts[index % len(prompts)], background_tokens)
        try:
            while not stop.is_set():
                writer.write(request)
                await _read_to_end(reader, b"")
        finally:
            writer.close()

    async def ttft_sum_count() -> tuple[float, int]:
        # a connection of its own each time: a probe may outlast the keep-alive timeout
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        text = (await reader.read()).decode().partition("\r\n\r\n")[2]
        writer.close()
        total = float(
            re.search(
                r"^inferlab_time_to_first_token_seconds_sum (\S+)$", text, re.MULTILINE
            ).group(1)
        )  # type: ignore[union-attr]
        count = int(
            float(
                re.search(
                    r"^inferlab_time_to_first_token_seconds_count (\S+)$", text, re.MULTILINE
                ).group(1)
            )
        )  # type: ignore[union-attr]
        return total, count

    tasks = [asyncio.ensure_future(decode_forever(i)) for i in range(background)]
    reader, writer = await asyncio.open_connection(host, port)
    pairs, dropped = [], 0
    try:
        await asyncio.sleep(2.0)  # every background stream past its first token
        for prompt in prompts:
            before_sum, before_count = await ttft_sum_count()
            client = await _raw_ttft(reader, writer, _post(host, prompt, max_tokens))
            after_sum, after_count = await ttft_sum_count()
            if after_count != before_count + 1:
                dropped += 1
                continue
            pairs.append((client, (after_sum - before_sum) * 1e3))
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()
    return pairs, dropped


def stream_payload(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streaming completion of exactly `max_tokens` tokens, greedy."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def _post(host: str, prompt: list[int], max_tokens: int) -> bytes:
    """The raw HTTP/1.1 request for stream_payload."""
    body = json.dumps(stream_payload(prompt, max_tokens)).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def start_server(
    overrides: list[str], port: int, cwd: Path = ROOT, timeout_s: float = 300
) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "harness.cli",
        "serve",
        *overrides,
        "host=127.0.0.1",
        f"port={port}",
        "log_level=warning",
    ]
    process = subprocess.Popen(command, cwd=cwd)
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
    return {
        "name": name,
        "p50_ms": statistics.median(ttfts),
        "p90_ms": percentile(ttfts, 0.9),
        "mean_ms": statistics.fmean(ttfts),
        "min_ms": min(ttfts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="engine/model overrides, as for serve")
    parser.add_argument("--requests", type=at_least(1), default=100)
    parser.add_argument("--warmup", type=at_least(0), default=5)
    parser.add_argument("--prompt-len", type=at_least(1), default=64)
    parser.add_argument("--max-tokens", type=at_least(1), default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--background-streams",
        type=at_least(0),
        default=4,
        help="streams decoding during part 2 (0: skip part 2)",
    )
    parser.add_argument(
        "--background-tokens",
        type=at_least(1),
        default=512,
        help="max_tokens of each background stream (restarted when done)",
    )
    parser.add_argument("--skip-batch1", action="store_true", help="run part 2 only")
    parser.add_argument(
        "--server-cwd", type=Path, default=ROOT, help="run `inferlab serve` from this checkout"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parse_args_checking_out(parser)
    if args.skip_batch1 and not args.background_streams:  # a check of nothing would pass
        parser.error("--skip-batch1 with --background-streams 0 leaves nothing to measure")

    try:  # a bad override: its one line, exit 2 (1 is the target missed)
        backend, _ = build_backend(args.overrides)
        backend.load()
    except ValueError as exc:
        refuse(str(exc))
    warm_up(backend)
    assert backend.engine is not None
    vocab = backend.engine.tokenizer.vocab_size
    prompts = make_prompts(args.warmup + args.requests, args.prompt_len, vocab, args.seed)
    results: dict[str, Any] = {
        "overrides": args.overrides,
        "args": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("out", "overrides")
        },
    }
    if not args.skip_batch1:
        in_process = asyncio.run(in_process_ttfts(backend, prompts, args.max_tokens))
    backend.close()  # free its memory before the server builds its own engine

    port = free_port()
    server = start_server(args.overrides, port, args.server_cwd)
    try:
        if not args.skip_batch1:
            served = asyncio.run(server_ttfts(f"http://127.0.0.1:{port}", prompts, args.max_tokens))
            served_raw = asyncio.run(raw_server_ttfts("127.0.0.1", port, prompts, args.max_tokens))
        if args.background_streams:
            pairs, dropped = asyncio.run(
                loaded_ttfts(
                    "127.0.0.1",
                    port,
                    prompts,
                    args.max_tokens,
                    args.background_streams,
                    args.background_tokens,
                )
            )
    finally:
        server.terminate()
        server.wait(timeout=60)

    print(
        f"TTFT, prompt {args.prompt_len} tokens, max_tokens {args.max_tokens}, overrides: "
        f"{' '.join(args.overrides) or '(defaults)'}; server from {args.server_cwd}"
    )
    if not args.skip_batch1:
        rows = [
            summary("in process", in_process[args.warmup :]),
            summary("server, httpx client", served[args.warmup :]),
            summary("server, raw client", served_raw[args.warmup :]),
        ]
        delta = rows[1]["p50_ms"] - rows[0]["p50_ms"]
        delta_raw = rows[2]["p50_ms"] - rows[0]["p50_ms"]
        print(f"\n1. batch 1, {args.requests} requests")
        print_rows(rows)
        for name, value in (("httpx client", delta), ("raw client", delta_raw)):
            print(f"server ({name}) - in process, p50: {value:+.2f} ms ({verdict(value)})")
        results.update(rows=rows, p50_delta_ms=delta, p50_delta_raw_ms=delta_raw)
    if args.background_streams:
        kept = pairs[args.warmup :]
        loaded = [
            summary("client (raw)", [c for c, _ in kept]),
            summary("server (/metrics)", [s for _, s in kept]),
        ]
        gap = loaded[0]["p50_ms"] - loaded[1]["p50_ms"]
        print(
            f"\n2. while {args.background_streams} streams decode: {len(kept)} requests "
            f"({dropped} dropped: a background stream restarted meanwhile)"
        )
        print_rows(loaded)
        print(f"client - server, p50: {gap:+.2f} ms ({verdict(gap)})")
        results.update(loaded_rows=loaded, loaded_p50_gap_ms=gap, loaded_dropped=dropped)
    if args.out:
        write_output_text(args.out, json.dumps(results, indent=2), "--out")
    return exit_status(results)


def exit_status(results: dict[str, Any]) -> int:
    """0 when every p50 gap the run measured is within TARGET_MS, else 1."""
    gaps = [results.get(key) for key in ("p50_delta_ms", "p50_delta_raw_ms", "loaded_p50_gap_ms")]
    return 0 if all(gap <= TARGET_MS for gap in gaps if gap is not None) else 1


def verdict(gap_ms: float) -> str:
    return f"{'meets' if gap_ms <= TARGET_MS else 'misses'} the {TARGET_MS:g} ms target"


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'':22} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9} {'min ms':>9}")
    for row in rows:
        print(
            f"{row['name']:22} {row['p50_ms']:9.2f} {row['p90_ms']:9.2f} "
            f"{row['mean_ms']:9.2f} {row['min_ms']:9.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
