"""The OpenAI wire format: request models validated at the edge, response and chunk models, and
the error body every failure is reported in.

Requests are validated strictly (no string-to-number coercion) and unknown fields are refused,
as OpenAI's API does. Fields OpenAI defines that the built-in engine cannot honour (tools,
...) are accepted only at their neutral value; anything else is a 400 whose `param` names the
field. Fields OpenAI defines that change nothing for a local server
(store, metadata, service_tier, ...) are accepted with OpenAI's types and ignored, as vLLM
ignores them. vLLM's extensions (top_k, min_tokens, ignore_eos,
stop_token_ids, ...) are accepted under vLLM's names, because benchmark clients send them.
"""

from __future__ import annotations

import codecs
import gc
import json
import re
import reprlib
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_serializer
from pydantic_core import PydanticCustomError, from_json
from starlette.types import Message, Send

from engines.sampling_params import MAX_LOGPROBS
from engines.tool_calls import ToolCall, ToolChoice, ToolDefinition, tool_choice_value
from serving.logprobs_format import ChatLogprobs, CompletionLogprobs
from serving.structured_format import StructuredFields

# ---- errors -------------------------------------------------------------------------------


class APIError(Exception):
    """A request the server refuses, reported as OpenAI does: {"error": {...}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status_code: int = 400,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str,
    *,
    close: bool = False,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """An OpenAI-style error answered straight from ASGI middleware (before any route runs).
    `close`: the connection cannot carry another request (its body was not read to the end)."""
    payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *([(b"connection", b"close")] if close else []),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class TrackedSend:
    """ASGI `send` that notes whether the response has started: middleware can answer with
    send_error only before it has."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


# ---- parsing ------------------------------------------------------------------------------

#: How deep arrays and objects may nest: pydantic_core's JSON parser (jiter) refuses deeper
#: bodies itself, before Python's recursion limit could be reached anywhere.
MAX_JSON_DEPTH = 200
Request = TypeVar("Request", bound=BaseModel)

if TYPE_CHECKING:
    from starlette.requests import Request as HTTPRequest
_SURROGATE = re.compile("[\ud800-\udfff]")
_POSITION = re.compile(r"at line (\d+) column (\d+)$")


JSON_MEDIA_TYPE = "application/json"


def check_json_content_type(content_type: str | None) -> None:
    """A JSON body must say so (`application/json`, parameters such as `; charset=utf-8`
    allowed), else 415. A web page can POST `text/plain`, a form or a typeless Blob to another
    origin without a CORS preflight; were such a body parsed, any site a user visits could
    drive a key-less server on localhost. `application/json` needs the preflight, which this
    server never grants."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return
    received = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
    raise APIError(
        f"The request has {received}; the body must be JSON, sent with "
        f"Content-Type: {JSON_MEDIA_TYPE}",
        None,
        "unsupported_media_type",
        415,
    )


async def read_request(http: HTTPRequest, model: type[Request]) -> Request:
    """An HTTP request's body as `model`: its content type checked before the body is read,
    then parse_request."""
    check_json_content_type(http.headers.get("content-type"))
    return parse_request(await http.body(), model)


def parse_request(raw: bytes, model: type[Request]) -> Request:
    """A request body parsed and validated, or an APIError (400) that says what is wrong and,
    where it can, names the field. Strict RFC 8259 JSON: UTF-8, no NaN/Infinity, no lone
    surrogates (they would reach the tokenizer as text no encoder can write)."""
    return validate_request(parse_json_object(raw), model)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an APIError (400, `invalid_json`) that says why not."""
    # RFC 8259 lets a parser ignore a UTF-8 byte order mark; some Windows clients send one
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        data = _from_json(raw)
    except ValueError as exc:
        raise _unparseable(raw, str(exc)) from None
    if not isinstance(data, dict):
        raise APIError(
            f"The request body must be a JSON object, got {type(data).__name__}",
            None,
            "invalid_json",
        )
    return data


def validate_request(data: dict[str, Any], model: type[Request]) -> Request:
    """A parsed body validated as `model`, or an APIError (400) naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise api_error_from_validation(exc) from None


def check_model(requested: str | None, served: str, adapters: Sequence[str] = ()) -> None:
    """A request's `model` must be the served name (None: the one model served) or one of
    its LoRA adapters'."""
    if requested is not None and requested != served and requested not in adapters:
        also = f" and its LoRA adapters {', '.join(adapters)}" if adapters else ""
        raise APIError(
            f"The model `{requested}` does not exist; this server serves `{served}`{also}",
            "model",
            "model_not_found",
        )


