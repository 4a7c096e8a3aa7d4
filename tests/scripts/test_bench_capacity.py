"""scripts/bench_capacity.py: how a dense grid of rates is read (the answer the capacity
search is compared with, issue 37), and what the script refuses before it runs anything."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_capacity.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("bench_capacity")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def point(bench: Any, rate: float, headroom: float | None) -> Any:
    """A grid run at `rate` whose worst SLO headroom (bound / value) is `headroom`; None: a
    run with no value (failed, saturated), a miss."""
    if headroom is None:
        return bench.GridPoint(rate, False, None)
    return bench.GridPoint(rate, headroom >= 1, math.log(headroom))


def test_the_crossing_is_interpolated_between_the_highest_meet_and_the_next_rate(
    bench: Any,
) -> None:
    # headroom 1.2 at 2.0 and 0.8 at 3.0: crosses 1 half way
    grid = [point(bench, r, h) for r, h in [(1.0, 2.0), (2.0, 1.2), (3.0, 0.8), (4.0, 0.5)]]
    got = bench.read_grid(list(reversed(grid)))  # the order given does not matter
    assert got["outcome"] == "found"
    assert got["meets_rate"] == 2.0 and got["misses_rate"] == 3.0
    assert got["answer"] == pytest.approx(2.5)
    assert got["misses_below"] == []
    assert got["conservative_answer"] == pytest.approx(2.5)


def test_a_noisy_grid_is_read_at_its_highest_meet_and_says_so(bench: Any) -> None:
    grid = [point(bench, r, h) for r, h in [(1.0, 2.0), (2.0, 0.9), (3.0, 1.1), (4.0, 0.9)]]
    got = bench.read_grid(grid)
    assert got["answer"] == pytest.approx(3.5) and got["meets_rate"] == 3.0
    assert got["misses_below"] == [2.0]
    # the search's own bracket rule: below the lowest miss (headroom 2 at 1, 0.9 at 2)
    assert got["conservative_answer"] == pytest.approx(1 + 1 / 1.1)


def test_a_miss_without_a_value_leaves_the_meeting_rate(bench: Any) -> None:
    got = bench.read_grid([point(bench, 1.0, 1.5), point(bench, 2.0, None)])
    assert got["outcome"] == "found" and got["answer"] == 1.0
    assert "no SLO value" in got["how"]


@pytest.mark.parametrize(
    ("headrooms", "outcome", "answer"),
    [
        ([1.5, 1.2, 1.1], "above_grid", 3.0),  # every rate meets: at least the highest
        ([0.9, 0.8, 0.7], "below_grid", None),
        ([], "empty", None),
    ],
)
def test_a_grid_without_a_crossing(
    bench: Any, headrooms: list[float], outcome: str, answer: float | None
) -> None:
    got = bench.read_grid([point(bench, i + 1.0, h) for i, h in enumerate(headrooms)])
    assert got["outcome"] == outcome and got["answer"] == answer


def test_grid_rates_span_both_ends(bench: Any) -> None:
    rates = bench.grid_rates(0.497, 3.135, 12)
    assert len(rates) == 12 and rates[0] == 0.497 and rates[-1] == 3.135


def test_combine_keeps_each_key_once_the_last_given(bench: Any) -> None:
    got = bench.combine("workload.num_requests=32", "model=small", "workload.num_requests=8")
    assert got == ["model=small", "workload.num_requests=8"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["grid-vs-search", "workload.arrival.rate=3"], "set by the script"),
        (["grid-vs-search", "--slo", "ttft_p99_s <= 1", "--slo", "ttft_p99_s >= 2"], "--slo:"),
        (["grid-vs-search", "--target", "llamacpp-server", "--model", "tiny"], "--model"),
        (["saturation", "--rate", "1", "--search-json", "x.json"], "give one"),
        (["guidellm", "engine=openai"], "a server target runs engine=openai"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done
    assert said in done.stderr.strip().splitlines()[-1]
