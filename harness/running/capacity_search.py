"""The capacity search (`run.search`): the highest load (request rate, or concurrency) at which
a run still meets an SLO, as guidellm's `sweep` profile and vLLM's `bench sweep serve_sla`
find it. Pure: no Hydra, no files. The caller measures (harness/running/capacity_sweep.py
launches sweep jobs; the tests use synthetic curves) and this module decides what to measure
next and what the answer is.

The search, for SLO checks C (harness/measuring/checks.py):

1. Two bounding runs: the low one (synchronous: a closed loop of one request at a time) and
   the high one (throughput: every request at once). For `over=rate` their achieved request
   rates are the range; for `over=concurrency`, 1 .. num_requests. `min_load`/`max_load`
   replace them with runs at those loads. Low misses C: `below_range`. High meets C:
   `above_range` (the answer is at least the high run's load).
2. Narrowing, between the highest load that meets and the lowest that misses: each measured
   point has a slack, the worst over C of log(bound / value) (lower-is-better metrics; its
   inverse for higher-is-better ones), >= 0 where the point meets. The slack is interpolated
   linearly against log(load) between the bracket's two points; the guess is clamped away
   from the bracket's ends (a curve that bends near saturation would otherwise creep up on the
   crossing by tiny steps, as regula falsi does) and set a little below the crossing, since the
   answer is the highest load *measured* to meet. A point without a slack (failed, saturated)
   is bisected in log space. It stops when (miss - meet) / meet <= tolerance (for concurrency:
   the two are adjacent integers) or after max_points runs, the bounding ones included.
3. For `over=rate`, a bracket that ends at a bounding run is measured once more at that
   run's rate with Poisson arrivals: the synchronous loop and the burst only stand in for
   that load until then (a server without batching meets an SLO one request at a time that
   Poisson arrivals at the same rate miss; a short workload's Poisson run can meet an SLO its
   burst misses). A miss at the low end halves the rate down to a meet (none within
   max_points: `below_range`); a meet at the high end is `above_range`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from harness.measuring.checks import Check, failed_checks

Over = Literal["rate", "concurrency"]
OVER: tuple[Over, ...] = ("rate", "concurrency")
Role = Literal["low", "high", "between"]
ANSWER_KEY: dict[str, str] = {"rate": "max_rate_at_slo", "concurrency": "max_concurrency_at_slo"}
UNIT: dict[str, str] = {"rate": "req/s", "concurrency": "requests"}
#: the least share of the bracket's (log) width an interpolated guess keeps from either end
_MARGIN = 0.15
#: how far below the interpolated crossing a guess aims, as a share of the tolerance; the
#: last run further, as what it would leave as the answer otherwise is the last meet
_UNDERSHOOT = 0.4
_LAST_UNDERSHOOT = 0.7


@dataclass(frozen=True)
class Probe:
    """A run the search asks for. `load` None: the bounding run of its role at its natural
    load (low: synchronous; high: throughput), whose load the run measures."""

    role: Role
    load: float | None = None


@dataclass(frozen=True)
class Measurement:
    """What a run of a probe gave: its status and error, its metrics (a summary's `metrics`),
    whether it was stopped as saturated, its job (a name for the output), and the requests
    it lost: failed, or cut by a run bound (run.max_duration_s) before they finished."""

    status: str
    metrics: Mapping[str, Any] = field(default_factory=dict)
    saturated: bool = False
    error: str | None = None
    job: str = ""
    failed_requests: int = 0
    cut_requests: int = 0


@dataclass(frozen=True)
class Point:
    """One measured run as the search sees it."""

    probe: Probe
    load: float | None  # None: not known (a failed throughput run, over=rate)
    meets: bool
    slack: float | None  # None: nothing to interpolate on
    failed: list[str]  # the checks it missed, each with its value; or why it counts as missed
    measurement: Measurement


def slack(checks: Sequence[Check], metrics: Mapping[str, Any]) -> float | None:
    """The worst log margin over the checks: log(bound / value) for a lower-is-better check,
    log(value / bound) for a higher-is-better one; >= 0 where all hold. None where a value is
    missing or not positive (no log to take)."""
    worst = math.inf
    for check in checks:
        value = metrics.get(check.metric)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        if not (math.isfinite(value) and value > 0 and check.bound > 0):
            return None
        margin = math.log(check.bound / value)
        worst = min(worst, margin if check.lower_is_better else -margin)
    return worst if math.isfinite(worst) else None


def judge(probe: Probe, load: float | None, checks: Sequence[Check], got: Measurement) -> Point:
    """The point a measurement makes: it meets the SLO only as a complete, unsaturated run
    that lost no request and whose metrics pass every check (the latencies count completed
    requests only: a run whose slowest requests failed or were cut would look faster)."""
    if got.status != "complete":
        why = f"run {got.status}" + (f": {' '.join(str(got.error).split())}" if got.error else "")
        return Point(probe, load, False, None, [why], got)
    missed = failed_checks(tuple(checks), got.metrics)
    lost = []
    if got.saturated:
        lost.append("run stopped as saturated")
    if got.failed_requests:
        lost.append(f"{got.failed_requests} request(s) failed")
    if got.cut_requests:
        lost.append(f"{got.cut_requests} request(s) cut by a run bound")
    if lost:
        return Point(probe, load, False, None, [*missed, *lost], got)
    return Point(probe, load, not missed, slack(checks, got.metrics), missed, got)


def bracket(points: Sequence[Point]) -> tuple[Point | None, Point | None]:
    """(the highest load that meets below the lowest that misses, the lowest that misses).
    A point that meets above a miss (noise near the crossing) is not trusted: the answer stays
    below every measured miss."""
    # over=rate, a narrowing run at a bounding run's load measured what that run only stood
    # in for (the synchronous loop, the burst): Poisson arrivals at that rate
    remeasured = {p.load for p in points if p.probe.role == "between"}
    known = [
        p
        for p in points
        if p.load is not None and not (p.probe.role != "between" and p.load in remeasured)
    ]
    misses = [p for p in known if not p.meets]
    high = min(misses, key=lambda p: p.load or 0.0) if misses else None
    meets = [p for p in known if p.meets and (high is None or (p.load or 0.0) < (high.load or 0.0))]
    low = max(meets, key=lambda p: p.load or 0.0) if meets else None
    return low, high


def narrow_enough(low: float, high: float, tolerance: float, integer: bool) -> bool:
    """Whether the bracket [low, high) is as narrow as asked."""
    if integer and high - low <= 1:
        return True
    return (high - low) / low <= tolerance


def _streaks(points: Sequence[Point]) -> tuple[int, int]:
    """How many of the last narrowing runs in a row met the SLO, and how many missed it (one
    of the two is 0): the bracket's other end has stayed put that many times."""
    met = missed = 0
    for point in points:
        if point.probe.role != "between":
            continue
        met, missed = (met + 1, 0) if point.meets else (0, missed + 1)
    return met, missed


def _guess(
    points: Sequence[Point], low: Point, high: Point, tolerance: float, last: bool, integer: bool
) -> float:
    """Where the SLO's crossing likely is, from the bracket's two slacks. For a request rate
    the headroom exp(slack) (bound / value) is interpolated linearly in load: under a queue's
    latency, base / (1 - load / capacity), it is linear in load, so one step lands on the
    crossing where the slack itself (or log load) bends sharply near saturation."""
    assert low.load is not None and high.load is not None
    if low.slack is not None and high.slack is not None and low.slack > high.slack:
        # the Illinois rule: an end that stayed put while the other moved has its excess
        # halved each time, or a curve that bends keeps every guess beside one end (regula
        # falsi's slow side)
        met, missed = _streaks(points)
        # headroom - 1 (> 0 meets, < 0 misses), or for a closed loop 1 - value / bound: by
        # Little's law its latency grows linearly with the concurrency once the server is
        # busy, so that value / bound is the one linear in load there
        sign = -1.0 if integer else 1.0
        e_low = sign * math.expm1(sign * low.slack) * 0.5**missed
        e_high = sign * math.expm1(sign * high.slack) * 0.5**met
        t = e_low / (e_low - e_high)
        x = low.load + t * (high.load - low.load)
        # the answer is a load measured to meet: aim below
        x *= 1 - (_LAST_UNDERSHOOT if last else _UNDERSHOOT) * tolerance
        margin = _MARGIN * (high.load - low.load)
        return min(max(x, low.load + margin), high.load - margin)
    return math.sqrt(low.load * high.load)  # nothing to interpolate on: bisect in log space


def next_loads(
    points: Sequence[Point], *, tolerance: float, budget: int, parallel: int, integer: bool
) -> list[float]:
    """The loads to measure next (up to min(parallel, budget), none when done): inside the
    bracket, first the interpolated guess, then the midpoints (in log space) of the widest
    gaps left between it and the measured loads."""
    low, high = bracket(points)
    if low is None and high is not None and high.load is not None and budget > 0:
        # Poisson arrivals missed at the synchronous run's rate: halve down to a meet
        return [float(f"{high.load / 2**k:.4g}") for k in range(1, min(parallel, budget) + 1)]
    if low is None or high is None or budget <= 0:
        return []
    assert low.load is not None and high.load is not None
    if narrow_enough(low.load, high.load, tolerance, integer):
        return []
    guess = _guess(points, low, high, tolerance, last=budget == 1, integer=integer)
    chosen = [guess]
    while len(chosen) < min(parallel, budget):
        # several at once: the (log) midpoint of the widest gap left
        edges = sorted([low.load, *chosen, high.load])
        gaps = [(math.log(b / a), a, b) for a, b in itertools.pairwise(edges)]
        _, a, b = max(gaps)
        chosen.append(math.sqrt(a * b))
    if integer:
        chosen = [float(min(max(round(x), int(low.load) + 1), int(high.load) - 1)) for x in chosen]
    else:  # four digits: a load that reads well and repeats exactly when a sweep resumes
        chosen = [float(f"{x:.4g}") for x in chosen]
    measured = {p.load for p in points}
    return sorted({x for x in chosen if x not in measured})


def _stand_in(points: Sequence[Point], over: Over) -> float | None:
    """The load to measure once more when the search has narrowed against a bounding run at
    its natural load (over=rate): the synchronous run sent one request at a time and the
    throughput run every request at once, so they say how those fare, not Poisson arrivals at
    their achieved rates, which the answer is about. The low end first (a miss there moves the
    search below it). None: nothing to redo."""
    if over != "rate":
        return None
    low, high = bracket(points)
    if low is not None and low.probe.role == "low" and low.probe.load is None:
        return low.load
    if high is not None and high.probe.role == "high" and high.probe.load is None:
        return high.load if high.slack is not None else None
    return None


@dataclass
class SearchResult:
    over: Over
    checks: list[Check]
    outcome: Literal["found", "below_range", "above_range", "failed"]
    answer: float | None  # the highest load measured to meet; None unless found or above range
    low: Point | None  # the bracket: the point the answer is, and the lowest miss above it
    high: Point | None
    points: list[Point]
    note: str


Measure = Callable[[list[Probe]], list[Measurement]]


@dataclass(frozen=True)
class SearchSettings:
    """What `run.search` asks, less the SLO (harness/running/run_config.py SearchConfig)."""

    over: Over = "rate"
    max_points: int = 6
    tolerance: float = 0.1
    parallel: int = 1
    min_load: float | None = None
    max_load: float | None = None


def natural_load(
    over: Over, probe: Probe, got: Measurement, num_requests: int | None
) -> float | None:
    """The load a run stood at: the one asked for; a bounding run's own for `over=rate` (its
    achieved request rate), 1 or num_requests for `over=concurrency`."""
    if probe.load is not None:
        return probe.load
    if over == "concurrency":
        return 1.0 if probe.role == "low" else float(num_requests or 0) or None
    achieved = got.metrics.get("req_per_s")
    if isinstance(achieved, int | float) and math.isfinite(achieved) and achieved > 0:
        return float(achieved)
    return None


def search(
    measure: Measure,
    checks: Sequence[Check],
    settings: SearchSettings,
    num_requests: int | None = None,
) -> SearchResult:
    """Run the search, measuring through `measure` (a round of probes -> their measurements,
    in order). `num_requests`: the workload's, the high end of a concurrency range."""
    over = settings.over
    integer = over == "concurrency"
    points: list[Point] = []

    def run(probes: list[Probe]) -> list[Point]:
        got = measure(probes)
        new: list[Point] = []
        for probe, measured in zip(probes, got, strict=True):
            load = natural_load(over, probe, measured, num_requests)
            lows = [p.load for p in [*points, *new] if p.probe.role == "low" and p.load]
            if load is None and probe.role == "high" and lows:
                # a throughput run that failed measured no rate: bisect up to the most that
                # batching could give, num_requests times the synchronous rate
                load = lows[0] * max(2, num_requests or 2)
            new.append(judge(probe, load, checks, measured))
        points.extend(new)
        return new

    def done(outcome: Any, answer: float | None, note: str) -> SearchResult:
        low, high = bracket(points)
        return SearchResult(over, list(checks), outcome, answer, low, high, points, note)

    low_probe = Probe("low", settings.min_load)
    high_probe = Probe("high", settings.max_load)
    both = settings.parallel >= 2 and settings.max_points >= 2
    first = run([low_probe, high_probe] if both else [low_probe])
    low = first[0]
    if low.measurement.status != "complete" or low.load is None:
        error = low.measurement.error or f"the run is {low.measurement.status}"
        return done("failed", None, f"the low run ({low.measurement.job}) failed: {error}")
    unmeasured = [c.metric for c in checks if c.holds(low.measurement.metrics) is None]
    if unmeasured and not low.measurement.saturated:
        # not a load the SLO is missed at: the runs do not measure it (an engine metric such
        # as mean_batch_size against a server, a percentile the run leaves out)
        return done(
            "failed",
            None,
            f"the low run ({low.measurement.job}) has no value for "
            f"{', '.join(dict.fromkeys(unmeasured))}: its summary does not hold the metric; "
            "allowed: an SLO on metrics this backend's runs measure",
        )
    if not low.meets:
        return done(
            "below_range",
            None,
            f"even the lowest load, {low.load:.4g} {UNIT[over]}, misses the SLO ("
            + "; ".join(low.failed)
            + ")",
        )
    if settings.max_points < 2:
        return done("found", low.load, "max_points allowed only the low run")
    high = first[1] if both else run([high_probe])[0]
    if high.load is None:
        error = high.measurement.error or f"the run is {high.measurement.status}"
        return done("failed", None, f"the high run ({high.measurement.job}) failed: {error}")
    if high.load <= low.load:
        # no range between them (run.search.max_load below the synchronous run's rate,
        # min_load above the throughput run's, or a server slower under batching): the answer
        # is the highest load measured to meet, the low run's, whatever the high run did
        why = (
            f"the high run's load ({high.load:.4g} {UNIT[over]}) is no more than the low run's "
            f"({low.load:.4g}): no range to search"
        )
        if high.probe.load is not None:
            why += "; set run.search.max_load above the low run's load, or null"
        elif low.probe.load is not None:
            why += "; set run.search.min_load below the throughput run's load, or null"
        return SearchResult(
            over,
            list(checks),
            "above_range" if high.meets else "found",
            low.load,
            low,
            None if high.meets else high,
            points,
            why,
        )
    if high.meets:
        return done(
            "above_range",
            high.load,
            f"even the highest load, {high.load:.4g} {UNIT[over]}, meets the SLO: the answer is "
            "at least that",
        )
    while len(points) < settings.max_points:
        loads = next_loads(
            points,
            tolerance=settings.tolerance,
            budget=settings.max_points - len(points),
            parallel=settings.parallel,
            integer=integer,
        )
        if not loads:
            again = _stand_in(points, over)
            if again is None:
                break
            loads = [again]
        run([Probe("between", x) for x in loads])
    low_point, high_point = bracket(points)
    if low_point is None:  # Poisson arrivals missed even at the synchronous run's rate
        assert high_point is not None and high_point.load is not None
        return done(
            "below_range",
            None,
            f"Poisson arrivals miss the SLO down to {high_point.load:.4g} {UNIT[over]} ("
            + "; ".join(high_point.failed)
            + f"), though one request at a time met it at {low.load:.4g}",
        )
    assert low_point.load is not None
    if high_point is None:  # the throughput run's rate, remeasured with Poisson arrivals, met
        return done(
            "above_range",
            low_point.load,
            f"Poisson arrivals at the throughput run's rate, {low_point.load:.4g} "
            f"{UNIT[over]}, meet the SLO (the burst of every request at once did not): the "
            "answer is at least that",
        )
    width = ""
    if high_point is not None and high_point.load is not None:
        rel = (high_point.load - low_point.load) / low_point.load
        width = f"; bracket {low_point.load:.4g} .. {high_point.load:.4g} ({rel:.0%} wide)"
    return done("found", low_point.load, f"{len(points)} runs{width}")
