"""The planted slowdown, a test instrument for validating the regression gate (docs/gate.md):
an engine whose every step busy-waits `engine.debug_step_delay_fraction` of its own duration,
inside the step's timing (so step, token and every latency/throughput figure show it).

It is applied from outside the engine: `build_engine` (factory.py) returns a `SlowedEngine`
only when the option is > 0, so the plain `LLMEngine` neither reads the option nor branches
on it per step.
"""

from __future__ import annotations

from collections.abc import Callable

from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine


class SlowedEngine(LLMEngine):
    """LLMEngine whose steps last (1 + debug_step_delay_fraction) times as long."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.delay_fraction = float(config.debug_step_delay_fraction)

    def _end_step(self, start_ns: int) -> int:
        work_end = self.platform.now_ns()
        return _busy_wait_until(
            work_end + (work_end - start_ns) * self.delay_fraction, self.platform.now_ns
        )


def _busy_wait_until(deadline_ns: float, now_ns: Callable[[], int]) -> int:
    """Spin, not sleep: an idle CPU loses its caches and clock to the rest of the machine, so
    a sleep of x slows the run by more than x (measured: 0.25 of each step asleep cut tokens/s
    by ~29% instead of 20%), while a spinning core costs what slower code would."""
    now = now_ns()
    while now < deadline_ns:
        now = now_ns()
    return now
