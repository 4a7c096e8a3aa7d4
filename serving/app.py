"""The OpenAI-compatible HTTP API over a loaded built-in engine: `create_app(backend)`.

Every handler is `async def`, so all of them and the backend's engine loop share one event loop
and one thread: the engine steps between handler turns, and a request that arrives mid-step is
admitted at the next step boundary (continuous batching across connections).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.base import now_ns
from engines.builtin.backend import BuiltinBackend
from engines.sampling_params import SamplingParams
from serving.config import ServerConfig
from serving.formats import ChatWriter, CompletionWriter, Writer, collect, event_stream
from serving.generation import ServingEngine
from serving.prometheus import CONTENT_TYPE
from serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    _SamplingFields,
    api_error_from_validation,
    error_body,
)
from serving.sse import ClientDisconnected, EventStreamResponse, unless_disconnected

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default; chat defaults to the context left


def default_model_name(backend: BuiltinBackend) -> str:
    assert backend.engine is not None
    return str(backend.engine.config.model)


def create_app(backend: BuiltinBackend, config: ServerConfig | None = None) -> FastAPI:
    """The app over `backend`, which must be loaded; the caller owns (and closes) it."""
    config = config or ServerConfig()
    serving = ServingEngine(backend, config)
    model_name = config.served_model_name or default_model_name(backend)
    created = int(time.time())
    app = FastAPI(title="inferlab", version="1", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 400:
            serving.metrics.requests_invalid.inc()
        headers = {"Retry-After": "1"} if exc.status_code == 503 else None
        return JSONResponse(exc.body(), exc.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", None,
                                       str(exc.status_code)), exc.status_code)

    @app.get("/health")
    async def health() -> dict[str, str]:
        serving.engine  # noqa: B018 - raises 503 once the engine is closed
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=model_name, created=created, max_model_len=serving.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival_ns = now_ns()
        body = await _parse(request, CompletionRequest)
        _check_common(body, model_name)
        prompts = _completion_prompts(serving, body.prompt)
        requested = OPENAI_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        max_tokens = [serving.check_prompt(ids, requested, "prompt") for ids in prompts]
        sampling = [_sampling(body, m) for m in max_tokens]
        return await _respond(request, serving, body, "cmpl", prompts, sampling, arrival_ns,
                              CompletionWriter, model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival_ns = now_ns()
        body = await _parse(request, ChatCompletionRequest)
        _check_common(body, model_name)
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
        try:
            prompt = serving.engine.tokenize(messages)
        except ValueError as exc:
            raise APIError(f"messages: {exc}", "messages", "invalid_value") from None
        requested, name = ((body.max_tokens, "max_tokens") if body.max_completion_tokens is None
                           else (body.max_completion_tokens, "max_completion_tokens"))
        max_tokens = serving.check_prompt(prompt, requested, "messages", name)
        sampling = [_sampling(body, max_tokens, name)]
        return await _respond(request, serving, body, "chatcmpl", [prompt], sampling,
                              arrival_ns, ChatWriter, model_name)

    return app


# ---- request checks ---------------------------------------------------------------------------


async def _parse(request: Request, model: type[_SamplingFields]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"We could not parse the JSON body of your request: {exc}", None,
                       "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", None, "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise api_error_from_validation(exc) from None


def _check_common(body: _SamplingFields, model_name: str) -> None:
    if body.model is not None and body.model != model_name:
        raise APIError(f"The model `{body.model}` does not exist; this server serves "
                       f"`{model_name}`", "model", "model_not_found")
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(f"{unsupported}: unsupported by the built-in engine (value "
                       f"{getattr(body, unsupported)!r}); leave it unset", unsupported,
                       "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options: only allowed when stream is true", "stream_options",
                       "invalid_value")
    # Sample i of n seeds its generator with seed + i (inside an engine step, where an
    # overflow would fail every request in the batch), so the last one must fit too.
    last_sample = max(body.n or 1, 1) - 1
    if body.seed is not None and not -(2**63) <= body.seed <= 2**64 - 1 - last_sample:
        raise APIError(f"seed: {body.seed} is out of range; allowed: an integer in "
                       f"[-2**63, 2**64 - n] (n={last_sample + 1}: sample i uses seed + i)",
                       "seed", "invalid_value")


def _completion_prompts(serving: ServingEngine, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [serving.engine.tokenize(prompt)]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [serving.engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompt]


def _sampling(body: _SamplingFields, max_tokens: int,
              max_tokens_param: str = "max_tokens") -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            n=1 if body.n is None else body.n,
        )
    except ValueError as exc:
        # "SamplingParams.top_p: 2.0 is invalid; allowed: ..." -> param "top_p"
        message = str(exc).removeprefix("SamplingParams.")
        param = message.split(":", 1)[0]
        if param == "max_tokens":  # the name the client used (chat: max_completion_tokens)
            param = max_tokens_param
            message = max_tokens_param + message.removeprefix("max_tokens")
        raise APIError(message, param, "invalid_value") from None


# ---- responses --------------------------------------------------------------------------------


async def _respond(request: Request, serving: ServingEngine, body: _SamplingFields,
                   prefix: str, prompts: list[list[int]], sampling: list[SamplingParams],
                   arrival_ns: int, writer_type: type[Writer], model_name: str) -> Response:
    n = sampling[0].n
    serving.check_engine_accepts(prompts, sampling)
    admission = serving.admit(len(prompts) * n)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    writer = writer_type(request_id, int(time.time()), model_name, prompts, n,
                         include_usage=bool(body.stream_options
                                            and body.stream_options.include_usage),
                         return_token_ids=body.return_token_ids)
    pieces = serving.generate(request_id, prompts, sampling, arrival_ns, admission)
    if body.stream:
        return EventStreamResponse(event_stream(pieces, writer), on_close=admission.release)
    try:
        choices = await unless_disconnected(request.receive, collect(pieces))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    finally:
        await pieces.aclose()
        admission.release()
    return JSONResponse(writer.response(choices))
