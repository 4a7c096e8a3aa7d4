"""The servers this process started and may use again: a run that ends hands its server back
(`release`); the next run takes it (`acquire`) when it would start the very same one (command
line with the port left open, environment, CPU cores, GPUs), else the kept one is stopped first,
so that only consecutive runs share a server and two never hold the same cores or GPUs. What is
still kept when the process exits, or when a sweep ends (`stop_kept`), is stopped.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass

from engines.openai.server_process import ServerProcess

ServerKey = tuple[tuple[str, ...], tuple[tuple[str, str | None], ...], tuple[int, ...], str]


@dataclass
class _Kept:
    key: ServerKey
    server: ServerProcess
    grace_s: float


_kept: _Kept | None = None


def server_key(command_without_port: list[str], env: dict[str, str | None]) -> ServerKey:
    """What must match for a server to be used again: the command line (its port left out), its
    environment, and the placement it inherits (cores, visible GPUs)."""
    cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return (
        tuple(command_without_port),
        tuple(sorted(env.items())),
        cores,
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    )


def acquire(key: ServerKey, usable: Callable[[ServerProcess], bool]) -> ServerProcess | None:
    """The kept server when its key is `key`, it still runs and `usable` says yes; None
    otherwise (a kept server that does not fit is stopped)."""
    global _kept
    kept, _kept = _kept, None
    if kept is None:
        return None
    if kept.key == key and kept.server.exit_status() is None and usable(kept.server):
        return kept.server
    kept.server.stop(kept.grace_s)
    return None


def release(key: ServerKey, server: ServerProcess, keep: bool, grace_s: float) -> None:
    """A run is done with `server`: kept for the next run when `keep`, else stopped."""
    global _kept
    if keep and server.exit_status() is None:
        stop_kept()  # never two: a run that started a second server stopped the first
        server.log_to(None)
        _kept = _Kept(key, server, grace_s)
    else:
        server.stop(grace_s)


def stop_kept() -> None:
    """Stop the kept server, if any (the end of a sweep, Ctrl-C, the process's exit)."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.server.stop(kept.grace_s)


def kept_server() -> ServerProcess | None:
    return _kept.server if _kept is not None else None


atexit.register(stop_kept)
