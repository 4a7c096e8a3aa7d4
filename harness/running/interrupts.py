"""Ctrl-C and SIGTERM stop a run: both become KeyboardInterrupt, which asyncio propagates out
of the event loop from any task, so the run stops, keeps its rows and says which signal it
was. Inside `deferred()` (a request's rows being written) the interrupt waits until the block
ends, so that no request is left with its token rows written and its request row not."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_depth = 0  # nesting of deferred() blocks (signal handlers run on the main thread only)
_pending: str | None = None  # the signal that arrived during one


def _handler(signum: int, frame: Any) -> None:
    global _pending
    name = signal.Signals(signum).name
    if _depth:
        _pending = _pending or name
        return
    raise KeyboardInterrupt(name)


@contextmanager
def interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt naming the signal while the block runs."""
    try:
        previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold an interrupt until the block is done, then raise it."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            name, _pending = _pending, None
            raise KeyboardInterrupt(name)


def interruption(exc: KeyboardInterrupt) -> str:
    """`interrupted: SIGINT` or `interrupted: SIGTERM` (a bare KeyboardInterrupt, from the
    default handler, is Ctrl-C's)."""
    return f"interrupted: {str(exc) or 'SIGINT'}"
