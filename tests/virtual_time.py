"""Virtual time for driver tests: an event loop whose clock jumps to the next timer whenever
every task waits, so asyncio.sleep (the driver's and a scripted backend's) takes no real time
and the rows hold exactly the scripted times."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Iterator
from typing import Any

import pytest

from harness.running.driver import Clock


class _SkippingSelector(selectors.DefaultSelector):
    """Never waits for a timer: when nothing is ready it moves the virtual clock to the next
    one (the `timeout` the event loop asks to wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> Any:
        events = super().select(0 if timeout is not None else None)
        if not events and timeout:
            self.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time starts at 0 and jumps to the next timer whenever every task
    waits."""

    def __init__(self) -> None:
        self.selector = _SkippingSelector()
        super().__init__(self.selector)

    def time(self) -> float:
        return self.selector.now


def virtual_ns() -> int:
    """The running loop's clock in ns: the driver's and the scripted backend's clock."""
    return round(asyncio.get_running_loop().time() * 1e9)


@pytest.fixture
def virtual_time() -> Iterator[Clock]:
    """Driver.run's asyncio.run gets a VirtualTimeLoop; yields the clock to give the driver."""

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            return VirtualTimeLoop()

    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(Policy())
    try:
        yield virtual_ns
    finally:
        asyncio.set_event_loop_policy(before)
