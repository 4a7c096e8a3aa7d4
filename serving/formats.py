"""How each endpoint writes one request's answer: the whole response, or its stream of SSE
chunks (OpenAI's layouts; vLLM's `return_token_ids` fields when asked for; generated tokens'
logprobs, serving/logprobs_format.py, when asked for; completions' `echo`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engines.base import TokenLogprob
from engines.tool_calls import ToolUse
from serving.generation import ChoiceEnd, ChoiceText, GenerationFailed, Piece, PromptScores
from serving.logprobs_format import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from serving.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
    error_body,
)
from serving.sse import DONE, sse_event


@dataclass
class ChoiceResult:
    end: ChoiceEnd
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked


@dataclass
class Writer:
    """One request's answer; subclasses write one endpoint's layout."""

    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    n: int
    include_usage: bool = False
    return_token_ids: bool = False
    #: vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    #: the request's usage so far
    continuous_usage: bool = False
    #: set when the request asked for logprobs: how token ids are written there
    token_texts: TokenTexts | None = None
    #: completions' echo: each prompt's text, written before its choices' text
    echo: list[str] | None = None
    completion_tokens: int = 0  # output tokens written so far, over every choice
    _started: set[int] = field(default_factory=set)  # choices that have sent a chunk
    #: per choice, where a stream's next token's text_offset starts
    _next_offset: dict[int, int] = field(default_factory=dict)
    #: per prompt, its tokens' logprobs (completions' echo with logprobs), once they came
    prompt_logprobs: dict[int, tuple[TokenLogprob | None, ...]] = field(default_factory=dict)

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def echoed(self, index: int, text: str, first: bool) -> str:
        """The choice's text with its prompt's text before it, where echo asks for that
        (in a stream: in the choice's first chunk, as vLLM sends it)."""
        return self.echo[index // self.n] + text if self.echo is not None and first else text

    def usage(self, completion_tokens: int) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def response(self, choices: dict[int, ChoiceResult]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, piece: ChoiceText | ChoiceEnd) -> str:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> str:
        raise NotImplementedError

    def first_chunk_of(self, piece: ChoiceText | ChoiceEnd) -> bool:
        first = piece.index not in self._started
        self._started.add(piece.index)
        return first

    def running_usage(self) -> Usage | None:
        """The usage a chunk carries: the request's so far (continuous_usage), else None."""
        return self.usage(self.completion_tokens) if self.continuous_usage else None

    def count(self, piece: ChoiceText | ChoiceEnd) -> Usage | None:
        """Count the piece's tokens; the usage its chunk carries."""
        if isinstance(piece, ChoiceText):
            self.completion_tokens += len(piece.token_ids)
        return self.running_usage()

    def _exclude(self, *names: str) -> set[str]:
        return {name for name in names if name != "usage" or not self.include_usage}


class CompletionWriter(Writer):
    def response(self, choices: dict[int, ChoiceResult]) -> dict[str, Any]:
        ids = self.return_token_ids
        body = CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            usage=self.usage(sum(c.end.num_output_tokens for c in choices.values())),
            choices=[
                CompletionChoice(
                    index=i,
                    text=self.echoed(i, c.end.text, True),
                    logprobs=self._logprobs([*self._echoed_scores(i, True), *c.logprobs]),
                    finish_reason=c.end.finish_reason,
                    prompt_token_ids=self.prompt_of(i) if ids else None,
                    token_ids=c.token_ids if ids else None,
                )
                for i, c in sorted(choices.items())
            ],
        )
        return body.model_dump(exclude=None if ids else _CHOICE_IDS)

    def chunk(self, piece: ChoiceText | ChoiceEnd) -> str:
        first = self.first_chunk_of(piece)
        usage = self.count(piece)
        if isinstance(piece, ChoiceText):
            choice = CompletionChoice(
                index=piece.index,
                text=self.echoed(piece.index, piece.text, first),
                logprobs=self._streamed_logprobs(piece, first) if piece.token_ids else None,
                token_ids=list(piece.token_ids),
            )
        else:
            text = self.echoed(piece.index, "", first)  # a choice that ended before a token
            choice = CompletionChoice(
                index=piece.index, text=text, finish_reason=piece.finish_reason, token_ids=[]
            )
        exclude: dict[str, Any] = {"usage": True} if not self.include_usage else {}
        if self.return_token_ids and first:
            choice.prompt_token_ids = self.prompt_of(piece.index)
        else:
            exclude["choices"] = {
                "__all__": (
                    {"prompt_token_ids"}
                    if self.return_token_ids
                    else {"prompt_token_ids", "token_ids"}
                )
            }
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
        ).model_dump_json(exclude=exclude)

    def _logprobs(
        self, logprobs: Sequence[TokenLogprob | int] | None, text_offset: int = 0
    ) -> CompletionLogprobs | None:
        if self.token_texts is None:
            return None
        return completion_logprobs(logprobs or (), self.token_texts, text_offset)

    def _echoed_scores(self, index: int, first: bool) -> list[TokenLogprob | int]:
        """The prompt's logprobs a choice's logprobs start with (echo with logprobs), in its
        first chunk or whole response, its first token as a bare id (it has none); none
        otherwise."""
        scores = self.prompt_logprobs.get(index // self.n)
        if self.echo is None or not first or scores is None:
            return []
        return [self.prompt_of(index)[0], *(s for s in scores[1:] if s is not None)]

    def _streamed_logprobs(self, piece: ChoiceText, first: bool) -> CompletionLogprobs | None:
        """A chunk's logprobs, its text_offset continuing from the choice's previous tokens:
        the offsets a stream gives are the whole response's, even where the engine held text
        back (a partial character, a possible stop string) for a later chunk."""
        offset = self._next_offset.get(piece.index, 0)
        scores: list[TokenLogprob | int] = [
            *self._echoed_scores(piece.index, first),
            *(piece.logprobs or ()),
        ]
        logprobs = self._logprobs(scores, offset)
        if logprobs is not None:
            self._next_offset[piece.index] = offset + sum(map(len, logprobs.tokens))
        return logprobs

    def usage_chunk(self, usage: Usage) -> str:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
        ).model_dump_json()


