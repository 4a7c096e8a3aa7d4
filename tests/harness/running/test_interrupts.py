"""Ctrl-C and SIGTERM become KeyboardInterrupt naming the signal; inside deferred() they wait
until the block is done (a request's rows are written whole)."""

from __future__ import annotations

import os
import signal

import pytest

from harness.running.interrupts import deferred, interruption, interrupts


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_deferred_waits_for_the_block(sig: signal.Signals) -> None:
    written = []
    with interrupts(), pytest.raises(KeyboardInterrupt) as stopped:
        with deferred():
            os.kill(os.getpid(), sig)
            for row in range(1000):  # the handler has run by now: it only noted the signal
                written.append(row)
        written.append("after the block")  # never reached
    assert written == list(range(1000))
    assert interruption(stopped.value) == f"interrupted: {sig.name}"


def test_outside_deferred_the_signal_stops_at_once() -> None:
    with interrupts(), pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**8):  # interrupted long before the end
            pass
    with deferred():  # no signal pending: nothing raised
        pass
