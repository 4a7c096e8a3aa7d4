"""Is the gate's percentile bootstrap as well calibrated as scipy's BCa at small run counts?

A simulation study (issue 16, item 10): per-run values of a throughput metric are drawn from
noise models fitted to this machine's gate validations (docs/benchmarks.md), and for run
counts n (per side, or A/B rounds) the script counts, over seeded trials,

- A/A (both sides from one distribution, so every interval that excludes 1 is a false
  positive): how often the 95% interval excludes 1 (nominal 5%), how often the gate's verdict
  (default min_effect 0.10, min_samples lowered to 2 so that n=3 is judged too) is a false
  regression, and how often it passes;
- planted slowdowns (the candidate's tokens/s times 1 - s, s = 5%, 10%, 20%): how often the
  interval lies wholly below 1 (detected), and, at 20%, how often the gate says regression.

Both methods get the same data and the same number of resamples. "ours" is
harness.gating.stats (bootstrap_paired / bootstrap_ratio, the gate's own code); "BCa" is
scipy.stats.bootstrap(method="BCa") on the same log values and statistic (geometric mean).

Noise models (log of a run's tokens/s, sigma = --sigma):
- lognormal: N(0, sigma) per run. The rates at a given n do not depend on sigma for this model
  (both intervals move and scale with the data), only the power does.
- skewed: lognormal, and one run in ten is slowed further by a factor exp(-E), E exponential
  with mean 3 sigma (a shared machine's occasional slow run).
- offset: lognormal, plus one offset per trial on the candidate side, N(0, 1.4%) in logs: the
  worker-to-worker difference measured in the 2026-11-30 validation (A/A gate ratios spread
  with sd 1.5% where 9 rounds of 2% noise give 0.7%). No bootstrap can see it; it is why the
  gate has a minimum effect.

For the percentile interval the slowdown trials reuse the A/A draws shifted by log(1 - s):
the interval is shift-equivariant (checked on every cell's first trials). BCa is recomputed on
the shifted data, since its bias correction counts ties that rounding can break. scipy is
called on a block of trials at once (rows of one call share their resample indices; each block
has its own seed), which is what keeps the run short.

    .venv/bin/python scripts/bootstrap_calibration.py                # ~1-2 min, prints a table
    .venv/bin/python scripts/bootstrap_calibration.py --trials 500   # quicker, rougher
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.gating.stats import (
    BootstrapSettings,
    RatioEstimate,
    bootstrap_paired,
    bootstrap_ratio,
    decide,
)

try:
    from scipy import stats
except ImportError:  # scipy is in the dev extra only: the gate itself does not use it
    sys.exit("bootstrap_calibration.py needs scipy: .venv/bin/pip install -e '.[dev]'")

MODELS = ("lognormal", "skewed", "offset")
DESIGNS = ("paired", "unpaired")
SLOWDOWNS = (0.05, 0.10, 0.20)
MIN_EFFECT = 0.10  # the gate's default rule
WORKER_OFFSET_SD = 0.014  # measured, see the module docstring
BLOCK = 100  # trials per scipy call


def draw(rng: np.random.Generator, model: str, sigma: float, shape: tuple[int, int]) -> np.ndarray:
    """Log values of runs, `shape` = (trials, n)."""
    logs = rng.normal(0.0, sigma, shape)
    if model == "skewed":
        slow = rng.random(shape) < 0.1
        logs -= slow * rng.exponential(3.0 * sigma, shape)
    return logs


def samples(
    rng: np.random.Generator, model: str, design: str, n: int, trials: int, sigma: float
) -> tuple[np.ndarray, np.ndarray]:
    """(baseline logs, candidate logs) of A/A trials; paired rounds are a[k], b[k]."""
    base, cand = draw(rng, model, sigma, (trials, n)), draw(rng, model, sigma, (trials, n))
    if model == "offset":
        cand = cand + rng.normal(0.0, WORKER_OFFSET_SD, (trials, 1))
    return base, cand


def ours(base: np.ndarray, cand: np.ndarray, design: str, resamples: int) -> np.ndarray:
    """The gate's interval for every trial, as log(low), log(high)."""
    out = np.empty((len(base), 2))
    for t in range(len(base)):
        settings = BootstrapSettings(resamples=resamples, seed=t)
        if design == "paired":
            est = bootstrap_paired(np.exp(cand[t] - base[t]).tolist(), settings)
        else:
            est = bootstrap_ratio(np.exp(base[t]).tolist(), np.exp(cand[t]).tolist(), settings)
        out[t] = math.log(est.low), math.log(est.high)
    return out


