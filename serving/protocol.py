"""The OpenAI wire format: request models validated at the edge, response and chunk models, and
the error body every failure is reported in.

Requests are validated strictly (no string-to-number coercion) and unknown fields are refused,
as OpenAI's API does. Fields OpenAI defines that the built-in engine cannot honour (penalties,
logprobs, echo, tools, ...) are accepted only at their neutral value; anything else is a 400
whose `param` names the field. vLLM's extensions (top_k, min_tokens, ignore_eos,
stop_token_ids, ...) are accepted under vLLM's names, because benchmark clients send them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_serializer
from pydantic_core import PydanticCustomError

# ---- errors -------------------------------------------------------------------------------


class APIError(Exception):
    """A request the server refuses, reported as OpenAI does: {"error": {...}}."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int = 400, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def api_error_from_validation(exc: ValidationError) -> APIError:
    """The first pydantic error as an APIError naming the offending field."""
    error = exc.errors(include_url=False)[0]
    param = _param_path(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param,
                        "unknown_parameter")
    if kind == "missing":
        return APIError(f"{param}: a value is required", param, "missing_required_parameter")
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind == "value_error":  # our own validators already name the field
        return APIError(message, param, "invalid_value")
    return APIError(f"{param}: {message}; got {_short(error.get('input'))}", param,
                    "invalid_type" if kind.endswith("_type") else "invalid_value")


def _param_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

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
    # accepted at their neutral value only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM: prompt and output token ids in the response

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
        neutral = {"presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
                   "min_p": (None, 0.0), "repetition_penalty": (None, 1.0)}
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                return name
        if self.logit_bias:
            return "logit_bias"
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
        def token_ids(x: Any) -> bool:
            return (isinstance(x, list) and bool(x)
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in x))

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and (
                all(isinstance(p, str) for p in value) or token_ids(value)
                or all(token_ids(p) for p in value)):
            return value
        raise ValueError("prompt: expected a string, a non-empty list of strings, a list of "
                         "token ids, or a list of token-id lists")

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs"
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of"
        return super().unsupported()


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: Any = None  # str | list[ContentPart] | None, checked below with one clear error
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
                isinstance(p, dict) and isinstance(p.get("type"), str)
                and isinstance(p.get("text", ""), str) for p in value):
            # other part types (images, audio) are refused later, by name
            return [ContentPart(type=p["type"], text=p.get("text")) for p in value]
        raise PydanticCustomError("invalid_type",
                                  "expected a string or a list of content parts")

    def text(self, index: int) -> str:
        """The message's text; only text content parts are supported."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            raise APIError(f"messages[{index}].content: a string is required (tool calls are "
                           "not supported)", f"messages[{index}].content", "unsupported_parameter")
        pieces = []
        for j, part in enumerate(self.content):
            if part.type == "text" and part.text is None:
                raise APIError(f"messages[{index}].content[{j}].text: required for a text part",
                               f"messages[{index}].content[{j}].text", "missing_required_parameter")
            if part.type != "text":
                raise APIError(f"messages[{index}].content[{j}]: only text parts are supported, "
                               f"got type {part.type!r}", f"messages[{index}].content[{j}].type",
                               "unsupported_parameter")
            pieces.append(part.text)
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages: at least one message is required")
        return value

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs is not None:
            return "top_logprobs"
        for name in ("tools", "tool_choice", "functions", "function_call",
                     "parallel_tool_calls"):
            if getattr(self, name) not in (None, [], "none"):
                return name
        if self.response_format not in (None, {"type": "text"}):
            return "response_format"
        return super().unsupported()


# ---- responses ----------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
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

    @model_serializer
    def _present_fields_only(self) -> dict[str, Any]:
        # A delta carries only what changed; the final chunk's delta is {}.
        return {k: v for k, v in (("role", self.role), ("content", self.content))
                if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
