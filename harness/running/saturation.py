"""Over-saturation: has the server stopped keeping up with the load, so that the queue (and
with it the time to first token) grows without bound for as long as requests keep coming?

A run past saturation measures nothing but the length of its own queue: every further request
waits longer than the last, the percentiles describe how long the run lasted, and a long
workload takes ever longer to finish. The detector (in the spirit of guidellm's over-saturation
detection) decides from what any backend shows the driver, over a trailing window of
`window_s`, no sooner than `min_duration_s` into the run:

1. requests in flight grow steadily: the least-squares slope of in-flight against time is
   significant (its t statistic, slope / standard error, >= `min_t`), the fitted line rises by
   at least `min_growth` of its level at the window's start (and by 2 requests or more), and it
   rises significantly in each half of the window on its own (t >= `min_t` there too): a queue
   that only grew in a burst at the end, or that grew and drained again, is not growing without
   bound;
2. and the TTFT of the requests whose first token came in the window trends up the same way:
   t >= `min_t` and a rise of at least `min_ttft_growth` of the fitted TTFT at the window's
   start.

Both, because either alone is ambiguous: in-flight grows when the load ramps up at a rate the
server sustains (TTFT flat), and TTFT drifts up with longer prompts (in-flight flat). A load
the server sustains keeps in-flight around a level, with noise, however high: its slope over a
window is small against that level and changes sign between quarters.

The class is pure (fed numbers, asked for a verdict) so that it is tested on series made up to
order; the driver samples in-flight every `window_s / 40` and feeds each first token's TTFT.

The defaults (a 20 s window, 10 s minimum, t >= 4) were set on a scripted server of 4 slots at
20 requests/s, Poisson arrivals (tests/harness/running/test_driver_bounds.py): at 90% of its
capacity, where the queue wanders for tens of seconds, no verdict in 6 runs of 120 s (a 10 s
window and t >= 3 gave one in every run); at 110% a verdict 16 to 33 s in, at 200% 15.5 s in.
`waiting` (the engine's queue, where step records report it) is kept beside in-flight for the
evidence, not the decision: every backend can be judged alike.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.options import option
from harness.config_section import ConfigSection, holds_a_float

#: Samples of in-flight per window: enough for the quarters and the slope's error, few enough
#: that sampling costs nothing.
SAMPLES_PER_WINDOW = 40
#: The fewest TTFTs in the window before their trend counts.
MIN_TTFT_POINTS = 8


@dataclass(frozen=True)
class SaturationConfig(ConfigSection):
    """`run.saturation`: the over-saturation detector's thresholds (harness/running/saturation.py;
    used when `run.stop_on_saturation` is true)."""

    section = "run.saturation"

    window_s: float = option(
        20.0, gt=0, unit="seconds", valid=holds_a_float, help="the trailing window the trends fit"
    )
    min_duration_s: float = option(
        10.0,
        ge=0,
        unit="seconds",
        valid=holds_a_float,
        help="no verdict sooner after the run's start (the first window fills meanwhile too)",
    )
    min_t: float = option(
        4.0,
        gt=0,
        valid=holds_a_float,
        help="the t statistic (slope / its standard error) both trends must reach",
    )
    min_growth: float = option(
        0.25,
        gt=0,
        valid=holds_a_float,
        help="in-flight must rise over the window by this fraction of its level at the start",
    )
    min_ttft_growth: float = option(
        0.5,
        gt=0,
        valid=holds_a_float,
        help="TTFT must rise over the window by this fraction of its fitted start",
    )

    def _check_together(self) -> None:
        self._keep_floats("window_s", "min_duration_s", "min_t", "min_growth", "min_ttft_growth")

    @property
    def sample_interval_s(self) -> float:
        return self.window_s / SAMPLES_PER_WINDOW


@dataclass(frozen=True)
class Fit:
    """A least-squares line through (x, y): y ~ start + slope * (x - x0) over [x0, x1]."""

    slope: float
    t: float  # slope / its standard error (inf for a noiseless rise)
    start: float  # fitted y at x0
    end: float  # fitted y at x1

    def as_dict(self) -> dict[str, float | None]:
        return {k: _finite(v) for k, v in vars(self).items()}


def fit(xs: list[float], ys: list[float]) -> Fit | None:
    """The least-squares line, or None with fewer than 3 points or no spread in x."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(residual / (n - 2) / sxx)
    # a noiseless line is infinitely significant, unless flat
    t = slope / se if se > 0 else (math.copysign(math.inf, slope) if slope else 0.0)
    x0, x1 = min(xs), max(xs)
    return Fit(slope, t, my + slope * (x0 - mx), my + slope * (x1 - mx))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class SaturationDetector:
    """Fed the run's in-flight samples and first tokens (times in seconds since the start);
    `saturated(now)` is the evidence once both trends hold, else None."""

    def __init__(self, config: SaturationConfig) -> None:
        self.config = config
        # (time, in flight, waiting or None) and (time of the first token, TTFT)
        self.samples: deque[tuple[float, int, int | None]] = deque()
        self.ttfts: deque[tuple[float, float]] = deque()

    def sample(self, time_s: float, in_flight: int, waiting: int | None = None) -> None:
        self.samples.append((time_s, in_flight, waiting))

    def first_token(self, time_s: float, ttft_s: float) -> None:
        self.ttfts.append((time_s, ttft_s))

    def _trim(self, now: float) -> float:
        start = now - self.config.window_s
        for series in (self.samples, self.ttfts):
            while series and series[0][0] < start:
                series.popleft()
        return start

    def saturated(self, now: float) -> dict[str, Any] | None:
        """The evidence (JSON-like) when the server has stopped keeping up, else None."""
        cfg = self.config
        start = self._trim(now)
        if now < cfg.min_duration_s or len(self.samples) < SAMPLES_PER_WINDOW // 2:
            return None
        if self.samples[0][0] > start + cfg.window_s / 4:  # the window is not full yet
            return None
        times = [s[0] for s in self.samples]
        counts = [float(s[1]) for s in self.samples]
        load = fit(times, counts)
        if load is None or not self._grows(load, cfg.min_growth, absolute=2.0):
            return None
        middle = start + cfg.window_s / 2
        halves = [
            fit(*_within(times, counts, lambda t: t < middle)),
            fit(*_within(times, counts, lambda t: t >= middle)),
        ]
        if any(half is None or half.t < cfg.min_t or half.slope <= 0 for half in halves):
            return None
        if len(self.ttfts) < MIN_TTFT_POINTS:
            return None
        ttft = fit([t for t, _ in self.ttfts], [v for _, v in self.ttfts])
        if ttft is None or not self._grows(ttft, cfg.min_ttft_growth, absolute=0.0):
            return None
        waiting = [(t, w) for t, _, w in self.samples if w is not None]
        waiting_fit = fit([t for t, _ in waiting], [float(w) for _, w in waiting])
        return {
            "detected_at_s": now,
            "window_s": [max(start, 0.0), now],
            "in_flight": {
                **load.as_dict(),
                "halves": [half.as_dict() for half in halves if half is not None],
            },
            "ttft_s": {**ttft.as_dict(), "points": len(self.ttfts)},
            "waiting": waiting_fit.as_dict() if waiting_fit is not None else None,
            "thresholds": {
                "window_s": cfg.window_s,
                "min_duration_s": cfg.min_duration_s,
                "min_t": cfg.min_t,
                "min_growth": cfg.min_growth,
                "min_ttft_growth": cfg.min_ttft_growth,
            },
        }

    def _grows(self, line: Fit, ratio: float, absolute: float) -> bool:
        """A significant rise of at least `ratio` of the start (and `absolute`) over the fit.
        A start below zero (a steep line through small values) counts from zero."""
        rise = line.end - line.start
        return line.t >= self.config.min_t and rise >= max(absolute, ratio * max(line.start, 0))


def _within(
    times: list[float], values: list[float], keep: Callable[[float], bool]
) -> tuple[list[float], list[float]]:
    pairs = [(t, v) for t, v in zip(times, values, strict=True) if keep(t)]
    return [t for t, _ in pairs], [v for _, v in pairs]
