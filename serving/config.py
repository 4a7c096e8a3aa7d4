"""The server's own options (the engine's come from the Hydra config groups)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from serving.metric_names import NAME_SETS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ServerConfigError(ValueError):
    """A server option has a value the server cannot take."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Requests admitted beyond the engine's max_num_seqs; past it new requests get 503.
    max_queue_len: int = 1024
    served_model_name: str | None = None  # None: the model preset's name or checkpoint path
    log_level: str = "info"
    access_log: bool = False  # a log line per request costs time on the serving path
    #: After SIGTERM/SIGINT: how long running requests may finish before they are aborted.
    shutdown_timeout_s: float = 10.0
    #: A request's headers, and then its body, must each arrive within this many seconds.
    read_timeout_s: float = 30.0
    #: An idle keep-alive connection is closed after this many seconds (uvicorn's).
    keep_alive_timeout_s: float = 5.0
    #: /v1/* requests must send `Authorization: Bearer <api_key>`; None: no key is checked.
    #: `inferlab serve` reads INFERLAB_API_KEY when it is not given. Never printed.
    api_key: str | None = field(default=None, repr=False)
    #: Larger request bodies get 413 unread (serving/limits.py). 8 MiB: far above the largest
    #: prompt a context holds (128k tokens: ~0.5 MB of text, ~1 MB as token ids), small enough
    #: to parse in tens of milliseconds.
    max_body_bytes: int = 8 << 20
    #: A request line and headers over this many bytes get 431 after at most that many are
    #: read (serving/request_head.py). 64 KiB: nginx refuses past 32 KiB, Apache past 100
    #: lines of 8 KiB; the openai SDK sends under 1 KiB.
    max_header_bytes: int = 64 << 10
    #: More header fields than this get 431 (serving/limits.py); Apache's limit. The openai
    #: SDK sends 17.
    max_header_count: int = 100
    #: The names /metrics exports every metric under: ours, vLLM's (so that its Grafana
    #: dashboards work), or both.
    metrics_names: tuple[str, ...] = NAME_SETS
    #: Where POST /stop_profile writes torch.profiler traces (vLLM's VLLM_TORCH_PROFILER_DIR;
    #: created when profiling starts); None: the profiler endpoints answer 404.
    profile_dir: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ServerConfigError(
                f"server: unknown option(s) {unknown}; known options: {sorted(known)}"
            )
        return cls(**values).validate()

    def validate(self) -> ServerConfig:
        def fail(name: str, allowed: str) -> ServerConfigError:
            return ServerConfigError(
                f"{name}: {getattr(self, name)!r} is invalid; allowed: {allowed}"
            )

        if not isinstance(self.host, str) or not self.host:
            raise fail("host", "a host name or IP address, e.g. 127.0.0.1 or 0.0.0.0")
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            raise fail("port", "an integer in [0, 65535] (0: any free port)")
        if (
            isinstance(self.max_queue_len, bool)
            or not isinstance(self.max_queue_len, int)
            or self.max_queue_len < 0
        ):
            raise fail("max_queue_len", "an integer >= 0")
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name
        ):
            raise fail("served_model_name", "null or a non-empty string")
        if self.log_level not in LOG_LEVELS:
            raise fail("log_level", "|".join(LOG_LEVELS))
        if not isinstance(self.access_log, bool):
            raise fail("access_log", "true|false")
        if self.api_key is not None and (
            not isinstance(self.api_key, str)
            or not self.api_key
            or self.api_key != self.api_key.strip()
        ):
            # the value itself stays out of the message: it is a secret
            raise ServerConfigError(
                "api_key: invalid; allowed: null or a non-empty string "
                "without surrounding whitespace"
            )
        for name, allowed in (
            ("max_body_bytes", "an integer >= 1 (bytes)"),
            ("max_header_bytes", "an integer >= 1 (bytes)"),
            ("max_header_count", "an integer >= 1"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(name, allowed)
        if self.profile_dir is not None and (
            not isinstance(self.profile_dir, str)
            or not self.profile_dir
            or not _can_be_a_folder(Path(self.profile_dir))
        ):
            raise fail(
                "profile_dir",
                "null or a folder's path (created if missing), not a file or under one",
            )
        names = self.metrics_names
        if isinstance(names, str):  # metrics_names=vllm: a list of one
            names = (names,)
        if (
            not isinstance(names, list | tuple)
            or not names
            or any(n not in NAME_SETS for n in names)
            or len(set(names)) != len(names)
        ):
            raise fail(
                "metrics_names",
                f"a non-empty list of distinct names from {'|'.join(NAME_SETS)}, "
                "e.g. [inferlab,vllm]",
            )
        self.metrics_names = tuple(names)
        for name, positive in (
            ("shutdown_timeout_s", False),
            ("read_timeout_s", True),
            ("keep_alive_timeout_s", True),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not (value > 0 if positive else value >= 0)
            ):
                raise fail(name, f"a number of seconds {'>' if positive else '>='} 0")
            setattr(self, name, float(value))
        return self


def _can_be_a_folder(path: Path) -> bool:
    """Whether `path` is a folder or could be made one: the nearest part of it that exists is
    a folder (under a file, `/dev/null/traces`, it never can be)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir()
    return True
