"""The OpenAI-compatible HTTP API over a loaded built-in engine: `create_app(backend)`.

Every handler is `async def` on one event loop; the engine steps in a thread of its own
(serving/generation.py), so the loop reads requests and writes tokens while a step runs, and a
request that arrives mid-step is admitted at the next step boundary (continuous batching across
connections).
"""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.builtin.backend import BuiltinBackend
from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from engines.tool_calls import ToolUse, tool_prompt
from serving.auth import APIKeyAuth
from serving.config import ServerConfig
from serving.formats import ChatWriter, CompletionWriter, Writer, collect, event_stream
from serving.generation import ServingEngine
from serving.lifecycle import RequestClock, arrival_ns
from serving.limits import BodySizeLimit, HeaderCountLimit
from serving.lora_routes import add_lora_routes
from serving.profiler import EngineProfiler, refuse_cross_origin
from serving.profiler import not_enabled as profiler_not_enabled
from serving.prometheus import CONTENT_TYPE
from serving.protocol import (
    NEUTRAL_VALUES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    _SamplingFields,
    check_model,
    error_body,
    read_request,
)
from serving.sse import ClientDisconnected, EventStreamResponse, unless_disconnected
from serving.tokenize_routes import add_tokenizer_routes


def _version() -> str:
    try:
        return importlib.metadata.version("inferlab")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


SERVER_VERSION = _version()

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default; chat defaults to the context left


def create_app(backend: BuiltinBackend, config: ServerConfig | None = None) -> FastAPI:
    """The app over `backend`, which must be loaded; the caller owns (and closes) it."""
    config = config or ServerConfig()
    serving = ServingEngine(backend, config)
    created = int(time.time())
    app = FastAPI(title="inferlab", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    _add_middleware(app, config)
    _add_error_handlers(app, serving)
    _add_status_routes(app, serving, created)
    _add_profiler_routes(app, serving)
    _add_completion_routes(app, serving)
    add_tokenizer_routes(app, serving)
    add_lora_routes(app, serving)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    # a middleware added later runs earlier: the key is checked before the body's size, and
    # a request refused by either is answered before its body is read
    app.add_middleware(BodySizeLimit, max_body_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=config.api_key)
    # a request's arrival (where the server's TTFT starts) is stamped first thing
    app.add_middleware(RequestClock, read_timeout_s=config.read_timeout_s)
    # outermost: a request with too many header fields is refused before anything looks at them
    app.add_middleware(HeaderCountLimit, max_header_count=config.max_header_count)


def _add_error_handlers(app: FastAPI, serving: ServingEngine) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 400:
            serving.metrics.requests_invalid.inc()
        headers = {"Retry-After": "1"} if exc.status_code == 503 else None
        return JSONResponse(exc.body(), exc.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(message, "invalid_request_error", None, str(exc.status_code)),
            exc.status_code,
        )


def _add_status_routes(app: FastAPI, serving: ServingEngine, created: int) -> None:
    """/health, the model list and card, and /metrics."""
    model_name = serving.model_name

    @app.get("/health")
    async def health() -> dict[str, str]:
        serving.check_serving()  # 503 once the engine is closed or shutting down
        return {"status": "ok"}

    @app.get("/version")  # as vLLM's: what a harness that started the server records
    async def version() -> dict[str, str]:
        return {"version": SERVER_VERSION}

    def cards() -> dict[str, ModelCard]:
        """The base model's card, then each LoRA adapter's (its folder, its parent), as
        vLLM lists them."""
        limit = serving.max_model_len
        found = {model_name: ModelCard(id=model_name, created=created, max_model_len=limit)}
        lora = serving.engine.lora
        for name in serving.adapter_names():
            root = None if lora is None else lora.paths.get(name)
            found[name] = ModelCard(
                id=name, created=created, max_model_len=limit, root=root, parent=model_name
            )
        return found

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=list(cards().values())).model_dump()

    @app.get("/v1/models/{model_id:path}")  # :path - a served name may hold "/" (org/model)
    async def model(model_id: str) -> dict[str, Any]:
        card = cards().get(model_id)
        if card is None:
            raise APIError(
                f"The model `{model_id}` does not exist; this server serves `{model_name}`",
                "model",
                "model_not_found",
                404,
            )
        return card.model_dump()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)


def _add_profiler_routes(app: FastAPI, serving: ServingEngine) -> None:
    """vLLM's profiler endpoints (serving/profiler.py); a request body (vllm bench sends one) is
    ignored."""

    @app.post("/start_profile")
    async def start_profile(request: Request) -> dict[str, Any]:
        return await _profiler(serving, request).start()

    @app.post("/stop_profile")
    async def stop_profile(request: Request) -> dict[str, Any]:
        return await _profiler(serving, request).stop()


def _add_completion_routes(app: FastAPI, serving: ServingEngine) -> None:
    added_ids = _added_ids(serving)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, serving, added_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat_complete(request, serving, added_ids)


