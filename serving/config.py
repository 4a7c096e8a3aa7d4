"""The server's own options (the engine's come from the Hydra config groups)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.options import Options, option
from serving.metric_names import NAME_SETS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ServerConfigError(ValueError):
    """A server option has a value the server cannot take."""


@dataclass(frozen=True)
class ServerConfig(Options):
    prefix = ""
    error = ServerConfigError
    section = "server"

    host: str = option(
        "127.0.0.1",
        valid=bool,
        allowed="a host name or IP address, e.g. 127.0.0.1 or 0.0.0.0",
        help="the address to listen on",
    )
    port: int = option(
        8000, ge=0, le=65535, allowed="an integer in [0, 65535] (0: any free port)", help="0: any"
    )
    max_queue_len: int = option(
        1024,
        ge=0,
        help="requests admitted beyond the engine's max_num_seqs; past it new requests get 503",
    )
    served_model_name: str | None = option(
        None,
        valid=bool,
        allowed="null or a non-empty string",
        help="None: the model preset's name or checkpoint path",
    )
    log_level: str = option("info", choices=LOG_LEVELS, help="uvicorn's and the server's")
    access_log: bool = option(False, help="a log line per request costs time on the serving path")
    shutdown_timeout_s: float = option(
        10.0,
        ge=0,
        unit="seconds",
        help="after SIGTERM/SIGINT: how long running requests may finish before they are aborted",
    )
    read_timeout_s: float = option(
        30.0,
        gt=0,
        unit="seconds",
        help="a request's headers, and then its body, must each arrive within this many seconds",
    )
    keep_alive_timeout_s: float = option(
        5.0, gt=0, unit="seconds", help="an idle keep-alive connection is closed after this"
    )
    api_key: str | None = option(
        None,
        secret=True,
        valid=lambda key: bool(key) and key == key.strip(),
        allowed="null or a non-empty string without surrounding whitespace",
        help="/v1/* requests must send `Authorization: Bearer <api_key>`; None: no key is "
        "checked. `inferlab serve` reads INFERLAB_API_KEY when it is not given. Never printed",
    )
    #: 8 MiB: far above the largest prompt a context holds (128k tokens: ~0.5 MB of text, ~1 MB
    #: as token ids), small enough to parse in tens of milliseconds.
    max_body_bytes: int = option(
        8 << 20,
        ge=1,
        allowed="an integer >= 1 (bytes)",
        help="larger request bodies get 413 unread (serving/limits.py)",
    )
    #: 64 KiB: nginx refuses past 32 KiB, Apache past 100 lines of 8 KiB; the openai SDK sends
    #: under 1 KiB.
    max_header_bytes: int = option(
        64 << 10,
        ge=1,
        allowed="an integer >= 1 (bytes)",
        help="a request line and headers over this many bytes get 431 after at most that many "
        "are read (serving/request_head.py)",
    )
    max_header_count: int = option(
        100,
        ge=1,
        help="more header fields than this get 431 (serving/limits.py); Apache's limit (the "
        "openai SDK sends 17)",
    )
    metrics_names: tuple[str, ...] = option(
        NAME_SETS,
        choices=NAME_SETS,
        valid=lambda names: len(set(names)) == len(names),
        allowed=f"a non-empty list of distinct names from {'|'.join(NAME_SETS)}, "
        "e.g. [inferlab,vllm]",
        help="the names /metrics exports every metric under: ours, vLLM's (so that its Grafana "
        "dashboards work), or both",
    )
    profile_dir: str | None = option(
        None,
        valid=lambda path: bool(path) and _can_be_a_folder(Path(path)),
        allowed="null or a folder's path (created if missing), not a file or under one",
        help="where POST /stop_profile writes torch.profiler traces (vLLM's "
        "VLLM_TORCH_PROFILER_DIR; created when profiling starts); None: the profiler endpoints "
        "answer 404",
    )

    def _normalise(self) -> None:
        if isinstance(self.metrics_names, str):  # metrics_names=vllm: a list of one
            self._set("metrics_names", (self.metrics_names,))

    def _check_together(self) -> None:
        for name in ("shutdown_timeout_s", "read_timeout_s", "keep_alive_timeout_s"):
            self._set(name, float(getattr(self, name)))  # checked: a number of seconds


def _can_be_a_folder(path: Path) -> bool:
    """Whether `path` is a folder or could be made one: the nearest part of it that exists is
    a folder (under a file, `/dev/null/traces`, it never can be)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate.is_dir()
    return True