def _from_json(raw: bytes) -> Any:
    """jiter's parse with the cyclic garbage collector paused: a body of millions of small
    arrays (8 MiB of `[],`) allocates millions of containers, and the collector would walk the
    growing heap again and again (8 s instead of 0.7 s, all of it holding the GIL). A JSON tree
    has no reference cycles, so there is nothing for it to find."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return from_json(raw, allow_inf_nan=False)
    finally:
        if enabled:
            gc.enable()


def _unparseable(raw: bytes, reason: str) -> APIError:
    """Why jiter refused the body, said as precisely as the body allows (this runs only for
    refused bodies, so the second look costs a valid request nothing)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return APIError(
            f"We could not parse the JSON body of your request: it is not UTF-8 "
            f"(byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            None,
            "invalid_json",
        )
    if "surrogate" in reason or "hex escape" in reason:
        found = _surrogate_path(raw)
        if found is not None:
            path, in_key = found
            where = f"{path or 'the body'}: {'a key' if in_key else 'the value'}"
            return APIError(
                f"{where} holds a lone UTF-16 surrogate (an escape such as "
                "\\ud800 without its pair), which is not Unicode text",
                path or None,
                "invalid_value",
            )
    elif "recursion limit" in reason:
        reason += f" (arrays and objects may nest at most {MAX_JSON_DEPTH} deep)"
    else:
        offset = _offset(raw, reason)
        if offset is not None and raw.startswith((b"NaN", b"Infinity"), offset):
            reason += " (NaN and Infinity are not JSON numbers)"
    return APIError(
        f"We could not parse the JSON body of your request: {reason}", None, "invalid_json"
    )


def _offset(raw: bytes, reason: str) -> int | None:
    """The byte offset of jiter's "at line L column C" (both 1-based)."""
    match = _POSITION.search(reason)
    if match is None:
        return None
    line, column = int(match[1]), int(match[2])
    start = 0
    for _ in range(line - 1):
        start = raw.find(b"\n", start) + 1
        if start == 0:
            return None
    return start + column - 1


def _surrogate_path(raw: bytes) -> tuple[str, bool] | None:
    """Where the first lone surrogate is, and whether it is in a key: the standard library's
    parser keeps them, so it can tell which field holds one ("" for the body itself). None if
    it cannot parse the body."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:  # depth first, in document order; no recursion
        loc, value = stack.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            return _param_path(loc), False
        if isinstance(value, dict):
            for key in value:
                if _SURROGATE.search(key):
                    return _param_path(loc), True
            stack.extend(((*loc, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*loc, i), v) for i, v in reversed(list(enumerate(value))))
    return None


#: Fields of OpenAI's chat and completions requests (and their messages) that ask for a feature
#: this server does not have: refused as unsupported whatever their value, where a field OpenAI
#: does not define is unknown. (Fields OpenAI defines that change nothing for a local server,
#: such as `store` or `metadata`, are accepted and ignored instead: `_OpenAIChatHints`.)
OPENAI_FIELDS_NOT_SUPPORTED = frozenset(
    {
        "audio",
        "refusal",
        "web_search_options",
    }
)


def api_error_from_validation(exc: ValidationError) -> APIError:
    """The first pydantic error as an APIError naming the offending field."""
    error = exc.errors(include_url=False)[0]
    param = _param_path(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden" and error["loc"][-1] in OPENAI_FIELDS_NOT_SUPPORTED:
        return APIError(
            f"{param}: part of OpenAI's API that this server does not support",
            param,
            "unsupported_parameter",
        )
    if kind == "extra_forbidden":
        return APIError(
            f"Unrecognized request argument supplied: {param}", param, "unknown_parameter"
        )
    if kind == "missing":
        return APIError(f"{param}: a value is required", param, "missing_required_parameter")
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind == "value_error":  # our own validators already name the field
        return APIError(message, param, "invalid_value")
    return APIError(
        f"{param}: {message}; got {_short(error.get('input'))}",
        param,
        "invalid_type" if kind.endswith("_type") else "invalid_value",
    )


def _param_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def _short(value: Any) -> str:
    """A bounded repr: the cost and the length stay small whatever the client sent."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: OpenAI's cap on chat `top_logprobs`, and vLLM's default max_logprobs (completions' `logprobs`:
#: OpenAI caps it at 5, vLLM takes up to 20); the engine's own bound
MAX_TOP_LOGPROBS = MAX_LOGPROBS

#: What a field the engine cannot honour may be set to (its neutral value), for the 400 that
#: refuses anything else; a field not listed may only be left unset
NEUTRAL_VALUES = {
    "modalities": 'null or ["text"]',
    "prediction": "null",
    "functions": "null or []",
    # vLLM's /tokenize chat options (serving/tokenize_routes.py)
    "continue_final_message": "false",
    "chat_template": "null (the model's template is used)",
    "chat_template_kwargs": "null or {}",
}

# ---- requests -----------------------------------------------------------------------------