def _added_ids(serving: ServingEngine) -> frozenset[int]:
    """Ids the tokenizer puts into any text by itself (BOS; some add EOS): a text or chat prompt
    with nothing else is empty. (The raw encoder: the prompt path refuses "" itself.)"""
    return frozenset(serving.engine.tokenizer.encode("")) | {
        i for i in (serving.engine.tokenizer.special.bos_id,) if i is not None
    }


async def _complete(
    request: Request, serving: ServingEngine, added_ids: frozenset[int]
) -> Response:
    arrived_ns = arrival_ns(request.scope)
    body = await read_request(request, CompletionRequest)
    adapter = _check_common(body, serving)
    prompts = await _completion_prompts(serving, body.prompt, added_ids)
    requested = OPENAI_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    max_tokens = [serving.check_prompt(ids, requested, "prompt") for ids in prompts]
    # echo with logprobs: the prompt's tokens are scored too (lm-eval's loglikelihood requests)
    prompt_logprobs = body.logprobs if body.echo else None
    sampling = [
        _sampling(body, m, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
        for m in max_tokens
    ]
    echo = await _echo_texts(serving, body.prompt, prompts) if body.echo else None
    return await _respond(
        request,
        serving,
        body,
        "cmpl",
        prompts,
        sampling,
        arrived_ns,
        CompletionWriter,
        serving.model_name,
        echo=echo,
        lora=adapter,
    )


async def _chat_complete(
    request: Request, serving: ServingEngine, added_ids: frozenset[int]
) -> Response:
    arrived_ns = arrival_ns(request.scope)
    body = await read_request(request, ChatCompletionRequest)
    adapter = _check_common(body, serving)
    try:
        tools = ToolUse.of(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise APIError(str(exc), field, "invalid_value") from None
    prompt = await _chat_prompt(serving, body, tools)
    _check_not_empty(prompt, added_ids, "messages")
    requested, name = (
        (body.max_tokens, "max_tokens")
        if body.max_completion_tokens is None
        else (body.max_completion_tokens, "max_completion_tokens")
    )
    max_tokens = serving.check_prompt(prompt, requested, "messages", name)
    # logprobs: true alone reports the sampled tokens' (top_logprobs 0), as OpenAI does
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constraint = None if tools is None else tools.constraint()
    sampling = [_sampling(body, max_tokens, name, logprobs, constraint=constraint)]
    return await _respond(
        request,
        serving,
        body,
        "chatcmpl",
        [prompt],
        sampling,
        arrived_ns,
        ChatWriter,
        serving.model_name,
        lora=adapter,
        tools=tools,
    )


async def _chat_prompt(
    serving: ServingEngine, body: ChatCompletionRequest, tools: ToolUse | None
) -> list[int]:
    """The conversation's token ids, its tools shown as engines/tool_calls.py's `tool_prompt`
    says."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.text(i)}
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    tokenizer = serving.engine.tokenizer
    messages, template_tools = tool_prompt(messages, tools, tokenizer.renders_tools)
    try:
        return await serving.in_tokenizer_pool(
            tokenizer.encode_chat, messages, True, template_tools
        )
    except ValueError as exc:
        raise APIError(f"messages: {exc}", "messages", "invalid_value") from None


def _profiler(serving: ServingEngine, request: Request) -> EngineProfiler:
    if serving.profiler is None:
        raise profiler_not_enabled()
    refuse_cross_origin(request.headers.get("origin"), request.headers.get("host"))
    serving.check_serving()  # the engine thread must be there to run the profiler's commands
    return serving.profiler


# ---- request checks ---------------------------------------------------------------------------


def _check_common(body: _SamplingFields, serving: ServingEngine) -> str | None:
    """The checks every generation request gets; the LoRA adapter its `model` names (None:
    the base model)."""
    adapters = serving.adapter_names()
    check_model(body.model, serving.model_name, adapters)
    unsupported = body.unsupported()
    if unsupported is not None:
        allowed = NEUTRAL_VALUES.get(unsupported, "null (leave it unset)")
        raise APIError(
            f"{unsupported}: unsupported by the built-in engine (value "
            f"{getattr(body, unsupported)!r}); allowed: {allowed}",
            unsupported,
            "unsupported_parameter",
        )
    refused = body.refused_combination()
    if refused is not None:
        raise refused
    if body.stream_options is not None and not body.stream:
        raise APIError(
            "stream_options: only allowed when stream is true", "stream_options", "invalid_value"
        )
    # Sample i of n seeds its generator with seed + i (inside an engine step, where an
    # overflow would fail every request in the batch), so the last one must fit too.
    last_sample = max(body.n or 1, body.samples_drawn() or 1, 1) - 1
    if body.seed is not None and not -(2**63) <= body.seed <= 2**64 - 1 - last_sample:
        raise APIError(
            f"seed: {body.seed} is out of range; allowed: an integer in "
            f"[-2**63, 2**64 - {last_sample + 1}] (sample i of {last_sample + 1} uses seed + i)",
            "seed",
            "invalid_value",
        )
    return body.model if body.model in adapters else None


async def _completion_prompts(
    serving: ServingEngine, prompt: Any, added_ids: frozenset[int]
) -> list[list[int]]:
    if not isinstance(prompt, str) and isinstance(prompt[0], int):  # validated: all ids
        return [list(prompt)]
    prompts = []
    for i, p in enumerate([prompt] if isinstance(prompt, str) else prompt):
        if isinstance(p, str):
            ids = await serving.tokenize(p)
            _check_not_empty(
                ids, added_ids, "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
            )
            prompts.append(ids)
        else:
            prompts.append(list(p))
    return prompts


async def _echo_texts(serving: ServingEngine, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """The text echo writes before each prompt's choices: a text prompt as sent, a token-id
    prompt decoded (without special tokens, as its output is)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    decode = serving.engine.tokenizer.decode
    return [await serving.in_tokenizer_pool(decode, ids) for ids in prompts]


def _check_not_empty(token_ids: list[int], added_ids: frozenset[int], where: str) -> None:
    """A text or chat prompt that tokenizes to nothing but what the tokenizer adds to any text
    (its BOS) is empty: the engine would generate from BOS alone. A token-id prompt is taken
    as given."""
    if all(t in added_ids for t in token_ids):
        raise APIError(
            f"{where}: the prompt is empty (it has no tokens besides the "
            f"{sorted(added_ids)} the tokenizer adds to any text)",
            where.split("[", 1)[0],
            "invalid_value",
        )


def _structured_source(body: _SamplingFields) -> str | None:
    """The field a request's constraint came from (None: none, or none valid)."""
    try:
        return body.structured()[1]
    except ValueError:
        return None


def _width_field(sampling: SamplingParams) -> str:
    """The field that set how many sequences each prompt runs."""
    if sampling.use_beam_search:
        return "n" if sampling.beam_width is None else "beam_width"
    return "best_of" if sampling.ranks_samples else "n"


def _sampling(
    body: _SamplingFields,
    max_tokens: int,
    max_tokens_param: str = "max_tokens",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """`constraint`: the tool choice's grammar, which no other structured field may join."""
    try:
        structured, source = body.structured()
        if constraint is not None and structured is not None:
            raise ValueError(
                f"{source}: tool_choice already constrains the output (a named function or "
                "required); allowed: one of them"
            )
        structured = structured or constraint
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
            best_of=body.samples_drawn(),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias=body.token_biases(),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            structured_outputs=structured,
            use_beam_search=body.use_beam_search,
            beam_width=body.searched_width(),
            length_penalty=body.length_penalty,
            early_stopping=body.early_stopping,
        )
    except ValueError as exc:
        # "SamplingParams.top_p: 2.0 is invalid; allowed: ..." -> param "top_p"
        message = str(exc).removeprefix("SamplingParams.")
        param = message.split(":", 1)[0]
        if param == "max_tokens":  # the name the client used (chat: max_completion_tokens)
            param = max_tokens_param
            message = max_tokens_param + message.removeprefix("max_tokens")
        source = _structured_source(body)
        if param.startswith("structured_outputs") and source not in (None, "structured_outputs"):
            param = str(source)  # the constraint as the client sent it (guided_choice, ...)
            message = param + message.removeprefix("structured_outputs")
        raise APIError(message, param, "invalid_value") from None


# ---- responses --------------------------------------------------------------------------------


async def _respond(
    request: Request,
    serving: ServingEngine,
    body: _SamplingFields,
    prefix: str,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    arrival_ns: int,
    writer_type: type[Writer],
    model_name: str,
    echo: list[str] | None = None,
    lora: str | None = None,
    **writer_options: Any,
) -> Response:
    n = sampling[0].n
    try:
        # in the tokenizer pool: compiling a grammar can take seconds, never the event loop's
        await serving.in_tokenizer_pool(serving.check_engine_accepts, prompts, sampling)
    except APIError as exc:
        source = _structured_source(body)
        tools = writer_options.get("tools")
        if source is None and tools is not None and tools.constraint() is not None:
            source = tools.constraint_field
        if source is None or source == "structured_outputs":
            raise
        if not (exc.param or "").startswith("structured_outputs"):
            raise
        # a constraint the grammar backend cannot compile: named as the client sent it
        raise APIError(
            source + exc.message.removeprefix(exc.param or ""), source, exc.code
        ) from None
    admission = serving.admit(
        len(prompts) * sampling[0].num_sequences, _width_field(sampling[0]), lora
    )
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    writer = writer_type(
        request_id,
        int(time.time()),
        lora or model_name,  # an adapter's answers name it, as vLLM's do
        prompts,
        n,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        return_token_ids=body.return_token_ids,
        continuous_usage=bool(
            body.stream_options
            and body.stream_options.include_usage
            and body.stream_options.continuous_usage_stats
        ),
        token_texts=None if sampling[0].logprobs is None else serving.token_texts,
        echo=echo,
        **writer_options,
    )
    pieces = serving.generate(request_id, prompts, sampling, arrival_ns, admission, lora)
    if body.stream:
        return EventStreamResponse(event_stream(pieces, writer), on_close=admission.release)
    try:
        choices = await unless_disconnected(request.receive, collect(pieces, writer))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the request was aborted
    finally:
        await pieces.aclose()
        admission.release()
    return JSONResponse(writer.response(choices))
