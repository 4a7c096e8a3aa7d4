"""The server's own options (the engine's come from the Hydra config groups)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

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

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ServerConfigError(f"server: unknown option(s) {unknown}; known options: "
                                    f"{sorted(known)}")
        return cls(**values).validate()

    def validate(self) -> ServerConfig:
        def fail(name: str, allowed: str) -> ServerConfigError:
            return ServerConfigError(f"{name}: {getattr(self, name)!r} is invalid; "
                                     f"allowed: {allowed}")

        if not isinstance(self.host, str) or not self.host:
            raise fail("host", "a host name or IP address, e.g. 127.0.0.1 or 0.0.0.0")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 <= self.port <= 65535:
            raise fail("port", "an integer in [0, 65535] (0: any free port)")
        if isinstance(self.max_queue_len, bool) or not isinstance(self.max_queue_len, int) \
                or self.max_queue_len < 0:
            raise fail("max_queue_len", "an integer >= 0")
        if self.served_model_name is not None and (
                not isinstance(self.served_model_name, str) or not self.served_model_name):
            raise fail("served_model_name", "null or a non-empty string")
        if self.log_level not in LOG_LEVELS:
            raise fail("log_level", "|".join(LOG_LEVELS))
        if not isinstance(self.access_log, bool):
            raise fail("access_log", "true|false")
        return self
