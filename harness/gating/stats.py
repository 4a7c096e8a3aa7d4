"""The regression gate's statistics: seeded bootstrap confidence intervals of a ratio, and the
rule that turns an interval into a verdict.

A timing metric is compared as the ratio candidate / baseline of a central value (the geometric
mean by default, or the median) over runs, never over the requests of one run: requests of one
run share that run's machine state, so their spread says nothing about run-to-run noise.

Two designs:
- unpaired (repeats on each side): resample the baseline runs and the candidate runs
  independently, with replacement, and take the ratio of the two statistics each time;
- paired (A/B rounds): one ratio per round (the candidate over the baseline run next to it in
  time), resampled as a whole, which cancels drift that both members of a round share.

The interval is the percentile bootstrap interval at `confidence`. It is narrow for small
samples; the minimum effect size is the margin that keeps that from turning noise into a
verdict. scipy's BCa interval was measured against it (scripts/bootstrap_calibration.py) and is
no better calibrated at the gate's run counts, worse with skewed run times, and has no interval
for one run or equal values, so this one stays (docs/gate.md, "Why a percentile bootstrap").

Decision rule, with `bad` the threshold 1 + min_effect (lower is better) or 1 - min_effect
(higher is better):
- fewer samples than `min_samples` on either side: inconclusive;
- the whole interval beyond `bad` (worse by more than the min effect): regression;
- the whole interval better than the opposite threshold: improved (passes);
- the whole interval on the good side of `bad` (within the min effect, or better): pass;
- otherwise (the interval straddles `bad`): inconclusive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Statistic = Literal["geomean", "median"]
Verdict = Literal["pass", "improved", "regression", "inconclusive"]
STATISTICS: tuple[str, ...] = ("geomean", "median")


@dataclass(frozen=True)
class BootstrapSettings:
    statistic: Statistic = "geomean"
    confidence: float = 0.95
    resamples: int = 10_000
    seed: int = 0


@dataclass(frozen=True)
class RatioEstimate:
    """candidate / baseline: the point estimate and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    n_baseline: int
    n_candidate: int
    paired: bool


def _center(logs: np.ndarray, statistic: Statistic, axis: int = -1) -> np.ndarray:
    # Both statistics are taken on log values: the geometric mean is exp(mean(log x)), and the
    # median commutes with the (monotonic) log, so ratios become differences.
    if statistic == "geomean":
        return logs.mean(axis=axis)
    return np.median(logs, axis=axis)


def _logs(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"{what}: need a non-empty list of numbers")
    if not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise ValueError(f"{what}: ratios need finite positive values, got {array.tolist()}")
    return np.log(array)


def _interval(diffs: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    return float(np.exp(low)), float(np.exp(high))


def bootstrap_ratio(
    baseline: Sequence[float], candidate: Sequence[float], settings: BootstrapSettings
) -> RatioEstimate:
    """Unpaired: the ratio of the candidate's statistic to the baseline's, over runs."""
    base, cand = _logs(baseline, "baseline"), _logs(candidate, "candidate")
    rng = np.random.default_rng(settings.seed)
    base_idx = rng.integers(0, len(base), size=(settings.resamples, len(base)))
    cand_idx = rng.integers(0, len(cand), size=(settings.resamples, len(cand)))
    diffs = _center(cand[cand_idx], settings.statistic) - _center(
        base[base_idx], settings.statistic
    )
    point = float(np.exp(_center(cand, settings.statistic) - _center(base, settings.statistic)))
    low, high = _interval(diffs, settings.confidence)
    return RatioEstimate(point, low, high, len(base), len(cand), paired=False)


def bootstrap_paired(ratios: Sequence[float], settings: BootstrapSettings) -> RatioEstimate:
    """Paired: the statistic of per-round ratios candidate / baseline."""
    logs = _logs(ratios, "paired ratios")
    rng = np.random.default_rng(settings.seed)
    idx = rng.integers(0, len(logs), size=(settings.resamples, len(logs)))
    diffs = _center(logs[idx], settings.statistic)
    point = float(np.exp(_center(logs, settings.statistic)))
    low, high = _interval(diffs, settings.confidence)
    return RatioEstimate(point, low, high, len(logs), len(logs), paired=True)


def decide(
    estimate: RatioEstimate, better: Literal["lower", "higher"], min_effect: float, min_samples: int
) -> tuple[Verdict, str]:
    """The verdict for one timing metric and a short reason (see the module docstring)."""
    n = min(estimate.n_baseline, estimate.n_candidate)
    if n < min_samples:
        unit = (
            ("round" if n == 1 else "rounds")
            if estimate.paired
            else ("run per side" if n == 1 else "runs per side")
        )
        why = f"{n} {unit} < min_samples {min_samples}"
        if n == 1 and not estimate.paired:
            why = "one run per side: a timing comparison cannot be conclusive"
        return "inconclusive", why
    if better == "lower":  # larger ratios are worse
        worst, best = estimate.high, estimate.low
        bad, good = 1.0 + min_effect, 1.0 - min_effect
        if best > bad:
            return "regression", f"CI above {bad:.3g}"
        if worst < good:
            return "improved", f"CI below {good:.3g}"
        if worst <= bad:
            return "pass", f"CI below {bad:.3g}"
        return "inconclusive", f"CI straddles {bad:.3g}"
    worst, best = estimate.low, estimate.high
    bad, good = 1.0 - min_effect, 1.0 + min_effect
    if best < bad:
        return "regression", f"CI below {bad:.3g}"
    if worst > good:
        return "improved", f"CI above {good:.3g}"
    if worst >= bad:
        return "pass", f"CI above {bad:.3g}"
    return "inconclusive", f"CI straddles {bad:.3g}"
