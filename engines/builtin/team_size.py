"""How many threads the decode program's team takes for a step, measured as the engine runs.

On a quiet machine every core helps: a step of SmolLM2-135M with INT4 weights takes ~4 ms on
two threads against ~6.5 ms on one (a 2-core Zen 4). On a busy one, a member whose core is
shared with another process is descheduled for a scheduler slice (milliseconds) now and then,
and every barrier of the step waits for it: with one core kept busy, the same step took 8-12
ms on two threads and 6.5 ms on one (scripts/bench_decode_scaling.py --busy-core). Which
machine it is changes while a server runs, so the size is chosen by measuring, not once:

- the team runs at its current size, and every `interval` steps (16 at first: a busy machine
  is found within ~30 steps) a probe alternates the current size with a neighbour (one fewer,
  or one more, by turns) for `probe_steps` steps each, so that a change in the load hits both
  alike;
- the neighbour becomes the size when its median time per row is below `margin` times the
  current size's; the interval then starts again at `first_interval`, else it doubles, up to
  `longest_interval` (a quiet machine pays a probe's slower steps ever more rarely).

engine.cpu_wait_policy=auto sizes the team this way; `active` and `passive` keep every thread.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class TeamSizer:
    most: int  # the engine's threads: the largest team
    first_interval: int = 16
    longest_interval: int = 4096
    probe_steps: int = 6
    margin: float = 0.9
    size: int = field(init=False)
    interval: int = field(init=False)
    probes: int = field(init=False, default=0)  # probes run (for describe())
    _since_probe: int = field(init=False, default=0)
    _candidate: int | None = field(init=False, default=None)
    _downward: bool = field(init=False, default=True)
    _samples: dict[int, list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"TeamSizer.most: {self.most}; allowed: at least 1")
        self.size = self.most
        self.interval = self.first_interval

    def next_size(self) -> int:
        """The team size for the next step (a probe's steps alternate two sizes)."""
        if self._candidate is None:
            self._since_probe += 1
            if self._since_probe < self.interval or self.most == 1:
                return self.size
            self._start_probe()
        assert self._candidate is not None
        taken = sum(len(samples) for samples in self._samples.values())
        return self._candidate if taken % 2 else self.size

    def record(self, size: int, ns_per_row: float) -> None:
        """What a step of `size` threads took per row (only a probe's steps count)."""
        if self._candidate is None or size not in self._samples:
            return
        self._samples[size].append(ns_per_row)
        if all(len(samples) >= self.probe_steps for samples in self._samples.values()):
            self._finish_probe()

    def describe(self) -> dict[str, int]:
        return {"threads": self.most, "size": self.size, "probes": self.probes}

    def _start_probe(self) -> None:
        upward = self.size == 1 or (self.size < self.most and not self._downward)
        candidate = self.size + 1 if upward else self.size - 1
        self._downward = not self._downward
        self._candidate = candidate
        self._samples = {self.size: [], candidate: []}

    def _finish_probe(self) -> None:
        assert self._candidate is not None
        current = statistics.median(self._samples[self.size])
        candidate = statistics.median(self._samples[self._candidate])
        if candidate < self.margin * current:
            self.size = self._candidate
            self.interval = self.first_interval
        else:
            self.interval = min(2 * self.interval, self.longest_interval)
        self.probes += 1
        self._candidate = None
        self._since_probe = 0
        self._samples = {}
