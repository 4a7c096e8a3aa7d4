"""Generated tokens' log-probabilities in OpenAI's two wire layouts, as vLLM writes them.

The engine reports each generated token as a `TokenLogprob` (engines/base.py): its id,
log-probability, rank and the k most likely tokens at its position. Here they become

- `/v1/completions`' legacy object: `{"text_offset", "token_logprobs", "tokens",
  "top_logprobs"}`, where each position's `top_logprobs` is a dict of token text to
  log-probability holding the sampled token first and then the k most likely (k + 1 entries
  when the sampled token is not among them), vLLM's `_create_completion_logprobs`;
- `/v1/chat/completions`' `{"content": [ChatCompletionTokenLogprob, ...]}`, each with the token,
  its log-probability, its UTF-8 bytes and the k most likely as `{"token", "logprob", "bytes"}`.

Token texts are each id decoded alone (vLLM's `convert_ids_list_to_tokens`: special tokens
spelled out); a token that is only part of a UTF-8 character (a byte-level BPE fragment, a
SentencePiece `<0xNN>` byte-fallback token) is written `bytes:\\xNN...`, as OpenAI and vLLM write
them, with its raw bytes in chat's `bytes`. Log-probabilities below -9999 (and -inf) are written
as -9999.0, the value OpenAI uses for "very unlikely" (JSON has no -inf).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from pydantic import BaseModel

from engines.base import TokenLogprob
from models.tokenizer import Tokenizer

#: OpenAI's stand-in for log-probabilities JSON cannot carry (-inf) or that are negligible
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# ---- response models ----------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions `logprobs` (vLLM's CompletionLogProbs, in its field order)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    """OpenAI's ChatCompletionTokenLogprob."""

    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None  # OpenAI's field; this server never refuses in text


# ---- token texts --------------------------------------------------------------------------


class TokenTexts:
    """Each token id's text and bytes as logprobs write them, computed once per id (a server
    writes the same few thousand ids over and over)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def utf8(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = _token_text(self._tokenizer, token_id)
        return found


def _token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """The id decoded alone, special tokens kept (vLLM decodes logprob tokens this way); a
    token that is not whole UTF-8 decodes to U+FFFD, so its raw bytes are named instead."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, list(text.encode("utf-8"))
    raw = _raw_bytes(tokenizer.backend.id_to_token(token_id) or "")
    if raw is None:
        return text, list(text.encode("utf-8"))
    try:
        return raw.decode("utf-8"), list(raw)  # a real U+FFFD in the vocabulary
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _raw_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary entry stands for: a SentencePiece byte-fallback `<0xNN>`, or a
    byte-level BPE piece (GPT-2's byte-to-character table); None for anything else."""
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match is not None:
        return bytes([int(match[1], 16)])
    table = _byte_level_decoding()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


@functools.cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    kept = set(printable)
    shifted = (b for b in range(256) if b not in kept)
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)  # max(-inf, x) is x; NaN never comes from a softmax


# ---- the two layouts ----------------------------------------------------------------------


def completion_logprobs(
    logprobs: Sequence[TokenLogprob | int], texts: TokenTexts, text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy completions object for `logprobs` in order (a bare token id: a token without
    a logprob, an echoed prompt's first, written with nulls as vLLM does). `text_offset`:
    characters of the choice's text already returned (a stream's earlier chunks), where the
    first token's offset starts; each next offset adds the previous token's text length, as
    vLLM counts them."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for position in logprobs:
        if isinstance(position, int):  # a prompt's first token (echo): nothing before it
            token = texts.text(position)
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
            values.append(None)
            tops.append(None)
            continue
        token = texts.text(position.token_id)
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        values.append(_clamped(position.logprob))
        # the sampled token first, then the k most likely; a text seen twice keeps its first
        # place and the later value, as a dict built in this order does (vLLM's)
        top = {token: _clamped(position.logprob)}
        for token_id, logprob in position.top:
            top[texts.text(token_id)] = _clamped(logprob)
        tops.append(top)
    return CompletionLogprobs(
        text_offset=offsets, token_logprobs=values, tokens=tokens, top_logprobs=tops
    )


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """Chat's `logprobs.content` for `logprobs` in order; each token's `top_logprobs` are the
    k most likely at its position, most likely first (OpenAI's meaning)."""
    content = []
    for position in logprobs:
        top = [_chat_entry(token_id, logprob, texts) for token_id, logprob in position.top]
        token = _chat_entry(position.token_id, position.logprob, texts)
        content.append(ChatTokenLogprob(**token.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts) -> ChatTopLogprob:
    return ChatTopLogprob(
        token=texts.text(token_id), logprob=_clamped(logprob), bytes=texts.utf8(token_id)
    )
