"""Per-server request dialects: how each server is asked for exact output lengths and token ids.

Every server here speaks OpenAI's `/v1/completions` and `/v1/chat/completions`; they differ in
the fields beyond OpenAI's. What each dialect sends (sources: tests/fixtures/sse/README.md):

| server   | exact output length                          | output token ids         |
|----------|----------------------------------------------|--------------------------|
| vllm     | `ignore_eos: true`, `min_tokens = max_tokens` | `return_token_ids: true` |
| sglang   | `ignore_eos: true`, `min_tokens = max_tokens` | `return_token_ids: true` |
| llamacpp | `ignore_eos: true`, `n_predict = max_tokens`  | none (counted)           |
| tgi      | none: its HTTP API has no ignore_eos         | none (counted)           |
| generic  | none: OpenAI's API has no such field         | none (counted)           |

Where a dialect cannot force the length, the request still asks for `max_tokens` and the run
records requested vs actual output tokens per request, so a short answer is visible, not hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.sampling_params import SamplingParams

FieldsFn = Callable[[SamplingParams], dict[str, Any]]


def _openai_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The fields OpenAI's own API defines, which every server accepts."""
    body: dict[str, Any] = {"max_tokens": sampling.max_tokens,
                            "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.n > 1:
        body["n"] = sampling.n
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
    body["min_p"] = 0.0
    body["n_predict"] = sampling.max_tokens
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    return body


def _tgi_fields(sampling: SamplingParams) -> dict[str, Any]:
    body = _openai_fields(sampling)
    if sampling.top_p >= 1.0:  # TGI validates 0 < top_p < 1; absent means off
        del body["top_p"]
    return body


@dataclass(frozen=True)
class Dialect:
    name: str
    fields: FieldsFn
    token_prompts: bool  # /v1/completions takes `prompt` as a list of token ids
    token_id_fields: dict[str, Any]  # what asks the server for output token ids
    forces_length: bool  # ignore_eos requests come back exactly max_tokens long
    unsupported: tuple[str, ...]  # SamplingParams fields this server cannot honour

    def sampling_fields(self, sampling: SamplingParams) -> dict[str, Any]:
        return self.fields(sampling)

    def refused(self, sampling: SamplingParams) -> list[str]:
        """The non-default sampling fields of `sampling` this server would silently drop."""
        defaults = SamplingParams()
        return [name for name in self.unsupported
                if getattr(sampling, name) != getattr(defaults, name)]


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect("vllm", _vllm_fields, True, {"return_token_ids": True}, True, ()),
    "sglang": Dialect("sglang", _sglang_fields, True, {"return_token_ids": True}, True,
                      ("include_stop_str_in_output",)),
    "llamacpp": Dialect("llamacpp", _llamacpp_fields, True, {}, True,
                        ("min_tokens", "stop_token_ids", "include_stop_str_in_output")),
    "tgi": Dialect("tgi", _tgi_fields, False, {}, False,
                   ("top_k", "min_tokens", "ignore_eos", "stop_token_ids",
                    "include_stop_str_in_output")),
    "generic": Dialect("generic", _openai_fields, True, {}, False,
                       ("top_k", "min_tokens", "ignore_eos", "stop_token_ids",
                        "include_stop_str_in_output")),
}

# Finish reasons outside OpenAI's vocabulary, mapped onto the harness's "length" | "stop".
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "eos": "stop", "word": "stop",
                  "limit": "length"}


def normalize_finish_reason(reason: str) -> str:
    return FINISH_REASONS.get(reason, reason)