@dataclass
class ChatWriter(Writer):
    #: the request's tools (engines/tool_calls.py): a choice's text becomes its tool calls,
    #: and a stream holds the text back until the choice ends
    tools: ToolUse | None = None
    _held: dict[int, str] = field(default_factory=dict)

    @property
    def holds_text(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    def message(self, text: str, finish_reason: str) -> tuple[str | None, list[Any], str]:
        """(content, tool calls, finish reason) of a choice's whole text."""
        if self.tools is None:
            return text, [], finish_reason
        content, calls = self.tools.parse(text)
        if calls and self.tools.ends_with_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def response(self, choices: dict[int, ChoiceResult]) -> dict[str, Any]:
        ids = self.return_token_ids
        body = ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            usage=self.usage(sum(c.end.num_output_tokens for c in choices.values())),
            prompt_token_ids=self.prompts[0] if ids else None,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(c.logprobs),
                    finish_reason=reason,
                    token_ids=c.token_ids if ids else None,
                )
                for i, c in sorted(choices.items())
                for content, calls, reason in [self.message(c.end.text, c.end.finish_reason)]
            ],
        )
        return body.model_dump(exclude=None if ids else {"prompt_token_ids": True, **_CHOICE_IDS})

    def chunk(self, piece: ChoiceText | ChoiceEnd) -> str:
        first = self.first_chunk_of(piece)
        before = self.running_usage()  # the role chunk comes before the piece's tokens
        usage = self.count(piece)
        if isinstance(piece, ChoiceEnd):
            delta, reason = ChatDelta(), piece.finish_reason
            if self.holds_text:  # the held text, as content or as the calls, at the end
                content, calls, reason = self.message(self._held.pop(piece.index, ""), reason)
                delta = ChatDelta(
                    content=content or None,
                    tool_calls=[{"index": k, **call} for k, call in enumerate(calls)] or None,
                )
            return self._chunk(
                ChatChunkChoice(index=piece.index, delta=delta, finish_reason=reason, token_ids=[]),
                usage,
            )
        if self.holds_text:
            self._held[piece.index] = self._held.get(piece.index, "") + piece.text
        text = self._chunk(
            ChatChunkChoice(
                index=piece.index,
                delta=ChatDelta(content=None if self.holds_text else piece.text),
                logprobs=self._logprobs(piece.logprobs) if piece.token_ids else None,
                token_ids=list(piece.token_ids),
            ),
            usage,
        )
        if not first:
            return text
        # OpenAI opens each choice with a role-only delta; it goes out in the same write as
        # the first token, so that a client's first chunk still marks the first token.
        role = self._chunk(
            ChatChunkChoice(
                index=piece.index, token_ids=[], delta=ChatDelta(role="assistant", content="")
            ),
            before,
            prompt_token_ids=self.prompts[0],
        )
        return f"{role}\n\ndata: {text}"

    def _logprobs(self, logprobs: Sequence[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.token_texts is None:
            return None
        return chat_logprobs(logprobs or (), self.token_texts)

    def _chunk(
        self,
        choice: ChatChunkChoice,
        usage: Usage | None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        exclude: dict[str, Any] = {"usage": True} if not self.include_usage else {}
        if not self.return_token_ids:
            exclude.update(_CHOICE_IDS)
        if not (self.return_token_ids and prompt_token_ids):
            exclude["prompt_token_ids"] = True
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            prompt_token_ids=prompt_token_ids,
            usage=usage,
        ).model_dump_json(exclude=exclude)

    def usage_chunk(self, usage: Usage) -> str:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage,
        ).model_dump_json(exclude={"prompt_token_ids"})


_CHOICE_IDS: dict[str, Any] = {"choices": {"__all__": {"prompt_token_ids", "token_ids"}}}


async def collect(pieces: AsyncIterator[Piece], writer: Writer) -> dict[int, ChoiceResult]:
    """Every choice's end and token ids (prompts' logprobs to `writer`); a failed generation
    raises."""
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    choices: dict[int, ChoiceResult] = {}
    async for piece in pieces:
        if isinstance(piece, PromptScores):
            writer.prompt_logprobs[piece.prompt_index] = piece.logprobs
        elif isinstance(piece, ChoiceText):
            token_ids.setdefault(piece.index, []).extend(piece.token_ids)
            logprobs.setdefault(piece.index, []).extend(piece.logprobs or ())
        elif isinstance(piece, ChoiceEnd):
            choices[piece.index] = ChoiceResult(
                piece, token_ids.get(piece.index, []), logprobs.get(piece.index, [])
            )
        else:
            raise APIError(piece.message, None, piece.code, piece.status, "server_error")
    return choices


async def event_stream(pieces: AsyncIterator[Piece], writer: Writer) -> AsyncIterator[bytes]:
    """The SSE body: a chunk per piece, the usage chunk when asked for, then [DONE]. A failed
    generation sends an error event (as vLLM does) and ends the stream."""
    # aclosing: when the response closes this body early (a disconnect), `pieces` is closed
    # at once, which aborts the engine request, instead of whenever it is garbage-collected.
    async with aclosing(pieces):  # type: ignore[type-var]
        async for piece in pieces:
            if isinstance(piece, PromptScores):  # written with its choices' first chunks
                writer.prompt_logprobs[piece.prompt_index] = piece.logprobs
                continue
            if isinstance(piece, GenerationFailed):
                failure = error_body(piece.message, "server_error", None, piece.code)
                yield sse_event(json.dumps(failure))
                break
            yield sse_event(writer.chunk(piece))  # counts the piece's tokens
        else:
            if writer.include_usage:
                yield sse_event(writer.usage_chunk(writer.usage(writer.completion_tokens)))
    yield DONE
