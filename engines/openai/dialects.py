"""Per-server request dialects: how each server is asked for exact output lengths and token ids,
and how each one is recognised when it answers.

Every server here speaks OpenAI's `/v1/completions` and `/v1/chat/completions`; they differ in
the fields beyond OpenAI's. What each dialect sends (sources: tests/fixtures/sse/README.md):

| server           | exact output length                           | output token ids         |
|------------------|-----------------------------------------------|--------------------------|
| vllm             | `ignore_eos: true`, `min_tokens = max_tokens` | `return_token_ids: true` |
| sglang           | `ignore_eos: true`, `min_tokens = max_tokens` | `return_token_ids: true` |
| llamacpp         | `ignore_eos: true`, `n_predict = max_tokens`  | none (counted)           |
| llama_cpp_python | `min_tokens = max_tokens` (its EOS masked)    | none (counted)           |
| tgi              | none: its HTTP API has no ignore_eos          | none (counted)           |
| generic          | none: OpenAI's API has no such field          | none (counted)           |

Where a dialect cannot force the length, the request still asks for `max_tokens` and the run
records requested vs actual output tokens per request, so a short answer is visible, not hidden.

`SIGNATURES` says how a server names itself (`GET /v1/models`' `owned_by`, or a page under
the server's root), so that `engine.server=auto` (and `llamacpp`, which has two servers behind
one name) can pick the dialect of the server that actually answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.sampling_params import SamplingParams

FieldsFn = Callable[[SamplingParams], dict[str, Any]]


def _openai_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The fields OpenAI's own API defines, which every server accepts."""
    body: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.n > 1:
        body["n"] = sampling.n
    if sampling.presence_penalty:
        body["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        body["frequency_penalty"] = sampling.frequency_penalty
    if sampling.logit_bias:  # OpenAI's keys are token-id strings
        body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    constraint = sampling.structured_outputs
    if constraint is not None and constraint.kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif constraint is not None and constraint.kind == "json":
        schema = {"name": "response", "schema": json.loads(constraint.spec), "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def _vllm_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _openai_fields(sampling)
    if sampling.top_k > 0:  # vLLM: 0 and -1 both disable top-k; leave its default alone
        body["top_k"] = sampling.top_k
    if sampling.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = sampling.max_tokens
    elif sampling.min_tokens:
        body["min_tokens"] = sampling.min_tokens
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.include_stop_str_in_output:
        body["include_stop_str_in_output"] = True
    if not sampling.skip_special_tokens:
        body["skip_special_tokens"] = False
    if sampling.repetition_penalty != 1.0:
        body["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_p:
        body["min_p"] = sampling.min_p
    if sampling.allowed_token_ids is not None:
        body["allowed_token_ids"] = list(sampling.allowed_token_ids)
    if sampling.bad_words:
        body["bad_words"] = list(sampling.bad_words)
    constraint = sampling.structured_outputs
    if constraint is not None:  # vLLM's extension carries every kind
        body.pop("response_format", None)
        value: object = (
            json.loads(constraint.spec)
            if constraint.kind in ("json", "choice")
            else (True if constraint.kind == "json_object" else constraint.spec)
        )
        body["structured_outputs"] = {constraint.kind: value}
    return body


def _vllm_beam_fields(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM's beam search extension (`inferlab serve` also reads `beam_width`; vLLM searches
    with n beams and ignores it)."""
    body = _vllm_fields(sampling)
    if sampling.use_beam_search:
        body["use_beam_search"] = True
        body["length_penalty"] = sampling.length_penalty
        body["early_stopping"] = sampling.early_stopping
        if sampling.beam_width is not None:
            body["beam_width"] = sampling.beam_width
    return body


def _sglang_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _vllm_fields(sampling)
    body.pop("include_stop_str_in_output", None)  # SGLang has no such field
    return body


def _llamacpp_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _openai_fields(sampling)
    # llama.cpp's own defaults (top_k 40, min_p 0.05) would silently change the sampling
    # distribution: send the values that mean "off" explicitly.
    body["top_k"] = max(sampling.top_k, 0)
    body["min_p"] = sampling.min_p
    body["n_predict"] = sampling.max_tokens
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    return body


def _llama_cpp_python_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _openai_fields(sampling)
    # Its defaults (top_k 40, min_p 0.05, repeat_penalty 1.1) would silently change the
    # sampling distribution: send the values that mean "off" explicitly.
    body["top_k"] = max(sampling.top_k, 0)
    body["min_p"] = sampling.min_p
    body["repeat_penalty"] = 1.0
    # It has no ignore_eos and ignores n_predict; min_tokens masks its EOS token (a logits
    # processor on the server, which knows its own EOS id) until that many tokens are out.
    if sampling.ignore_eos:
        body["min_tokens"] = sampling.max_tokens
    elif sampling.min_tokens:
        body["min_tokens"] = sampling.min_tokens
    return body


def _tgi_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _openai_fields(sampling)
    if sampling.top_p >= 1.0:  # TGI validates 0 < top_p < 1; absent means off
        del body["top_p"]
    return body


#: SamplingParams fields no dialect here sends: best_of > n (vLLM 1.x dropped it)
_NOWHERE = ("best_of",)
#: vLLM's sampling extensions, which only vLLM's (and inferlab's) server reads
_VLLM_ONLY = ("repetition_penalty", "allowed_token_ids", "bad_words", "use_beam_search")
#: SamplingParams fields beyond OpenAI's API (what the generic and TGI dialects cannot send)
_NOT_OPENAI = (
    "top_k",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_p",
    *_VLLM_ONLY,
    *_NOWHERE,
)


@dataclass(frozen=True)
class Dialect:
    name: str
    fields: FieldsFn
    token_prompts: bool  # /v1/completions takes `prompt` as a list of token ids
    token_id_fields: dict[str, Any]  # what asks the server for output token ids
    forces_length: bool  # ignore_eos requests come back exactly max_tokens long
    unsupported: tuple[str, ...]  # SamplingParams fields this server cannot honour
    #: structured-output kinds its requests can carry (OpenAI's response_format: the JSON ones)
    structured_kinds: tuple[str, ...] = ("json", "json_object")
    # How a stream without a usage count is counted (backend.RULES), when the server is known
    # to stream one chunk per token; None: the tokenizer, else one token per non-empty chunk.
    count_rule: str | None = None

    def sampling_fields(self, sampling: SamplingParams) -> dict[str, Any]:
        return self.fields(sampling)

    def refused(self, sampling: SamplingParams) -> list[str]:
        """The non-default sampling fields of `sampling` this server would silently drop."""
        defaults = SamplingParams()
        return [
            name for name in self.unsupported if getattr(sampling, name) != getattr(defaults, name)
        ]


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        "vllm",
        _vllm_beam_fields,
        True,
        {"return_token_ids": True},
        True,
        _NOWHERE,
        structured_kinds=("json", "json_object", "regex", "choice", "grammar"),
    ),
    "sglang": Dialect(
        "sglang",
        _sglang_fields,
        True,
        {"return_token_ids": True},
        True,
        (
            "include_stop_str_in_output",
            "allowed_token_ids",
            "bad_words",
            "use_beam_search",
            *_NOWHERE,
        ),
    ),
    "llamacpp": Dialect(
        "llamacpp",
        _llamacpp_fields,
        True,
        {},
        True,
        ("min_tokens", "stop_token_ids", "include_stop_str_in_output", *_VLLM_ONLY, *_NOWHERE),
    ),
    # llama-cpp-python's server (`python -m llama_cpp.server`): `prompt` is text only (token
    # ids are refused), no usage in streams, one chunk per token then an empty finishing chunk
    "llama_cpp_python": Dialect(
        "llama_cpp_python",
        _llama_cpp_python_fields,
        False,
        {},
        True,
        ("n", "stop_token_ids", "include_stop_str_in_output", *_VLLM_ONLY, *_NOWHERE),
        count_rule="chunk",
    ),
    "tgi": Dialect(
        "tgi",
        _tgi_fields,
        False,
        {},
        False,
        _NOT_OPENAI,
    ),
    "generic": Dialect(
        "generic",
        _openai_fields,
        True,
        {},
        False,
        _NOT_OPENAI,
    ),
}


@dataclass(frozen=True)
class Signature:
    """A server's answer about itself: `where` is "models" (the cards of `GET <base_url>/models`)
    or a path under the server's root (base_url without `/v1`); `field` a dotted JSON path."""

    server: str  # the dialect it selects
    where: str
    field: str
    value: str


# Checked in order; the first match names the server. Sources: vLLM's and SGLang's
# `ModelCard.owned_by` defaults, llama.cpp's `{"owned_by", "llamacpp"}` in tools/server,
# llama-cpp-python's `get_models` (`"owned_by": "me"`) and its FastAPI title, TGI's `/info`
# (`router: env!("CARGO_PKG_NAME")`), and `inferlab serve` (serving/protocol.py).
SIGNATURES: tuple[Signature, ...] = (
    Signature("vllm", "models", "owned_by", "vllm"),
    Signature("vllm", "models", "owned_by", "inferlab"),  # inferlab serve speaks vLLM's dialect
    Signature("sglang", "models", "owned_by", "sglang"),
    Signature("llamacpp", "models", "owned_by", "llamacpp"),
    Signature("llama_cpp_python", "models", "owned_by", "me"),
    Signature("llama_cpp_python", "/openapi.json", "info.title", "\U0001f999 llama.cpp Python API"),
    Signature("tgi", "/info", "router", "text-generation-router"),
)
# A requested dialect that stands for several servers: the one detected among them is used.
FAMILIES: dict[str, tuple[str, ...]] = {"llamacpp": ("llamacpp", "llama_cpp_python")}


def choose_dialect(requested: str, detected: str | None) -> str:
    """The dialect a run uses: `auto` takes what was detected (else `generic`); a family name
    takes its detected member; any other name is used as given."""
    if requested == "auto":
        return detected or "generic"
    if detected is not None and detected in FAMILIES.get(requested, ()):
        return detected
    return requested


# Finish reasons outside OpenAI's vocabulary, mapped onto the harness's "length" | "stop".
FINISH_REASONS = {
    "eos_token": "stop",
    "stop_sequence": "stop",
    "eos": "stop",
    "word": "stop",
    "limit": "length",
}


def normalize_finish_reason(reason: str) -> str:
    return FINISH_REASONS.get(reason, reason)