#: Digits a logit_bias key may have: past any vocabulary, and int() of a longer digit string
#: would cost quadratic time (Python refuses past 4300 digits anyway)
_MAX_ID_DIGITS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension (guidellm and AIPerf send it): with include_usage, every chunk carries
    # the usage so far
    continuous_usage_stats: bool = False


class _SamplingFields(StructuredFields, _Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (with the structured-output
    ones, serving/structured_format.py)."""

    model: str | None = None  # None: the one model this server serves
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token-id strings, as OpenAI sends them
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM: prompt and output token ids in the response
    # vLLM's beam search extension (docs/sampling.md, Beam search); beam_width is ours (vLLM
    # searches with n beams; best_of is the width on /v1/completions, as in vLLM 0.x)
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int | None) -> int | None:
        # the sampler turns top_k into a float; past 2**63 that overflows inside an engine
        # step and fails every request in the batch
        if value is not None and value >= 2**63:
            raise ValueError(
                f"top_k: {_short(value)} is out of range; allowed: -1 or 0 (off), "
                "or an integer in [1, 2**63)"
            )
        return value

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping_value(cls, value: Any) -> Any:
        # one message for the union (pydantic would name a branch: "early_stopping.bool")
        if isinstance(value, bool) or value == "never":
            return value
        raise ValueError(
            f'early_stopping: {_short(value)} is invalid; allowed: true, false or "never" '
            "(Hugging Face's meanings)"
        )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError(f"stop: expected a string or a list of strings, got {_short(value)}")

    def unsupported(self) -> str | None:
        """The first field set to a value the engine cannot honour, or None."""
        return None

    def searched_width(self) -> int | None:
        """The beam width asked for (None: n)."""
        return self.beam_width

    def samples_drawn(self) -> int | None:
        """best_of: samples drawn to return the n most likely (None: n)."""
        return None

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with integer keys; its keys are token-id strings ("50256") as OpenAI
        sends them."""
        if self.logit_bias is None:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            # ASCII digits only: Python's int() also takes " 5", "+5", "1_0" and other
            # scripts' digits ("٥"), which are not the id strings OpenAI's clients send
            if key.isascii() and key.isdigit() and len(key) <= _MAX_ID_DIGITS:
                biases[int(key)] = value
            else:
                raise APIError(
                    f"logit_bias: key {_short(key)} is not a token id; allowed: token-id "
                    'strings ("50256") mapped to numbers in [-100, 100]',
                    "logit_bias",
                    "invalid_value",
                )
        return biases

    def refused_combination(self) -> APIError | None:
        """A refusal for fields that are supported alone but not together, or None."""
        return None


class CompletionRequest(_SamplingFields):
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # Types are checked with map(type, ...) and all(...), loops in C: a body of millions
        # of ids or id lists costs milliseconds here, not seconds (bool is not int here).
        kinds = set(map(type, value)) if isinstance(value, list) else set()
        if isinstance(value, str):
            texts = [value]
        elif kinds == {str}:
            texts = value
        elif kinds == {int} or (
            kinds == {list} and all(value) and set(map(type, chain.from_iterable(value))) == {int}
        ):
            return value
        else:
            raise ValueError(
                "prompt: expected a string, a non-empty list of strings, a list "
                "of token ids, or a list of token-id lists"
            )
        empty = next((i for i, p in enumerate(texts) if not p), None)
        if empty is not None:  # a tokenizer would add BOS and make it look like a prompt
            where = "prompt" if isinstance(value, str) else f"prompt[{empty}]"
            raise ValueError(
                f"{where}: the prompt is empty; allowed: a prompt with at least one token"
            )
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs: {_short(value)} is out of range; allowed: null or an integer in "
                f"[0, {MAX_TOP_LOGPROBS}] (the most likely tokens per position; vLLM's "
                "max_logprobs)"
            )
        return value

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def refused_combination(self) -> APIError | None:
        widths = (self.best_of, self.beam_width)
        if self.use_beam_search and None not in widths and widths[0] != widths[1]:
            return APIError(
                f"best_of: {self.best_of} and beam_width: {self.beam_width} both set the "
                "beam width under use_beam_search; allowed: one of them, or equal values",
                "best_of",
                "invalid_value",
            )
        return super().refused_combination()

    def searched_width(self) -> int | None:
        """The beam width asked for (None: n); under use_beam_search best_of is the width, as
        in vLLM 0.x."""
        return self.beam_width if self.best_of is None or not self.use_beam_search else self.best_of

    def samples_drawn(self) -> int | None:
        """best_of: samples drawn to return the n most likely (None: n)."""
        return None if self.use_beam_search else self.best_of


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: Any = None  # str | list[ContentPart] | None, checked below with one clear error
    name: str | None = None
    # a conversation with tool calls: the assistant's calls, and a tool result's call id
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict)
            and isinstance(p.get("type"), str)
            and isinstance(p.get("text", ""), str)
            for p in value
        ):
            # other part types (images, audio) are refused later, by name
            return [ContentPart(type=p["type"], text=p.get("text")) for p in value]
        raise PydanticCustomError("invalid_type", "expected a string or a list of content parts")

    def text(self, index: int) -> str:
        """The message's text; only text content parts are supported."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None and self.tool_calls:  # an assistant turn of calls alone
            return ""
        if self.content is None:
            raise APIError(
                f"messages[{index}].content: a string is required (tool calls are not supported)",
                f"messages[{index}].content",
                "unsupported_parameter",
            )
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is None:
                raise APIError(
                    f"messages[{index}].content[{j}].text: required for a text part",
                    f"messages[{index}].content[{j}].text",
                    "missing_required_parameter",
                )
            if part.type != "text":
                raise APIError(
                    f"messages[{index}].content[{j}]: only text parts are supported, "
                    f"got type {part.type!r}",
                    f"messages[{index}].content[{j}].type",
                    "unsupported_parameter",
                )
            pieces.append(part.text)
        return "".join(pieces)


#: OpenAI's bounds on `metadata` (16 pairs, keys of at most 64 characters, values of at most 512)
METADATA_MAX_PAIRS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512


class _OpenAIChatHints(_Strict):
    """Fields of OpenAI's chat request that change nothing a local server computes: accepted
    (with OpenAI's types, so a client's mistake is still named) and ignored, as vLLM does.
    Storage, billing tiers, cache routing keys and abuse-tracking ids have no meaning here, and
    the engine has no reasoning controls (an effort or verbosity hint is not passed to the chat
    template either). `modalities` and `prediction` are accepted only where they ask for
    nothing (text output; no predicted output)."""

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI refuses what exceeds these; a client that passes here passes there too
        if value is None:
            return value
        if len(value) > METADATA_MAX_PAIRS:
            raise ValueError(
                f"metadata: {len(value)} key-value pairs; allowed: at most {METADATA_MAX_PAIRS}"
            )
        for key, item in value.items():
            if len(key) > METADATA_MAX_KEY_CHARS:
                raise ValueError(
                    f"metadata: the key {_short(key)} has {len(key)} characters; allowed: "
                    f"at most {METADATA_MAX_KEY_CHARS}"
                )
            if len(item) > METADATA_MAX_VALUE_CHARS:
                raise ValueError(
                    f"metadata.{_short(key)}: the value has {len(item)} characters; allowed: "
                    f"at most {METADATA_MAX_VALUE_CHARS}"
                )
        return value

    def unsupported_hint(self) -> str | None:
        """The first hint that asks for something this server cannot give, or None."""
        if self.modalities is not None and set(self.modalities) - {"text"}:
            return "modalities"  # audio output
        if self.prediction is not None:
            return "prediction"
        return None


class ChatCompletionRequest(_SamplingFields, _OpenAIChatHints):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_value(cls, value: Any) -> Any:
        # one message for the union (pydantic would name a branch)
        return tool_choice_value(value)

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages: at least one message is required")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs: {_short(value)} is out of range; allowed: an integer in "
                f"[0, {MAX_TOP_LOGPROBS}] (OpenAI's bounds)"
            )
        return value

    def refused_combination(self) -> APIError | None:
        # OpenAI and vLLM refuse alternatives nobody asked logprobs for; 0 asks for none
        if self.top_logprobs and not self.logprobs:
            return APIError(
                f"top_logprobs: {self.top_logprobs} needs logprobs: true; allowed without it: "
                "null or 0",
                "top_logprobs",
                "invalid_value",
            )
        return None

    def unsupported(self) -> str | None:
        hint = self.unsupported_hint()
        if hint is not None:
            return hint
        for name in ("functions", "function_call"):  # OpenAI's deprecated spelling of tools
            if getattr(self, name) not in (None, [], "none"):
                return name
        return super().unsupported()


# ---- responses ----------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # return_token_ids only (vLLM's layout); in a stream: the chunk's new ids, and the prompt's
    # ids in each choice's first chunk
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """Also each streamed chunk (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: None = None
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's layout (engines/tool_calls.py)

    @model_serializer
    def _calls_when_present(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids only


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: None = None
    usage: Usage
    prompt_token_ids: list[int] | None = None  # return_token_ids only


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its "index", as OpenAI streams

    @model_serializer
    def _present_fields_only(self) -> dict[str, Any]:
        # A delta carries only what changed; the final chunk's delta is {}.
        fields = (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
        return {k: v for k, v in fields if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids only: this chunk's new ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids only, in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inferlab"
    max_model_len: int  # vLLM's extension: clients size requests with it
    # vLLM's, for a LoRA adapter: its folder and the base model it runs on (null otherwise)
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
