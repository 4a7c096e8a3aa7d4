"""A scripted OpenAI-compatible streaming server with known timings, to measure the measuring
side: what the harness's client (engine=openai, one or many processes) adds to TTFT and ITL.

    python -m serving.scripted_server --port 8001 --ttft-ms 20 --itl-ms 5 --output-tokens 32
    inferlab run engine=openai engine.base_url=http://127.0.0.1:8001/v1 \\
        engine.model=scripted model=tiny ...

Each `/v1/completions` (or `/v1/chat/completions`) request waits `ttft_ms` from its arrival,
then sends `output_tokens` chunks of one token each, `itl_ms` apart (without
`--output-tokens`: the request's `max_tokens`), then the closing chunk, the usage chunk when
asked for and `[DONE]`: the chunks `inferlab serve` writes (serving/formats.py), one per token.
Chunk i is due at arrival + ttft + i * itl, so a late wake-up delays one chunk, not the rest.

The server records, per request, when each chunk was due and when it was sent (just before it
is written to the socket; `engines.base.now_ns`, the harness's clock: on one host, the
client's clock too) at
`GET /scripted/log` (`DELETE` clears it). Token ids count up over the server's life (the first
chunk it ever sends is id 0), so a run's `tokens.parquet` (`token_id`, with engine.server=vllm's
`return_token_ids`) joins the log chunk by chunk: the client's ITL against the server's actual
send gaps, and the server's own lateness (sent - due) apart from the client's. Prompt tokens in
the usage count are the ids sent, or the words of a text prompt (there is no tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engines.base import now_ns
from serving.config import ServerConfigError
from serving.formats import ChatWriter, CompletionWriter, Writer, collect, event_stream
from serving.generation import ChoiceEnd, ChoiceText, Piece
from serving.lifecycle import bind_socket
from serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from serving.sse import EventStreamResponse
from serving.testing import ServeProcess, serve_command


@dataclass(frozen=True)
class Script:
    ttft_ms: float = 20.0
    itl_ms: float = 5.0
    output_tokens: int | None = None  # None: each request's max_tokens
    model: str = "scripted"
    max_model_len: int = 8192


@dataclass
class RequestLog:
    """One request as the server played it; times are `now_ns`."""

    request: int  # the server's serial number
    received_ns: int
    prompt_tokens: int
    due_ns: list[int] = field(default_factory=list)  # per token chunk
    sent_ns: list[int] = field(default_factory=list)  # just before the write
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # every chunk sent (False: the client left, or still sending)


def create_scripted_app(script: Script) -> FastAPI:
    app = FastAPI(title="inferlab-scripted", docs_url=None, redoc_url=None, openapi_url=None)
    playback = _Playback(script, created=int(time.time()))
    app.state.log = playback.log
    _add_error_handler(app)
    _add_status_routes(app, playback)
    _add_log_routes(app, playback)
    _add_completion_routes(app, playback)
    return app


@dataclass
class _Playback:
    """What the server keeps across requests: its script, its log, and the counters that
    number its requests and token ids."""

    script: Script
    created: int
    log: list[RequestLog] = field(default_factory=list)
    serial: Iterator[int] = field(default_factory=itertools.count)
    token_ids: Iterator[int] = field(default_factory=itertools.count)

    async def respond(self, body: Any, writer_type: type[Writer], prompt_tokens: int) -> Response:
        received = now_ns()
        if (body.n or 1) != 1:
            raise APIError("n: the scripted server sends one choice", "n", "invalid_value")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        script = self.script
        count = script.output_tokens if script.output_tokens is not None else max_tokens
        entry = RequestLog(next(self.serial), received, prompt_tokens)
        self.log.append(entry)
        options = body.stream_options
        writer = writer_type(
            f"scripted-{entry.request}",
            self.created,
            script.model,
            [[0] * prompt_tokens],
            1,
            include_usage=bool(options and options.include_usage),
            return_token_ids=bool(body.return_token_ids),
        )
        pieces = self._play(entry, count, max_tokens)
        if body.stream:
            return EventStreamResponse(event_stream(pieces, writer), on_close=lambda: None)
        return JSONResponse(writer.response(await collect(pieces, writer)))

    async def _play(self, entry: RequestLog, count: int, max_tokens: int) -> AsyncIterator[Piece]:
        start = entry.received_ns + int(self.script.ttft_ms * 1e6)
        for i in range(count):
            due = start + int(i * self.script.itl_ms * 1e6)
            # again until due: uvloop's timers (milliseconds, on a cached loop time) can
            # wake a fraction of a millisecond early
            while (delay := (due - now_ns()) / 1e9) > 0:
                await asyncio.sleep(delay)
            token = next(self.token_ids)
            entry.due_ns.append(due)
            entry.token_ids.append(token)
            # Stamped before the write: from here to the socket the chunk is formatted and
            # written without giving up the event loop, while a stamp after the write could
            # come late (this process preempted) and read as a chunk that arrived early.
            entry.sent_ns.append(now_ns())
            yield ChoiceText(0, f" t{token}", (token,))
        entry.finished = True
        reason = "length" if count >= max_tokens else "stop"
        text = "".join(f" t{t}" for t in entry.token_ids)
        yield ChoiceEnd(0, reason, text, count)


def _add_error_handler(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status_code)


def _add_status_routes(app: FastAPI, playback: _Playback) -> None:
    script = playback.script

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(
            id=script.model, created=playback.created, max_model_len=script.max_model_len
        )
        return ModelList(data=[card]).model_dump()


def _add_log_routes(app: FastAPI, playback: _Playback) -> None:
    @app.get("/scripted/log")
    async def read_log() -> dict[str, Any]:
        return {
            "ttft_ms": playback.script.ttft_ms,
            "itl_ms": playback.script.itl_ms,
            "requests": [entry.__dict__ for entry in playback.log],
        }

    @app.delete("/scripted/log")
    async def clear_log() -> dict[str, Any]:
        playback.log.clear()
        return {"cleared": True}


def _add_completion_routes(app: FastAPI, playback: _Playback) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(await request.body(), CompletionRequest)
        prompt = body.prompt
        return await playback.respond(body, CompletionWriter, _count(prompt))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(await request.body(), ChatCompletionRequest)
        words = sum(_count(m.content) for m in body.messages if isinstance(m.content, str))
        return await playback.respond(body, ChatWriter, words)


def _count(prompt: Any) -> int:
    """Prompt tokens without a tokenizer: the ids sent, else the words of the text."""
    if isinstance(prompt, str):
        return max(len(prompt.split()), 1)
    if prompt and isinstance(prompt[0], int):
        return len(prompt)
    return sum(_count(p) for p in prompt)


def read_log(base_url: str) -> list[dict[str, Any]]:
    """A running scripted server's log (base_url without /v1)."""
    response = httpx.get(f"{base_url}/scripted/log", timeout=30)
    response.raise_for_status()
    return list(response.json()["requests"])


