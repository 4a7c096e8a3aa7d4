"""The `engine=openai` options: where the server is, which API and dialect to speak, limits.

`OpenAIConfig.from_config(options, model)` takes the engine config group (minus `backend`) and
the model group, validates once, and names the field and the allowed values in every error.
The API key is never in the config: `api_key_env` names the environment variable that holds it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

APIS = ("completions", "chat")
SERVERS = ("vllm", "sglang", "tgi", "llamacpp", "llama_cpp_python", "generic", "auto")


class OpenAIConfigError(ValueError):
    """An `engine=openai` option has a value the backend cannot take."""


@dataclass
class OpenAIConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # up to and including /v1
    model: str | None = None  # the served model name; None: the model group's path or name
    api_key_env: str | None = None  # NAME of the environment variable holding the key
    api: str = "completions"
    # whose dialect asks for exact output lengths and token ids; auto: the server that answers
    # (asked at load); llamacpp: llama.cpp's llama-server or llama-cpp-python, whichever answers
    server: str = "vllm"
    timeout_s: float = 600.0  # connect, and the longest silence between two reads
    max_connections: int = 256  # the connection pool; more requests in flight wait for one
    # tokenizer for counting when the server gives no token ids or usage:
    # auto (the model group's) | none (count one token per chunk) | a tokenizer.json path/folder
    tokenizer: str = "auto"
    include_usage: bool = True  # stream_options.include_usage: the final usage chunk
    request_token_ids: bool = True  # ask for output token ids where the dialect can
    check_server: bool = True  # load() asks GET /models: reachable, model served, context
    max_model_len: int | None = None  # None: what /models reports (vLLM, SGLang), else unknown
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    # the server's Prometheus page, read before and after the measured requests for its
    # speculative-decoding counters: auto (base_url's root + /metrics) | none | a URL
    metrics_url: str = "auto"

    @classmethod
    def from_config(cls, options: dict[str, Any], model: dict[str, Any]) -> OpenAIConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise OpenAIConfigError(
                f"engine (backend=openai): unknown option(s) {unknown}; known options: "
                f"{sorted(known)}"
            )
        config = cls(**options)
        if config.model is None:
            config.model = model.get("path") or model.get("name")
        return config.validate()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> OpenAIConfig:
        def fail(name: str, allowed: str) -> OpenAIConfigError:
            return OpenAIConfigError(
                f"engine.{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        if not isinstance(self.base_url, str) or not self.base_url.startswith(
            ("http://", "https://")
        ):
            raise fail("base_url", "an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
        if not isinstance(self.model, str) or not self.model:
            raise fail("model", "the served model name (a non-empty string)")
        if self.api not in APIS:
            raise fail("api", "|".join(APIS))
        if self.server not in SERVERS:
            raise fail("server", "|".join(SERVERS))
        if self.server == "auto" and self.check_server is False:
            raise OpenAIConfigError(
                "engine.server: 'auto' asks the server which it is at load; it needs "
                "engine.check_server=true (or name the server: "
                f"{'|'.join(s for s in SERVERS if s != 'auto')})"
            )
        if self.api_key_env is not None:
            if not isinstance(self.api_key_env, str) or not self.api_key_env.isidentifier():
                raise fail(
                    "api_key_env",
                    "null or the NAME of an environment variable "
                    "(e.g. OPENAI_API_KEY), never the key itself",
                )
            if self.api_key_env not in os.environ:
                raise OpenAIConfigError(
                    f"engine.api_key_env: the environment variable {self.api_key_env} is not "
                    "set; export it, or set engine.api_key_env=null for a server without keys"
                )
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not 0 < self.timeout_s < float("inf")
        ):
            raise fail("timeout_s", "a number of seconds > 0")
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise fail("max_connections", "an integer >= 1")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise fail("tokenizer", "auto|none|a tokenizer.json file or folder")
        for name in ("include_usage", "request_token_ids", "check_server"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "true|false")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len < 1
        ):
            raise fail("max_model_len", "null or an integer >= 1")
        if not isinstance(self.extra_body, dict):
            raise fail("extra_body", "a mapping of extra JSON fields, e.g. {top_k: 20}")
        if not isinstance(self.metrics_url, str) or not (
            self.metrics_url in ("auto", "none")
            or self.metrics_url.startswith(("http://", "https://"))
        ):
            raise fail("metrics_url", "auto|none|an http:// or https:// URL of /metrics")
        self.base_url = self.base_url.rstrip("/")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None
