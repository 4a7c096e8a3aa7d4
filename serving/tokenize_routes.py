"""vLLM's tokenizer endpoints: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

A client (lm-eval's `tokenizer_backend=remote`, a benchmark sizing its prompts) tokenizes
exactly as the server does without a Hugging Face tokenizer folder of its own. The tokenizer
is the engine's, and the token ids are those the completion routes compute for the same prompt:
text through the same encoder, chat messages through the same chat template. Request and
response fields carry vLLM's names (vllm/entrypoints/serve/tokenize/protocol.py); vLLM's chat
options this server has no feature for are accepted only at their neutral value, as the
completion routes accept OpenAI's.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, field_validator

from models.tokenizer import Tokenizer
from serving.generation import ServingEngine
from serving.protocol import (
    NEUTRAL_VALUES,
    APIError,
    ChatMessage,
    _Strict,
    check_json_content_type,
    check_model,
    parse_json_object,
    validate_request,
)

#: What the server says its tokenizer is: the class transformers loads a tokenizer.json-only
#: folder with (Tokenizer.save_pretrained writes the same)
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

# ---- requests and responses -------------------------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS where the tokenizer adds it, as completions do
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True  # as chat completions render the conversation
    # vLLM: encode the rendered text with the tokenizer's special tokens on top of what the
    # template wrote (a second BOS, for most templates); false: as chat completions encode it
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    # vLLM's; accepted only at their neutral value (the chat routes have no such options)
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages: at least one message is required")
        return value

    def unsupported(self) -> str | None:
        if self.continue_final_message:
            return "continue_final_message"
        if self.chat_template is not None:
            return "chat_template"
        if self.chat_template_kwargs:
            return "chat_template_kwargs"
        if self.tools:
            return "tools"
        return None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # null unless return_token_strs, as vLLM answers


# ---- routes -----------------------------------------------------------------------------------


def add_tokenizer_routes(app: FastAPI, serving: ServingEngine) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        data = await _json_body(request)
        # vLLM's two request shapes, told apart as its union is: chat has `messages`
        body: TokenizeCompletionRequest | TokenizeChatRequest = (
            validate_request(data, TokenizeChatRequest)
            if "messages" in data
            else validate_request(data, TokenizeCompletionRequest)
        )
        check_model(body.model, serving.model_name)
        tokenizer = serving.engine.tokenizer
        if isinstance(body, TokenizeChatRequest):
            ids = await _tokenize_chat(serving, tokenizer, body)
        else:
            ids = await serving.in_tokenizer_pool(
                tokenizer.encode, body.prompt, body.add_special_tokens
            )
        strings = (  # a Python loop over the ids: off the event loop too
            await serving.in_tokenizer_pool(tokenizer.token_strings, ids)
            if body.return_token_strs
            else None
        )
        return TokenizeResponse(
            count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strings
        ).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = validate_request(await _json_body(request), DetokenizeRequest)
        check_model(body.model, serving.model_name)
        _check_in_vocabulary(body.tokens, serving.engine.model_config.vocab_size)
        # special tokens are kept (transformers' decode default, which vLLM uses): a client
        # handing back ids from /tokenize gets exactly what they spell, BOS included
        text = await serving.in_tokenizer_pool(serving.engine.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return tokenizer_config(serving.engine.tokenizer, serving.max_model_len)


async def _json_body(request: Request) -> dict[str, Any]:
    check_json_content_type(request.headers.get("content-type"))  # before the body is read
    return parse_json_object(await request.body())


async def _tokenize_chat(
    serving: ServingEngine, tokenizer: Tokenizer, body: TokenizeChatRequest
) -> list[int]:
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(
            f"{unsupported}: unsupported by this server (value "
            f"{getattr(body, unsupported)!r}); allowed: "
            f"{NEUTRAL_VALUES.get(unsupported, 'null (leave it unset)')}",
            unsupported,
            "unsupported_parameter",
        )
    messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(body.messages)]
    try:
        if body.add_special_tokens:
            return await serving.in_tokenizer_pool(
                _encode_rendered, tokenizer, messages, body.add_generation_prompt
            )
        # the encoding chat completions use (BOS once, whether or not the template wrote it)
        return await serving.in_tokenizer_pool(
            tokenizer.encode_chat, messages, body.add_generation_prompt
        )
    except ValueError as exc:  # a malformed conversation, or the template failed
        raise APIError(f"messages: {exc}", "messages", "invalid_value") from None


def _encode_rendered(
    tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt))


def _check_in_vocabulary(token_ids: list[int], vocab_size: int) -> None:
    """Ids the model could never have produced are refused, naming the first (min and max are
    C loops: a body of a million ids costs milliseconds on the event loop)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        index, bad = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise APIError(
            f"tokens[{index}]: {bad} is outside the vocabulary; allowed: token ids in "
            f"[0, {vocab_size})",
            f"tokens[{index}]",
            "invalid_value",
        )


def tokenizer_config(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """The server's tokenizer as a tokenizer_config.json says it (vLLM answers /tokenizer_info
    with the loaded tokenizer's config). `chat_template` is the template chat requests are
    rendered with: the model's, or the project's plain one for a model that has none."""
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "model_max_length": max_model_len,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "add_bos_token": tokenizer.adds_bos,
        "chat_template": tokenizer.chat_template,
    }