def bca(base: np.ndarray, cand: np.ndarray, design: str, resamples: int, seed: int) -> np.ndarray:
    """scipy's BCa interval of the same statistic for every trial (NaN where scipy gives none)."""

    def diff(b: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(c.mean(axis=axis) - b.mean(axis=axis))

    out = np.empty((len(base), 2))
    for start in range(0, len(base), BLOCK):
        rows = slice(start, start + BLOCK)
        data: tuple[np.ndarray, ...]
        stat: Callable[..., np.ndarray]
        if design == "paired":
            data, stat = (cand[rows] - base[rows],), np.mean
        else:
            data, stat = (base[rows], cand[rows]), diff
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # degenerate rows come back as NaN, counted below
            res = stats.bootstrap(
                data,
                stat,
                n_resamples=resamples,
                method="BCa",
                axis=-1,
                rng=np.random.default_rng([seed, start]),
            )
        out[rows, 0] = res.confidence_interval.low
        out[rows, 1] = res.confidence_interval.high
    return out


def rates(intervals: dict[float, np.ndarray], point: dict[float, np.ndarray]) -> dict[str, float]:
    """The table's columns for one method from its log intervals per slowdown (0 = A/A)."""
    aa = intervals[0.0]
    ok = np.isfinite(aa).all(axis=1)
    row: dict[str, float] = {"no CI": 1.0 - ok.mean()}
    row["A/A excl 1"] = float(((aa[:, 0] > 0) | (aa[:, 1] < 0))[ok].mean())
    verdicts = [gate_verdict(p, lo, hi) for p, (lo, hi) in zip(point[0.0], aa, strict=True)]
    row["A/A fail"] = float(np.mean([v == "regression" for v in verdicts]))
    row["A/A pass"] = float(np.mean([v in ("pass", "improved") for v in verdicts]))
    for s in SLOWDOWNS:
        row[f"det {s:.0%}"] = float((intervals[s][:, 1] < 0).mean())  # NaN counts as missed
    caught = [
        gate_verdict(p, lo, hi) == "regression"
        for p, (lo, hi) in zip(point[0.20], intervals[0.20], strict=True)
    ]
    row["gate 20%"] = float(np.mean(caught))
    return row


def gate_verdict(point: float, low: float, high: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return "inconclusive"  # what the gate would have to say without an interval
    est = RatioEstimate(math.exp(point), math.exp(low), math.exp(high), 2, 2, paired=True)
    return decide(est, "higher", MIN_EFFECT, min_samples=2)[0]


def cell(
    model: str, design: str, n: int, args: argparse.Namespace, seed: int
) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    base, cand = samples(rng, model, design, n, args.trials, args.sigma)
    ours_aa = ours(base, cand, design, args.resamples)
    ours_ci, bca_ci, point = {0.0: ours_aa}, {}, {}
    for s in (0.0, *SLOWDOWNS):
        shifted = cand + math.log(1.0 - s)
        point[s] = (shifted - base).mean(axis=1)
        bca_ci[s] = bca(base, shifted, design, args.resamples, seed)
        if s:
            ours_ci[s] = ours_aa + math.log(1.0 - s)
            check = ours(base[:3], shifted[:3], design, args.resamples)
            assert np.allclose(check, ours_ci[s][:3], rtol=0, atol=1e-12), (model, design, n, s)
    return {"ours": rates(ours_ci, point), "BCa": rates(bca_ci, point)}


def degenerate_cases() -> list[str]:
    """What each method does with samples the gate can be handed (n = 1, all values equal)."""
    lines = []
    settings = BootstrapSettings(resamples=2000)
    for label, values in (("n=1", [1.0]), ("n=2", [1.0, 1.1]), ("all equal, n=5", [1.0] * 5)):
        est = bootstrap_paired(values, settings)
        logs = np.log(values)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                res = stats.bootstrap((logs,), np.mean, n_resamples=2000, method="BCa", rng=0)
                ci = np.exp([res.confidence_interval.low, res.confidence_interval.high])
                got = f"[{ci[0]:.3f}, {ci[1]:.3f}]"
            except ValueError as exc:
                got = f"ValueError: {exc}"
        warned = f" + {caught[-1].category.__name__}" if caught else ""
        lines.append(f"  {label}: ours [{est.low:.3f}, {est.high:.3f}]; BCa {got}{warned}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2000, help="trials per cell (2000)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (2000)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 5, 8, 10])
    parser.add_argument("--sigma", type=float, default=0.05, help="per-run log sd (0.05)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    columns = ["no CI", "A/A excl 1", "A/A fail", "A/A pass"]
    columns += [f"det {s:.0%}" for s in SLOWDOWNS] + ["gate 20%"]
    print(
        f"{args.trials} trials per cell, {args.resamples} resamples, sigma {args.sigma}, "
        f"geomean, 95% two-sided; gate: min_effect {MIN_EFFECT}, min_samples 2"
    )
    print("| model | design | n | method | " + " | ".join(columns) + " |")
    print("| --- | --- | ---: | --- | " + " | ".join("---:" for _ in columns) + " |")
    for m, model in enumerate(args.models):
        for d, design in enumerate(DESIGNS):
            for n in args.sizes:
                result = cell(model, design, n, args, seed=args.seed * 1000 + m * 100 + d * 20 + n)
                for method, row in result.items():
                    figures = " | ".join(f"{100 * row[c]:.1f}" for c in columns)
                    print(f"| {model} | {design} | {n} | {method} | {figures} |", flush=True)
    print("(percentages; 'no CI': scipy returned NaN, counted as inconclusive / not detected)")
    print("Degenerate samples:")
    print("\n".join(degenerate_cases()))
    print(f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
