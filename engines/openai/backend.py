"""`engine=openai`: drive any OpenAI-compatible server with the harness's workloads and metrics.

Each request is one streaming POST to `/completions` or `/chat/completions` over one pooled
`httpx.AsyncClient`. Every network read is timestamped on arrival with `clock` (the harness's
`engines.base.now_ns` unless a test injects a scripted one); the events it completes carry that
time: `Tokens` per content chunk, then `Tokenized` (prompt length) and `Finished` when the
stream ends. An HTTP error, a timeout, an error event, a dropped connection or a stream that
ends before the server gave every choice a finish reason fails that request alone (`Failed`,
with the status and body or what was missing), never the run: a cut stream is never a success.

Token ids per chunk come from the server when it sends them (vLLM, SGLang with
`return_token_ids`). Otherwise, when the server reports a usage count, the first counting rule
whose total agrees with it decides how many tokens each chunk held (`RULES`: one per content
chunk, exact for servers that stream one chunk per token, or the tokenizer over the chunk's
text); without usage, the tokenizer, else one token per non-empty chunk. Ids the client
cannot know are -1. `describe()["client"]` says which rule each request used. Prompt and
output lengths in `Finished` come from the usage chunk when there is one, else from counting.

A request that asks for its prompt's log-probabilities (SamplingParams.prompt_logprobs = k) is
sent as lm-eval's `local-completions` sends its loglikelihood requests: `/completions` with
`echo: true` and `logprobs: k`. The prompt's part of the legacy `logprobs` object that comes
back (`token_logprobs`, None first; `tokens`; `top_logprobs`) becomes the `PromptLogprobs` event
the built-in engine emits, at the arrival of the chunk that held it; the echoed prompt text is
taken off the choice's text. The legacy layout names tokens by their text, so the event's ids
are the prompt's as sent (or as the server returned them, vLLM's `prompt_token_ids`; else -1),
the top-k ids are -1, and a rank is known only where the top-k list decides it (else 0). A
server that answers without the prompt's log-probabilities fails the request, naming echo; chat
(`engine.api=chat`) has no echo and refuses such a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from engines.base import (
    Arrived,
    Backend,
    BackendCapabilities,
    Failed,
    Finished,
    GenerationRequest,
    PromptLogprobs,
    RequestEvent,
    Tokenized,
    TokenLogprob,
    Tokens,
    is_chat,
    now_ns,
)
from engines.openai.chunks import ChoiceDelta, Chunk, decode_event, decode_response
from engines.openai.config import OpenAIConfig
from engines.openai.dialects import (
    DIALECTS,
    FAMILIES,
    SIGNATURES,
    choose_dialect,
    normalize_finish_reason,
)
from engines.openai.launched import SERVER_LOG, LaunchedServer, template_fields
from engines.openai.server_metrics import (
    SpecDecodeCounters,
    get_page,
    metrics_url,
    parse_spec_decode,
)
from engines.openai.sse import SSEParser
from engines.openai.stats import ClientStats, RequestTally
from engines.tool_calls import ToolCallOutput
from models.tokenizer import Tokenizer, default_tokenizer, load_tokenizer

UNKNOWN_TOKEN_ID = -1  # a chunk counted as one token whose id the client cannot know
NO_STEP = -1  # HTTP has no engine steps
# Counting rules tried against the server's usage count when it sends no ids, in order:
# chunk: one per content chunk (text field present, even empty: a token whose text is held back
# or skipped), not the role-only opening delta nor an empty closing chunk; chunk_with_final: the
# same plus that empty closing chunk (TGI sends its EOS token so); tokenizer: the chunk's text
# re-tokenized; nonempty_chunk: one per chunk with text. A per-token rule that adds up to the
# server's count first: it keeps every token at the time its own chunk arrived.
RULES = ("chunk", "chunk_with_final", "tokenizer", "nonempty_chunk")
log = logging.getLogger(__name__)


class OpenAIBackend(Backend):
    name = "openai"
    capabilities = BackendCapabilities(in_process=False)

    def __init__(
        self,
        config: OpenAIConfig,
        model: dict[str, Any] | None = None,
        clock: Callable[[], int] = now_ns,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__()
        self.config = config  # checked when it was built
        self.model_group = dict(model or {})
        self.clock = clock
        # `auto` is settled by load()'s server check; until then, OpenAI's own fields only
        self.dialect = DIALECTS[choose_dialect(config.server, None)]
        self.tokenizer: Tokenizer | None = None
        self.stats = ClientStats()
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._server_info: dict[str, Any] = {}
        self._spec_at_start: SpecDecodeCounters | None = None
        self._measuring = False
        self.launched: LaunchedServer | None = None  # the server it started (engine.launch)
        self._launched_info: dict[str, Any] | None = None  # its description, once released

    @classmethod
    def from_config(cls, options: dict[str, Any], model: dict[str, Any]) -> OpenAIBackend:
        return cls(OpenAIConfig.from_config(options, model), model)

    # ---- lifecycle ----------------------------------------------------------------------------

    def load(self) -> None:
        for name in ("httpx", "httpcore"):  # one INFO line per request would flood run logs
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.WARNING)
        if self.config.launch.enabled:
            self._launch()
        self.tokenizer = resolve_tokenizer(self.config.tokenizer, self.model_group)
        if self.config.check_server:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                self._server_info = asyncio.run(self._probe())
            else:
                raise RuntimeError(
                    "OpenAIBackend.load() runs its server check with "
                    "asyncio.run: call it outside a running event loop"
                )
        self._choose_dialect()

    def _launch(self) -> None:
        """Start the server under test (or take over the previous run's) and aim at it."""
        log = self.files_dir / SERVER_LOG if self.files_dir is not None else None
        fields = template_fields(self.config.model, self.model_group)
        self.launched = LaunchedServer.start(self.config.launch, fields, log)
        self.config = replace(self.config, base_url=self.launched.base_url)

    def _choose_dialect(self) -> None:
        requested = self.config.server
        detected = self._server_info.get("detected")
        self.dialect = DIALECTS[choose_dialect(requested, detected)]
        evidence = self._server_info.get("evidence")
        if self.dialect.name != requested:
            log.info(
                "engine.server=%s: using the %s dialect (%s)",
                requested,
                self.dialect.name,
                evidence or "no server answered as a known one",
            )
        elif detected is not None and detected != requested:
            log.warning(
                "engine.server=%s, but the server at %s answers as %s (%s); its "
                "requests may be refused or come back short. Set engine.server=%s, "
                "or engine.server=auto",
                requested,
                self.config.base_url,
                detected,
                evidence,
                detected,
            )

    def start_measuring(self) -> None:
        self._spec_at_start = self._read_spec_decode()
        self._measuring = True

    def _metrics_url(self) -> str | None:
        url = self.config.metrics_url
        if url == "auto":
            return metrics_url(self.config.base_url)
        return None if url == "none" else url

    def _read_spec_decode(self) -> SpecDecodeCounters | None:
        """The server's speculative-decoding counters now; None where its /metrics has none
        or cannot be read (a server without the page is not an error)."""
        url = self._metrics_url()
        if url is None:
            return None
        try:
            with httpx.Client() as client:
                text = get_page(client, url, min(self.config.timeout_s, 10.0))
            return parse_spec_decode(text)
        except (httpx.HTTPError, ValueError) as error:  # ValueError: not Prometheus text
            log.info("engine.metrics_url=%s: no speculative-decoding counters (%s)", url, error)
            return None

    def served_adapters(self) -> None:
        return None  # the server names its own (an unknown `model` is its 400)

    def failure(self) -> str | None:
        return self.launched.failure() if self.launched is not None else None

    def client_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Client processes (run.num_clients) reach the server this backend started."""
        if self.launched is None:
            return options
        return {
            **options,
            "base_url": self.config.base_url,
            "launch": {**(options.get("launch") or {}), "command": []},
        }

    def close(self) -> None:
        # The pool belongs to the event loop that made it (the driver runs one loop per
        # workload); that loop is gone by now, so its sockets close with it.
        self._client, self._client_loop = None, None
        launched, self.launched = self.launched, None
        if launched is not None:
            self._launched_info = launched.describe()
            launched.release()

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        max_model_len = cfg.max_model_len or self._server_info.get("max_model_len")
        ids_asked = cfg.request_token_ids and bool(self.dialect.token_id_fields)
        fallback = (
            "the tokenizer over each chunk's text"
            if self.tokenizer is not None
            else "one token per non-empty chunk (no tokenizer)"
        )
        counting = (
            "server token ids; else " if ids_asked else ""
        ) + f"the rule that matches the usage count; else {fallback}"
        return {
            "backend": self.name,
            "base_url": cfg.base_url,
            "served_model": cfg.model,
            "api": cfg.api,
            "server": self.dialect.name,  # the dialect every request was sent in
            "server_requested": cfg.server,
            # what the server said it is at load (None: not asked, or not a known server)
            "server_detected": self._server_info.get("detected"),
            "server_detection": self._server_info.get("evidence")
            or (
                "not asked (engine.check_server=false)"
                if not cfg.check_server
                else "no known signature (servers.SIGNATURES)"
            ),
            "max_model_len": max_model_len,
            "exact_output_length": self.dialect.forces_length,
            "token_counting": counting,
            "tokenizer": self.tokenizer.name if self.tokenizer is not None else None,
            "include_usage": cfg.include_usage,
            "timeout_s": cfg.timeout_s,
            "max_connections": cfg.max_connections,
            "server_models": self._server_info.get("models"),
            # updated in place as requests end, so the summary written after the run has
            # the whole run's figures (warm-up excluded)
            "client": self.stats.live,
            "metrics_url": self._metrics_url(),
            "server_spec_decode": self._spec_decode_during_run(),
            # the server the run started (engine.launch), else None
            "launched_server": self.launched.describe()
            if self.launched is not None
            else self._launched_info,
        }

    def _spec_decode_during_run(self) -> dict[str, Any] | None:
        """The server's speculative-decoding counts over the measured requests; None before
        they start, where either read found no counters (a failed first read must not pass
        the server's lifetime totals off as the run's), or where a counter went down."""
        before = self._spec_at_start
        if not self._measuring or before is None:
            return None
        now = self._read_spec_decode()
        run = None if now is None else now.since(before)
        if now is not None and run is None:
            log.warning(
                "engine.metrics_url=%s: the server's speculative-decoding counters went down "
                "during the run (a restart?); its counts are left out",
                self._metrics_url(),
            )
        return None if run is None else run.to_dict()

    # ---- one request --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        rid, clock = request.request_id, self.clock
        sampling = request.sampling
        tally = RequestTally(
            rid,
            sampling.max_tokens,
            sampling.ignore_eos,
            dropped_fields=tuple(self.dialect.refused(sampling)),
        )
        build_start = time.perf_counter_ns()
        try:
            path, body = self._request_body(request)
        except (ValueError, TypeError) as exc:
            self.stats.finish(tally, failed=True)
            yield Failed(rid, NO_STEP, clock(), f"request not sent: {exc}")
            return
        tally.build_ns = time.perf_counter_ns() - build_start
        state = _StreamState(
            request,
            body.get("messages", body.get("prompt")),
            self.tokenizer,
            tally,
            self.dialect.count_rule,
        )
        if sampling.prompt_logprobs is not None:
            state.echo = _Echo(
                body["prompt"], self.tokenizer, sampling.prompt_logprobs, url_of=path
            )
        state.sent_ns = clock()
        yield Arrived(rid, NO_STEP, state.sent_ns)
        url = f"{self.config.base_url}{path}"
        closed_early = False  # the consumer closed the stream (a cancelled request)
        try:
            async with self._http().stream("POST", url, json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode("utf-8", errors="replace")
                    for event in state.fail(
                        clock(), f"HTTP {response.status_code} from POST {url}: {text[:2000]}"
                    ):
                        yield event
                    return
                if response.headers.get("content-type", "").startswith("application/json"):
                    # the server ignored `stream: true` and sent the whole answer at once
                    body_bytes = await response.aread()
                    arrived = clock()
                    start = time.perf_counter_ns()
                    events = state.feed([decode_response(body_bytes)], arrived)
                    if not state.ended:
                        events += state.end_of_stream(arrived, "response (not streamed)")
                    tally.overhead_ns.append(time.perf_counter_ns() - start)
                    for event in events:
                        yield event
                    return
                parser = SSEParser()
                async for data in response.aiter_bytes():
                    arrived = clock()
                    start = time.perf_counter_ns()
                    events = state.feed([decode_event(e) for e in parser.feed(data)], arrived)
                    tally.overhead_ns.append(time.perf_counter_ns() - start)
                    for event in events:
                        yield event
                    if state.ended:
                        break
                if not state.ended:  # the server closed the stream without [DONE]
                    closed = clock()
                    for event in state.feed([decode_event(e) for e in parser.close()], closed):
                        yield event
                    if not state.ended:
                        for event in state.end_of_stream(closed):
                            yield event
        except httpx.TimeoutException as exc:
            for event in state.fail(
                clock(),
                f"timeout (engine.timeout_s={self.config.timeout_s})"
                f" on POST {url}: {type(exc).__name__} {exc}",
            ):
                yield event
        except httpx.HTTPError as exc:
            for event in state.fail(
                clock(), f"HTTP error on POST {url}: {type(exc).__name__}: {exc}"
            ):
                yield event
        except asyncio.CancelledError:
            # the consumer cancelled the request (the driver's cancellation): leaving the
            # `async with` closed the response, and with it the connection, which a server
            # takes as the client gone. The tokens that came so far go to the consumer first,
            # at their own arrival times, then the cancellation goes on.
            closed_early = not state.ended
            if closed_early:
                for event in state.cut():
                    yield event
            raise
        except GeneratorExit:  # the consumer closed the stream early (no events go anywhere)
            closed_early = not state.ended
            raise
        finally:
            self.stats.finish(tally, failed=state.failed or not state.ended, closed=closed_early)

    def _request_body(self, request: GenerationRequest) -> tuple[str, dict[str, Any]]:
        cfg = self.config
        # a LoRA adapter is asked for by its name in `model`, as vLLM's multi-LoRA server takes it
        body: dict[str, Any] = {"model": request.lora or cfg.model, "stream": True}
        if cfg.api == "chat":
            path = "/chat/completions"
            body["messages"] = self._messages(request.prompt)
        else:
            path = "/completions"
            body["prompt"] = self._completion_prompt(request.prompt)
        body.update(self.dialect.sampling_fields(request.sampling))
        if request.tools is not None:
            if cfg.api != "chat":
                raise ValueError(
                    "tools: engine.api=completions cannot offer the model tools; allowed: "
                    "engine.api=chat"
                )
            body.update(request.tools.request_fields())
        sampling = request.sampling
        constraint = sampling.structured_outputs
        if constraint is not None and constraint.kind not in self.dialect.structured_kinds:
            raise ValueError(
                f"SamplingParams.structured_outputs.{constraint.kind}: the {self.dialect.name} "
                f"dialect cannot ask its server for it; allowed: "
                f"{', '.join(self.dialect.structured_kinds)} (engine.server=vllm sends every kind)"
            )
        if sampling.logprobs is not None:
            raise ValueError(
                "SamplingParams.logprobs: engine=openai does not read the generated tokens' "
                "log-probabilities; allowed: null (prompt_logprobs is read, through echo)"
            )
        if sampling.prompt_logprobs is not None:
            if cfg.api == "chat":
                raise ValueError(
                    "SamplingParams.prompt_logprobs: engine.api=chat cannot return the "
                    "prompt's log-probabilities (chat completions have no echo); allowed: "
                    "engine.api=completions"
                )
            # lm-eval's local-completions loglikelihood request: the prompt echoed, scored
            body["echo"] = True
            body["logprobs"] = max(sampling.prompt_logprobs, sampling.logprobs or 0)
        if cfg.include_usage:
            body["stream_options"] = {"include_usage": True}
        if cfg.request_token_ids:
            body.update(self.dialect.token_id_fields)
        body.update(cfg.extra_body)
        return path, body

    def _completion_prompt(self, prompt: Any) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if is_chat(prompt):
            tok = self._need_tokenizer(
                "chat messages with engine.api=completions (the chat "
                "template is applied client-side; or use api=chat)"
            )
            if self.dialect.token_prompts:
                return tok.encode_chat(prompt)
            return tok.apply_chat_template(prompt)
        if self.dialect.token_prompts:
            return [int(t) for t in prompt]
        tok = self._need_tokenizer(
            f"a token-id prompt with engine.server={self.dialect.name} (it takes text prompts only)"
        )
        return tok.decode(prompt, skip_special_tokens=False)

    def _messages(self, prompt: Any) -> list[dict[str, str]]:
        if is_chat(prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        tok = self._need_tokenizer("a token-id prompt with engine.api=chat (decoded to text)")
        return [{"role": "user", "content": tok.decode(prompt, skip_special_tokens=False)}]

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs a tokenizer; set engine.tokenizer to a "
                "tokenizer.json file or folder (it is none now)"
            )
        return self.tokenizer

    # ---- HTTP ---------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        """The pooled client of the running event loop (a pool cannot outlive its loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client, self._client_loop = self._new_client(), loop
        return self._client

    def _new_client(self) -> httpx.AsyncClient:
        cfg = self.config
        limits = httpx.Limits(
            max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections
        )
        transport = self._transport or httpx.AsyncHTTPTransport(limits=limits)
        headers = {"Accept": "text/event-stream"}
        key = cfg.api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # pool=None: a request waiting for a free connection queues in the client (counted in
        # its TTFT) instead of failing; timeout_s bounds connecting and every silence.
        timeout = httpx.Timeout(cfg.timeout_s, pool=None)
        return httpx.AsyncClient(transport=transport, headers=headers, timeout=timeout)

    async def _probe(self) -> dict[str, Any]:
        """GET /models: the server answers, serves the model, and (vLLM, SGLang) its context;
        then which server it is (`servers.SIGNATURES`)."""
        cfg = self.config
        url = f"{cfg.base_url}/models"
        async with self._new_client() as client:
            try:
                response = await client.get(url, timeout=min(cfg.timeout_s, 30.0))
            except httpx.HTTPError as exc:
                raise ConnectionError(
                    f"engine.base_url: cannot reach GET {url}: {type(exc).__name__}: {exc}"
                ) from exc
            if response.status_code >= 400 and response.status_code != 404:
                raise ConnectionError(
                    f"engine.base_url: GET {url} answered HTTP "
                    f"{response.status_code}: {response.text[:500]}"
                )
            cards: list[dict[str, Any]] | None = None
            if response.status_code != 404:  # not every server lists its models
                try:
                    listed = response.json().get("data") or []
                    cards = [c for c in listed if isinstance(c, dict)]
                except (ValueError, AttributeError, TypeError):
                    cards = None
            info: dict[str, Any] = {"models": None}
            if cards is not None:
                models = [c.get("id") for c in cards]
                if models and cfg.model not in models:
                    raise ValueError(
                        f"engine.model: {cfg.model!r} is not served at "
                        f"{cfg.base_url}; it serves: {models}"
                    )
                card = next((c for c in cards if c.get("id") == cfg.model), {})
                length = card.get("max_model_len")
                info = {
                    "models": models,
                    "max_model_len": length if isinstance(length, int) else None,
                }
            # pages beyond /models are asked for only where the answer picks the dialect
            deep = cfg.server == "auto" or cfg.server in FAMILIES
            detected = await self._detect(client, cards or [], deep)
        if detected is not None:
            info["detected"], info["evidence"] = detected
        return info

    async def _detect(
        self, client: httpx.AsyncClient, cards: list[dict[str, Any]], deep: bool
    ) -> tuple[str, str] | None:
        """The first of `SIGNATURES` the server matches: (dialect, what it answered)."""
        root = self.config.base_url.removesuffix("/v1")
        pages: dict[str, Any] = {}
        for sig in SIGNATURES:
            if sig.where == "models":
                if any(_field(card, sig.field) == sig.value for card in cards):
                    return sig.server, (
                        f"GET {self.config.base_url}/models: {sig.field}={sig.value!r}"
                    )
                continue
            if not deep:
                continue
            if sig.where not in pages:
                pages[sig.where] = await _get_json(
                    client, root + sig.where, min(self.config.timeout_s, 10.0)
                )
            if _field(pages[sig.where], sig.field) == sig.value:
                return sig.server, f"GET {root}{sig.where}: {sig.field}={sig.value!r}"
        return None


async def _get_json(client: httpx.AsyncClient, url: str, timeout: float) -> Any:
    """A page's JSON, or None for anything else (an error status, not JSON, no answer)."""
    try:
        response = await client.get(url, timeout=timeout)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _merge_call(calls: dict[int, dict[str, Any]], position: int, fragment: dict[str, Any]) -> None:
    """One `tool_calls` fragment into the choice's calls: the id and name where it has them,
    its piece of the arguments appended."""
    index = fragment.get("index")
    key = index if isinstance(index, int) else position
    call = calls.setdefault(
        key, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if isinstance(fragment.get("id"), str):
        call["id"] = fragment["id"]
    function = fragment.get("function")
    if isinstance(function, dict):
        if isinstance(function.get("name"), str) and function["name"]:
            call["function"]["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            call["function"]["arguments"] += arguments
        elif isinstance(arguments, dict):  # a server that sends the object itself
            call["function"]["arguments"] += json.dumps(arguments)


def _field(data: Any, path: str) -> Any:
    """`data["a"]["b"]` for path "a.b"; None where any step is missing."""
    for key in path.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


class _StreamState:
    """One request's stream: decoded chunks in, events out, per choice index.

    Content chunks are kept until the stream ends, each with its arrival time, because how many
    tokens a chunk holds may only be known then: when the server sends ids they are used; when
    it sends a usage count, the first counting rule that agrees with it is used (`RULES`);
    otherwise the dialect's rule for a server known to stream one chunk per token, else the
    tokenizer, else one token per non-empty chunk. The events carry the chunks' own arrival
    times, so holding them back changes no timestamp.

    A request succeeds only when the server said how every choice finished (`finish_reason`);
    `[DONE]` or a closed connection before that is a failure that says how many tokens came.
    """

    def __init__(
        self,
        request: GenerationRequest,
        sent_prompt: Any,
        tokenizer: Tokenizer | None,
        tally: RequestTally,
        count_rule: str | None = None,
    ) -> None:
        self.request = request
        self.sent_prompt = sent_prompt  # as sent: text, token ids or chat messages
        self.tokenizer = tokenizer
        self.tally = tally
        self.count_rule = count_rule
        n = request.sampling.n
        self.pieces: list[tuple[int, ChoiceDelta]] = []  # (arrival ns, content chunk)
        self.counts = [0] * n
        self.texts = [""] * n
        self.finish_reasons: list[str | None] = [None] * n
        # per choice: tool-call index -> the call, merged from its fragments
        self.tool_calls: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]
        self.usage: dict[str, Any] | None = None
        self.sent_ns = 0
        self.ended = False
        self.failed = False
        self.echo: _Echo | None = None  # set where the request asks for prompt logprobs

    def feed(self, chunks: list[Chunk], arrived: int) -> list[RequestEvent]:
        for chunk in chunks:
            if self.ended:
                break
            if chunk.error is not None:
                return self.fail(arrived, f"server error in stream: {chunk.error}")
            for delta in chunk.choices:
                if not 0 <= delta.index < len(self.texts):
                    continue
                if self.echo is not None:
                    delta = self.echo.take(delta, arrived)
                self.pieces.append((arrived, delta))
                self.texts[delta.index] += delta.text
                for position, fragment in enumerate(delta.tool_calls):
                    _merge_call(self.tool_calls[delta.index], position, fragment)
                if delta.finish_reason is not None:
                    self.finish_reasons[delta.index] = delta.finish_reason
            if chunk.usage is not None:
                self.usage = chunk.usage
            if chunk.done:
                if None in self.finish_reasons:  # e.g. llama-cpp-python cut it for another
                    return self._unfinished(arrived, "stream ended")
                return self._finish(arrived)
        return []

    def end_of_stream(
        self, closed: int, how: str = "stream closed (no [DONE])"
    ) -> list[RequestEvent]:
        """The answer ended without [DONE]: fine if every choice said it finished."""
        if None not in self.finish_reasons:
            return self._finish(closed)
        return self._unfinished(closed, how)

    def fail(self, at: int, error: str) -> list[RequestEvent]:
        """The tokens that did arrive (at their own times), then `Failed`."""
        self.ended = self.failed = True
        events = self._tokens(self._rule())
        events.append(Failed(self.request.request_id, NO_STEP, at, error))
        return events

    def cut(self) -> list[RequestEvent]:
        """The client closed the stream: the tokens that did arrive, and no ending (the
        consumer records why it closed it)."""
        self.ended = True
        return self._tokens(self._rule())

    def _unfinished(self, at: int, how: str) -> list[RequestEvent]:
        """The stream ended before the server said how some choice finished: a failure."""
        self.ended = self.failed = True
        events = self._tokens(self._rule())
        missing = [i for i, r in enumerate(self.finish_reasons) if r is None]
        which = (
            f" (choice(s) {missing} of {len(self.finish_reasons)})"
            if len(self.finish_reasons) > 1
            else ""
        )
        events.append(
            Failed(
                self.request.request_id,
                NO_STEP,
                at,
                f"{how} without a finish_reason after {sum(self.counts)} tokens{which}",
            )
        )
        return events

    # ---- counting -----------------------------------------------------------------------------

    def _default_rule(self) -> str:
        if any(d.token_ids is not None for _, d in self.pieces):
            return "server"
        if self.count_rule is not None:
            return self.count_rule
        return "tokenizer" if self.tokenizer is not None else "nonempty_chunk"

    def _rule(self) -> str:
        """Server ids; else the first rule whose total equals the usage count; else default."""
        default = self._default_rule()
        usage = (self.usage or {}).get("completion_tokens")
        if default == "server" or not isinstance(usage, int):
            return default
        for rule in RULES:
            if rule == "tokenizer" and self.tokenizer is None:
                continue
            if sum(len(self._ids(d, rule)) for _, d in self.pieces) == usage:
                return rule
        return default

    def _ids(self, delta: ChoiceDelta, rule: str) -> tuple[int, ...]:
        if rule == "server":
            if delta.token_ids is not None:
                return delta.token_ids
            rule = "tokenizer" if self.tokenizer is not None else "nonempty_chunk"
        # tool-call fragments are tokens the model wrote, as content is
        written = delta.text + delta.tool_text
        if rule == "tokenizer":
            assert self.tokenizer is not None
            return (
                tuple(self.tokenizer.encode(written, add_special_tokens=False)) if written else ()
            )
        writes = (delta.has_text or bool(delta.tool_calls)) and not delta.role_only
        if rule == "nonempty_chunk":
            counted = bool(written)
        elif rule == "chunk":  # per-token streams that close with a separate, empty chunk
            counted = writes and not (delta.finish_reason is not None and not written)
        else:  # "chunk_with_final": per-token streams whose empty last chunk is the EOS token
            counted = writes
        return (UNKNOWN_TOKEN_ID,) if counted else ()

    def _tokens(self, rule: str) -> list[RequestEvent]:
        rid = self.request.request_id
        events: list[RequestEvent] = []
        self.counts = [0] * len(self.texts)
        for arrived, delta in self.pieces:
            ids = self._ids(delta, rule)
            if ids:
                self.counts[delta.index] += len(ids)
                self.tally.chunks_by_source[rule] += 1
                events.append(Tokens(rid, NO_STEP, arrived, ids, delta.text, delta.index))
        self.tally.counted_output_tokens = sum(self.counts)
        self.tally.count_rule = rule
        return events

    def _finish(self, at: int) -> list[RequestEvent]:
        rid = self.request.request_id
        usage = self.usage or {}
        usage_output = usage.get("completion_tokens")
        usage_prompt = usage.get("prompt_tokens")
        prompt_scores: PromptLogprobs | None = None
        if self.echo is not None:
            found = self.echo.event(rid, usage_prompt if isinstance(usage_prompt, int) else None)
            if isinstance(found, str):
                return self.fail(at, found)
            prompt_scores = found
        self.ended = True
        events = self._tokens(self._rule())
        if prompt_scores is not None:  # the prompt is scored before the first token comes
            events.insert(0, prompt_scores)
        single = len(self.counts) == 1
        self.tally.usage_output_tokens = usage_output if isinstance(usage_output, int) else None
        prompt_tokens = usage_prompt if isinstance(usage_prompt, int) else self._count_prompt()
        if prompt_tokens is not None:
            # The server tokenizes where the client cannot see: the event carries the send
            # time so that the prompt length is recorded (docs/backends.md).
            events.append(Tokenized(rid, NO_STEP, self.sent_ns, prompt_tokens))
        for index, count in enumerate(self.counts):
            output = usage_output if single and isinstance(usage_output, int) else count
            reason = self.finish_reasons[index]
            events.append(
                Finished(
                    rid,
                    NO_STEP,
                    at,
                    normalize_finish_reason(reason) if reason else "unknown",
                    prompt_tokens or 0,
                    output,
                    text=self.texts[index],
                    index=index,
                    tool_output=None
                    if self.request.tools is None
                    else ToolCallOutput(
                        self.texts[index] or None,
                        tuple(call for _, call in sorted(self.tool_calls[index].items())),
                    ),
                )
            )
        return events

    def _count_prompt(self) -> int | None:
        prompt = self.sent_prompt
        if isinstance(prompt, list) and not is_chat(prompt):
            return len(prompt)
        if self.tokenizer is None:
            return None
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt))
        return len(self.tokenizer.encode_chat(prompt))


class _Echo:
    """A request's completions `echo` with `logprobs` (SamplingParams.prompt_logprobs): the
    echoed prompt text taken off each choice's first chunk, choice 0's legacy logprobs kept in
    order, and at the end the prompt's part as a PromptLogprobs event."""

    def __init__(self, sent: Any, tokenizer: Tokenizer | None, top: int, url_of: str) -> None:
        self.sent_ids: list[int] | None = list(sent) if isinstance(sent, list) else None
        self.text: str | None = None  # the echo the server writes, where the client knows it
        if isinstance(sent, str):
            self.text = sent
        elif self.sent_ids is not None and tokenizer is not None:
            self.text = tokenizer.decode(self.sent_ids)  # a token-id prompt echoes decoded
        self.top = top
        self.path = url_of
        self.server_ids: list[int] | None = None
        # choice 0's positions in order: (logprob, top_logprobs dict, token text)
        self.entries: list[tuple[Any, Any, Any]] = []
        self.arrived: int | None = None
        self.seen: set[int] = set()  # choices whose first chunk came (echo taken off)

    def _length(self, usage_prompt: int | None = None) -> int | None:
        if self.sent_ids is not None:
            return len(self.sent_ids)
        if self.server_ids is not None:
            return len(self.server_ids)
        return usage_prompt

    def take(self, delta: ChoiceDelta, arrived: int) -> ChoiceDelta:
        """The chunk's choice as the request sees it: its echoed prompt text taken off."""
        if delta.prompt_token_ids is not None and self.server_ids is None:
            self.server_ids = list(delta.prompt_token_ids)
        logprobs = delta.logprobs or {}
        values = logprobs.get("token_logprobs")
        if delta.index == 0 and isinstance(values, list):
            tops = logprobs.get("top_logprobs") or []
            tokens = logprobs.get("tokens") or []
            for i, value in enumerate(values):
                top = tops[i] if i < len(tops) else None
                self.entries.append((value, top, tokens[i] if i < len(tokens) else None))
            if self.arrived is None:
                self.arrived = arrived
        if delta.index in self.seen:
            return delta
        self.seen.add(delta.index)
        text, cut = delta.text, 0
        offsets = logprobs.get("text_offset")
        length = self._length()
        if self.text is not None and text.startswith(self.text):
            cut = len(self.text)
        elif length is not None and isinstance(offsets, list) and len(offsets) >= length:
            # the first generated token's offset: where the echo ends
            cut = offsets[length] if len(offsets) > length else len(text)
        return replace(delta, text=text[cut:]) if cut else delta

    def event(self, request_id: str, usage_prompt: int | None) -> PromptLogprobs | str:
        """The prompt's log-probabilities, or why the answer has none."""
        length = self._length(usage_prompt)
        asked = f"POST {self.path} with echo and logprobs={self.top}"
        if length is None:
            return (
                f"{asked}: the prompt's length is unknown (a text prompt, and the server "
                "returned neither prompt_token_ids nor a usage count)"
            )
        # an echoed prompt's first token has none (null): a first value is a generated token's
        if len(self.entries) < length or self.entries[0][0] is not None:
            return (
                f"{asked}: the server returned no log-probabilities for the {length}-token "
                f"prompt ({len(self.entries)} in all, the first "
                f"{self.entries[0][0] if self.entries else None!r}, where an echoed prompt's "
                "first is null): it does not answer completions' echo with logprobs"
            )
        ids = self.sent_ids or self.server_ids or [UNKNOWN_TOKEN_ID] * length
        found: list[TokenLogprob | None] = [None]
        for position in range(1, length):
            value, top, token = self.entries[position]
            if not isinstance(value, int | float):
                return f"{asked}: prompt position {position} has no log-probability ({value!r})"
            found.append(_legacy_logprob(ids[position], float(value), top, token, self.top))
        assert self.arrived is not None  # entries came
        return PromptLogprobs(request_id, NO_STEP, self.arrived, tuple(found))


def _legacy_logprob(token_id: int, value: float, top: Any, token: Any, k: int) -> TokenLogprob:
    """One position of the legacy layout: `top` maps token texts to logprobs, the k most likely
    (vLLM and inferlab serve write the position's own token first, k + 1 entries when it is not
    among them). Top ids are unknown (-1); the rank is known where the token is among the k
    (1 + how many are more likely), else 0."""
    entries = list(top.items()) if isinstance(top, dict) else []
    if len(entries) > k:  # the position's own token first, then the k most likely
        entries = entries[1:]
    values = sorted((float(v) for _, v in entries), reverse=True)
    among = token is not None and any(text == token for text, _ in entries)
    rank = 1 + sum(v > value for v in values) if among else 0
    return TokenLogprob(token_id, value, rank, tuple((UNKNOWN_TOKEN_ID, v) for v in values[:k]))


def resolve_tokenizer(setting: str, model: dict[str, Any]) -> Tokenizer | None:
    """engine.tokenizer: none -> None; a path -> that tokenizer; auto -> the model group's
    tokenizer, its checkpoint folder's, the built-in BPE for a built-in preset, else None."""
    from models.config import PRESETS

    if setting == "none":
        return None
    if setting != "auto":
        return load_tokenizer(setting)
    if model.get("tokenizer"):
        return load_tokenizer(model["tokenizer"])
    path = model.get("path")
    if path and (Path(path) / "tokenizer.json").is_file():
        return load_tokenizer(path)
    if not path and model.get("name") in PRESETS:
        return default_tokenizer()
    return None
