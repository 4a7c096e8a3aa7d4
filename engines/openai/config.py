"""The `engine=openai` options: where the server is, which API and dialect to speak, limits.

`OpenAIConfig.from_config(options, model)` takes the engine config group (minus `backend`) and
the model group, checks once, and names the field and the allowed values in every error.
The API key is never in the config: `api_key_env` names the environment variable that holds it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engines.openai.launch_config import LaunchConfig
from engines.options import Options, option

APIS = ("completions", "chat")
SERVERS = ("vllm", "sglang", "tgi", "llamacpp", "llama_cpp_python", "generic", "auto")


class OpenAIConfigError(ValueError):
    """An `engine=openai` option has a value the backend cannot take."""


def _is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


@dataclass(frozen=True)
class OpenAIConfig(Options):
    error = OpenAIConfigError
    section = "engine (backend=openai)"

    base_url: str = option(
        "http://127.0.0.1:8000/v1",
        valid=_is_url,
        allowed="an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1",
        help="up to and including /v1",
    )
    model: str | None = option(None, help="the served model name; None: the model group's")
    api_key_env: str | None = option(
        None,
        valid=str.isidentifier,
        allowed="null or the NAME of an environment variable (e.g. OPENAI_API_KEY), never the "
        "key itself",
        help="NAME of the environment variable holding the key",
    )
    api: str = option("completions", choices=APIS, help="the API the requests speak")
    server: str = option(
        "vllm",
        choices=SERVERS,
        help="whose dialect asks for exact output lengths and token ids; auto: the server that "
        "answers (asked at load); llamacpp: llama.cpp's llama-server or llama-cpp-python, "
        "whichever answers",
    )
    timeout_s: float = option(
        600.0, gt=0, unit="seconds", help="connect, and the longest silence between two reads"
    )
    max_connections: int = option(
        256, ge=1, help="the connection pool; more requests in flight wait for one"
    )
    tokenizer: str = option(
        "auto",
        valid=bool,
        allowed="auto|none|a tokenizer.json file or folder",
        help="tokenizer for counting when the server gives no token ids or usage: auto (the "
        "model group's) | none (count one token per chunk) | a tokenizer.json path/folder",
    )
    include_usage: bool = option(True, help="stream_options.include_usage: the final usage chunk")
    request_token_ids: bool = option(True, help="ask for output token ids where the dialect can")
    check_server: bool = option(
        True, help="load() asks GET /models: reachable, model served, context"
    )
    max_model_len: int | None = option(
        None, ge=1, help="None: what /models reports (vLLM, SGLang), else unknown"
    )
    extra_body: dict[str, Any] = option(
        default_factory=dict,
        allowed="a mapping of extra JSON fields, e.g. {top_k: 20}",
        help="merged into every request body",
    )
    metrics_url: str = option(
        "auto",
        valid=lambda url: url in ("auto", "none") or _is_url(url),
        allowed="auto|none|an http:// or https:// URL of /metrics",
        help="the server's Prometheus page, read before and after the measured requests for "
        "its speculative-decoding counters: auto (base_url's root + /metrics) | none | a URL",
    )

    launch: LaunchConfig = option(
        default_factory=LaunchConfig,
        help="the server under test, started by the run (engine=serve_*; "
        "docs/managed_servers.md); an empty command: the server at base_url",
    )

    @classmethod
    def from_config(cls, options: dict[str, Any], model: dict[str, Any]) -> OpenAIConfig:
        served = options.get("model")
        if served is None:
            served = model.get("path") or model.get("name")
        return cls.from_dict({**options, "model": served})

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def _normalise(self) -> None:
        if isinstance(self.base_url, str) and _is_url(self.base_url):
            self._set("base_url", self.base_url.rstrip("/"))

    def _check_together(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise self.invalid("model", "the served model name (a non-empty string)")
        if self.server == "auto" and self.check_server is False:
            raise OpenAIConfigError(
                "engine.server: 'auto' asks the server which it is at load; it needs "
                "engine.check_server=true (or name the server: "
                f"{'|'.join(s for s in SERVERS if s != 'auto')})"
            )
        if self.api_key_env is not None and self.api_key_env not in os.environ:
            raise OpenAIConfigError(
                f"engine.api_key_env: the environment variable {self.api_key_env} is not "
                "set; export it, or set engine.api_key_env=null for a server without keys"
            )
