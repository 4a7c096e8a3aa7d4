"""Arrival processes: rates and burstiness within statistical tolerances, seeds, the open
loop's cap on the requests in flight, spec errors.

Tolerances come from each process's coefficient of variation (CV), never fixed percentages:
with n gaps of mean 1/rate and CV c, the sample mean gap has standard error c / (rate sqrt(n)),
and we allow 5 standard errors (a false failure has probability ~6e-7 per assertion; the seeds
are fixed anyway, so the tests are deterministic).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from workloads import PromptsWorkload, SyntheticWorkload, TraceWorkload
from workloads.arrivals import arrival_times, concurrency_of, max_concurrency_of, parse_arrival

N = 20_000  # requests; N - 1 gaps


def gaps(spec: dict, n: int = N, seed: int = 0) -> np.ndarray:
    times = arrival_times(spec, n, np.random.default_rng(seed))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    return np.diff(times)


@pytest.mark.parametrize(
    ("spec", "cv"),
    [
        ({"process": "poisson", "rate": 5.0}, 1.0),
        ({"process": "poisson", "rate": 0.3}, 1.0),
        ({"process": "gamma", "rate": 8.0, "burstiness": 0.25}, 2.0),
        ({"process": "gamma", "rate": 8.0, "burstiness": 1.0}, 1.0),
        ({"process": "gamma", "rate": 2.0, "burstiness": 4.0}, 0.5),
    ],
)
def test_mean_rate_within_cv_derived_tolerance(spec: dict, cv: float) -> None:
    g = gaps(spec)
    rate = spec["rate"]
    standard_error = cv / (rate * math.sqrt(len(g)))
    assert abs(g.mean() - 1 / rate) < 5 * standard_error
    # The offered rate as the harness reports it: (n - 1) gaps over the span.
    span = g.sum()
    assert abs(len(g) / span - rate) < 5 * standard_error * rate**2  # d(1/x) = dx / x^2


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness: float) -> None:
    g = gaps({"process": "gamma", "rate": 3.0, "burstiness": burstiness})
    n = len(g)
    cv = g.std(ddof=1) / g.mean()
    # Standard error of the sample CV by the delta method on log(s / m):
    # Var(log CV) ~ [(kurtosis - 1) / 4 + CV^2 - skewness * CV] / n. For gamma gaps with shape
    # k = burstiness: CV = 1/sqrt(k), skewness = 2/sqrt(k), kurtosis = 3 + 6/k, so
    # Var(log CV) ~ (1 + 1/k) / (2n) and SE(CV) ~ sqrt((1 + 1/k) / (2 k n)). (Checked against
    # 4000 simulated samples per shape: within 2% of the simulated spread.)
    k = burstiness
    standard_error = math.sqrt((1 + 1 / k) / (2 * k * n))
    assert abs(cv - 1 / math.sqrt(k)) < 5 * standard_error


def test_burstiness_orders_the_cv() -> None:
    cvs = [
        np.std(g) / np.mean(g)
        for g in (
            gaps({"process": "gamma", "rate": 1.0, "burstiness": b}, n=5000) for b in (0.2, 1, 5)
        )
    ]
    assert cvs[0] > cvs[1] > cvs[2]


def test_offline_and_closed_are_all_zero() -> None:
    rng = np.random.default_rng(0)
    assert not arrival_times({"process": "offline"}, 10, rng).any()
    assert not arrival_times(None, 10, rng).any()
    assert not arrival_times({"process": "closed", "concurrency": 3}, 10, rng).any()
    assert concurrency_of({"process": "closed", "concurrency": 3}) == 3
    assert concurrency_of({"process": "poisson", "rate": 1}) is None
    assert concurrency_of(None) is None
    assert len(arrival_times({"process": "poisson", "rate": 1}, 0, rng)) == 0


def test_constant_gaps_are_exact() -> None:
    times = arrival_times({"process": "constant", "rate": 4.0}, 9, np.random.default_rng(0))
    np.testing.assert_allclose(times, np.arange(9) / 4.0)


def test_ramp_moves_the_rate_linearly_from_start_to_end() -> None:
    g = gaps({"process": "ramp", "start_rate": 2.0, "end_rate": 10.0}, n=101)
    rates = 1 / g
    assert rates[0] == pytest.approx(2.0) and rates[-1] == pytest.approx(10.0)
    np.testing.assert_allclose(np.diff(rates), 8.0 / 99)  # linear in the request index
    down = gaps({"process": "ramp", "start_rate": 10.0, "end_rate": 2.0}, n=11)
    assert np.all(np.diff(down) > 0)
    assert gaps({"process": "ramp", "start_rate": 3.0, "end_rate": 5.0}, n=2)[0] == pytest.approx(
        1 / 3
    )


@pytest.mark.parametrize(
    "spec",
    [{"process": "poisson", "rate": 2.0}, {"process": "gamma", "rate": 2.0, "burstiness": 0.5}],
)
def test_seeds_reproduce_and_differ(spec: dict) -> None:
    a = arrival_times(spec, 50, np.random.default_rng(7))
    b = arrival_times(spec, 50, np.random.default_rng(7))
    c = arrival_times(spec, 50, np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_workload_arrivals_are_seeded_and_closed_loop_exposes_concurrency() -> None:
    spec = {"process": "poisson", "rate": 10.0}
    a = SyntheticWorkload(num_requests=20, input_len=4, output_len=2, arrival=spec, seed=1)
    b = SyntheticWorkload(num_requests=20, input_len=4, output_len=2, arrival=spec, seed=1)
    c = SyntheticWorkload(num_requests=20, input_len=4, output_len=2, arrival=spec, seed=2)
    times = [[r.arrival_s for r in w.build()] for w in (a, b, c)]
    assert times[0] == times[1] != times[2]
    assert a.info["offered_rate_rps"] == pytest.approx(19 / max(times[0]))
    assert a.concurrency is None
    closed = SyntheticWorkload(
        num_requests=6, input_len=4, output_len=2, arrival={"process": "closed", "concurrency": 3}
    )
    assert closed.concurrency == 3
    assert all(r.arrival_s == 0.0 for r in closed.build())
    assert SyntheticWorkload().concurrency is None  # default: offline


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"process": "bursty"},
            r"workload\.arrival\.process: 'bursty' is invalid; allowed: "
            r"offline\|poisson\|gamma\|constant\|ramp\|closed",
        ),
        ({"process": "poisson"}, r"workload\.arrival\.rate"),
        ({"process": "poisson", "rate": 0}, r"workload\.arrival\.rate: 0 is invalid; allowed: "),
        ({"process": "poisson", "rate": -1.0}, r"workload\.arrival\.rate"),
        ({"process": "poisson", "rate": float("inf")}, r"workload\.arrival\.rate"),
        ({"process": "poisson", "rate": "fast"}, r"workload\.arrival\.rate"),
        ({"process": "gamma", "rate": 1.0, "burstiness": 0}, r"workload\.arrival\.burstiness"),
        ({"process": "ramp", "start_rate": 1.0, "end_rate": 0}, r"workload\.arrival\.end_rate"),
        ({"process": "closed", "concurrency": 0}, r"workload\.arrival\.concurrency: 0"),
        ({"process": "closed", "concurrency": 2.5}, r"workload\.arrival\.concurrency"),
        (
            {"process": "poisson", "rate": 1, "burstiness": 2},
            r"workload\.arrival: unknown key\(s\) \['burstiness'\] for process poisson",
        ),
        ("poisson", r"workload\.arrival: 'poisson' is invalid"),
    ],
)
def test_bad_specs_name_the_field_and_the_allowed_values(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_arrival(spec)
    with pytest.raises(ValueError, match=message):
        SyntheticWorkload(arrival=spec).validate()  # type: ignore[arg-type]


OPEN_LOOPS = [
    {"process": "offline"},
    {"process": "poisson", "rate": 4.0},
    {"process": "gamma", "rate": 4.0, "burstiness": 0.5},
    {"process": "constant", "rate": 4.0},
    {"process": "ramp", "start_rate": 1.0, "end_rate": 4.0},
]


@pytest.mark.parametrize("spec", OPEN_LOOPS, ids=lambda spec: spec["process"])
def test_every_open_loop_takes_a_cap_that_leaves_its_times_alone(spec: dict) -> None:
    capped = {**spec, "max_concurrency": 3}
    assert parse_arrival(capped) == {**parse_arrival(spec), "max_concurrency": 3}
    assert max_concurrency_of(capped) == 3 and concurrency_of(capped) is None
    assert max_concurrency_of(spec) is None
    assert max_concurrency_of({**spec, "max_concurrency": None}) is None  # the block's unset
    np.testing.assert_array_equal(
        arrival_times(capped, 30, np.random.default_rng(3)),
        arrival_times(spec, 30, np.random.default_rng(3)),
    )
    workload = SyntheticWorkload(num_requests=4, input_len=4, output_len=2, arrival=capped)
    assert workload.max_concurrency == 3 and workload.concurrency is None
    assert workload.validate().build() and workload.info["arrival"]["max_concurrency"] == 3


def test_workload_types_expose_the_cap() -> None:
    assert SyntheticWorkload().max_concurrency is None  # default: offline, no cap
    closed = SyntheticWorkload(arrival={"process": "closed", "concurrency": 2})
    assert closed.max_concurrency is None and closed.concurrency == 2
    prompts = PromptsWorkload(arrival={"process": "poisson", "rate": 1.0, "max_concurrency": 2})
    assert prompts.max_concurrency == 2
    # a trace's times are its arrival process: the cap is a key of the trace workload
    assert TraceWorkload().max_concurrency is None
    assert TraceWorkload(max_concurrency=5).max_concurrency == 5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"process": "poisson", "rate": 1, "max_concurrency": 0},
            r"workload\.arrival\.max_concurrency: 0 is invalid; allowed: an integer >= 1$",
        ),
        (
            {"process": "constant", "rate": 1, "max_concurrency": -1},
            r"workload\.arrival\.max_concurrency: -1 is invalid; allowed: an integer >= 1$",
        ),
        (
            {"process": "offline", "max_concurrency": "x"},
            r"workload\.arrival\.max_concurrency: 'x' is invalid; allowed: an integer >= 1$",
        ),
        (
            {"process": "gamma", "rate": 1, "burstiness": 2, "max_concurrency": 2.5},
            r"workload\.arrival\.max_concurrency: 2\.5 is invalid",
        ),
        (
            {"process": "ramp", "start_rate": 1, "end_rate": 2, "max_concurrency": True},
            r"workload\.arrival\.max_concurrency: True is invalid",
        ),
        (
            {"process": "closed", "concurrency": 4, "max_concurrency": 2},
            r"workload\.arrival\.max_concurrency: 2 is invalid; allowed: null with process "
            r"closed \(its concurrency already is the number in flight; max_concurrency caps an "
            r"open loop: process offline\|poisson\|gamma\|constant\|ramp\)$",
        ),
    ],
)
def test_bad_caps_name_the_field_and_the_allowed_values(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_arrival(spec)
    with pytest.raises(ValueError, match=message):
        SyntheticWorkload(arrival=spec).validate()
    with pytest.raises(ValueError, match=message):
        PromptsWorkload(path="models/data/sonnets.txt", format="text", arrival=spec).validate()


@pytest.mark.parametrize("value", [0, -1, "x", 1.5])
def test_a_bad_trace_cap_names_the_field(value: object) -> None:
    trace = TraceWorkload(path="data/traces/AzureLLMInferenceTrace_conv.csv", max_concurrency=1)
    assert trace.validate().max_concurrency == 1
    trace.max_concurrency = value  # type: ignore[assignment]
    with pytest.raises(
        ValueError, match=rf"workload\.max_concurrency: {value!r} is invalid; allowed: an integer"
    ):
        trace.validate()


@pytest.mark.parametrize(
    "spec",
    [
        {"process": "poisson", "rate": 1e-300},  # OverflowError in the driver before
        {"process": "constant", "rate": 1e-10},
        {"process": "ramp", "start_rate": 1e-300, "end_rate": 1.0},
    ],
)
def test_rates_that_push_arrivals_past_the_drivers_clock_are_refused(spec: dict) -> None:
    with pytest.raises(ValueError, match=r"workload\.arrival: .*\(request 1 would arrive"):
        arrival_times(spec, 4, np.random.default_rng(0))
