"""One SSE event of an OpenAI-style stream -> what it says: text deltas, token ids, finish
reasons, usage, an error, or the end.

The shapes read here (sources in tests/fixtures/sse/README.md): completions chunks carry
`choices[i].text`, chat chunks `choices[i].delta.content`; vLLM and SGLang add
`choices[i].token_ids` when asked (and `prompt_token_ids` in a choice's first chunk); a
completions choice asked for `logprobs` carries OpenAI's legacy `choices[i].logprobs` object
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), the prompt's first with `echo`;
the usage chunk has `usage` (and, from vLLM, SGLang and TGI,
empty `choices`; llama.cpp puts it on the finishing chunk); the stream ends with `data: [DONE]`.
Errors arrive as `{"error": ...}` (vLLM, SGLang, TGI), `{"object": "error", ...}`, an SSE
`event: error`, or llama.cpp's `error: {...}` field. A server that answers a streaming request
with one JSON body instead (`decode_response`) has `choices[i].text` or
`choices[i].message.content`. A chat answer's tool calls come as `delta.tool_calls` fragments
(OpenAI's layout: each with an `index`, the first with `id` and `function.name`, the rest
with pieces of `function.arguments`) or, whole, as `message.tool_calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engines.openai.sse import SSEEvent


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: tuple[int, ...] | None  # None: the server sent none
    finish_reason: str | None
    has_text: bool = True  # the text field was there (chat's `content` may be null or absent)
    role_only: bool = False  # chat's opening delta: a role and empty content, nothing else
    logprobs: dict[str, Any] | None = None  # completions' legacy logprobs object, as sent
    prompt_token_ids: tuple[int, ...] | None = None  # vLLM's return_token_ids, first chunk
    #: chat's `delta.tool_calls` fragments as sent (a whole response: `message.tool_calls`)
    tool_calls: tuple[dict[str, Any], ...] = ()

    @property
    def tool_text(self) -> str:
        """The text of the tool-call fragments (names and argument pieces): tokens the model
        wrote that are not content."""
        parts = []
        for fragment in self.tool_calls:
            function = fragment.get("function")
            if isinstance(function, dict):
                parts += [str(function.get(key) or "") for key in ("name", "arguments")]
        return "".join(parts)


@dataclass(slots=True)
class Chunk:
    choices: list[ChoiceDelta] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False


def decode_event(event: SSEEvent) -> Chunk:
    if "error" in event.extra:
        return Chunk(error=_error_text(event.extra["error"]))
    if event.event == "error":
        return Chunk(error=_error_text(event.data))
    if event.is_done:
        return Chunk(done=True)
    if not event.data.strip():
        return Chunk()
    return _decode_payload(event.data, "SSE data")


def decode_response(body: bytes) -> Chunk:
    """A whole (non-streamed) JSON response, as one chunk."""
    return _decode_payload(body.decode("utf-8", errors="replace"), "response body")


def _decode_payload(data: str, what: str) -> Chunk:
    try:
        payload = json.loads(data)
    except json.JSONDecodeError as exc:
        return Chunk(error=f"invalid JSON in {what} ({exc}): {data[:200]!r}")
    if not isinstance(payload, dict):
        return Chunk(error=f"{what} is not a JSON object: {data[:200]!r}")
    if payload.get("error") is not None:
        return Chunk(error=_error_text(payload["error"], payload.get("error_type")))
    if payload.get("object") == "error":
        return Chunk(error=_error_text(payload))
    try:
        return _chunk(payload)
    except (AttributeError, TypeError, ValueError) as exc:  # a field of an unexpected type
        return Chunk(error=f"malformed {what} ({type(exc).__name__}: {exc}): {data[:200]!r}")


def _chunk(payload: dict[str, Any]) -> Chunk:
    chunk = Chunk()
    for choice in payload.get("choices") or ():
        text = choice.get("text")
        delta = choice.get("delta") or choice.get("message") or {}  # stream | whole response
        if text is None:
            text = delta.get("content")
        ids = choice.get("token_ids")
        prompt_ids = choice.get("prompt_token_ids")
        logprobs = choice.get("logprobs")
        finish_reason = choice.get("finish_reason") or None
        tool_calls = delta.get("tool_calls")
        chunk.choices.append(
            ChoiceDelta(
                index=int(choice.get("index") or 0),
                text=str(text or ""),
                token_ids=tuple(int(i) for i in ids) if isinstance(ids, list) else None,
                finish_reason=str(finish_reason) if finish_reason is not None else None,
                has_text=text is not None,
                role_only=bool(delta.get("role")) and not text and finish_reason is None,
                logprobs=logprobs if isinstance(logprobs, dict) else None,
                prompt_token_ids=tuple(int(i) for i in prompt_ids)
                if isinstance(prompt_ids, list)
                else None,
                tool_calls=tuple(c for c in tool_calls if isinstance(c, dict))
                if isinstance(tool_calls, list)
                else (),
            )
        )
    usage = payload.get("usage")
    if isinstance(usage, dict):
        chunk.usage = usage
    return chunk


def _error_text(error: Any, error_type: Any = None) -> str:
    if isinstance(error, str):
        try:
            error = json.loads(error)
        except json.JSONDecodeError:
            return f"{error_type}: {error}" if error_type else error
    if isinstance(error, dict):
        message = error.get("message") or error.get("error") or json.dumps(error)
        kind = error.get("type") or error.get("error_type") or error_type
        code = error.get("code")
        parts = [str(p) for p in (kind, code) if p is not None]
        return f"{' '.join(parts)}: {message}" if parts else str(message)
    return str(error)