def with_send_times(tokens: pd.DataFrame, log: list[dict[str, Any]]) -> pd.DataFrame:
    """A run's token rows (tokens.parquet) joined with the server's log on `token_id`: each
    chunk's `sent_ns` and `due_ns`, and its request's `received_ns` (NaN for a token the
    server did not send), sorted by request and index."""
    chunks = pd.DataFrame(
        [
            (token, sent, due, entry["received_ns"])
            for entry in log
            for token, sent, due in zip(
                entry["token_ids"], entry["sent_ns"], entry["due_ns"], strict=True
            )
        ],
        columns=["token_id", "sent_ns", "due_ns", "received_ns"],
    )
    joined = tokens.merge(chunks, on="token_id", how="left")
    return joined.sort_values(["request_id", "index"], ignore_index=True)


@contextmanager
def scripted_process(args: list[str], log: Path) -> Iterator[ServeProcess]:
    """`python -m serving.scripted_server ARGS --port 0` in a process of its own, healthy when
    the block starts; its base_url is the root (…/v1 is the API)."""
    command = [sys.executable, "-m", "serving.scripted_server", *args, "--port", "0"]
    with serve_command(command, log, startup_timeout_s=60) as process:
        yield process


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m serving.scripted_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0: any free port")
    parser.add_argument("--ttft-ms", type=float, default=Script.ttft_ms)
    parser.add_argument("--itl-ms", type=float, default=Script.itl_ms)
    parser.add_argument(
        "--output-tokens", type=int, default=None, help="default: each request's max_tokens"
    )
    parser.add_argument("--model", default=Script.model, help="the served model name")
    parser.add_argument("--max-model-len", type=int, default=Script.max_model_len)
    args = parser.parse_args(argv)
    if args.ttft_ms < 0 or args.itl_ms < 0 or (args.output_tokens or 0) < 0:
        parser.error("--ttft-ms, --itl-ms and --output-tokens must be >= 0")
    if not 0 <= args.port <= 65535:  # the socket layer would take it modulo 65536
        parser.error(f"--port: {args.port} is invalid; allowed: 0..65535 (0: any free port)")
    script = Script(args.ttft_ms, args.itl_ms, args.output_tokens, args.model, args.max_model_len)
    try:
        sock = bind_socket(args.host, args.port, port_option="--port")
    except ServerConfigError as exc:  # the port is taken, the host unknown: one line
        parser.error(str(exc))
    host, port = sock.getsockname()[:2]
    print(
        f"inferlab serve: scripted server (TTFT {script.ttft_ms} ms, ITL {script.itl_ms} ms) "
        f"on http://{host}:{port}/v1",
        flush=True,
    )
    config = uvicorn.Config(
        create_scripted_app(script), log_level="warning", access_log=False, lifespan="off"
    )
    # The imports' million objects out of every collection: a full one stalled every stream
    # ~120 ms (as harness/running/heap.py measured for the client)
    gc.collect()
    gc.freeze()
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
