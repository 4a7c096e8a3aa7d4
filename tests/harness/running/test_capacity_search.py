"""The capacity search's algorithm (harness/running/capacity_search.py) on synthetic load ->
metrics curves, no Hydra: the answer within 10% of the true crossing in at most 6 runs, the
outcomes at the edges of the range, and failed or saturated runs counted as misses."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from harness.measuring.checks import parse_checks
from harness.running.capacity_search import (
    Measurement,
    Probe,
    SearchResult,
    SearchSettings,
    judge,
    search,
    slack,
)
from harness.running.capacity_sweep import console_line, load_overrides, result_record
from harness.running.run_config import RunConfig, SearchConfig

CAPACITY = 10.0  # req/s where the synthetic server saturates


def queue_latency(a: float) -> Callable[[float], float]:
    """p99 latency of a queue-like server at utilisation rho: steep near saturation."""
    return lambda rho: 0.1 * (1 + a * rho / (1 - rho)) if rho < 0.999 else 100.0


def exp_latency(a: float) -> Callable[[float], float]:
    """A smoothly growing latency: no knee."""
    return lambda rho: 0.1 * math.exp(a * rho)


def rate_search(
    latency: Callable[[float], float],
    rho_at_slo: float,
    sync_share: float,
    noise: float,
    seed: int,
    **settings: object,
) -> tuple[SearchResult, float, list[list[Probe]]]:
    """A search over the request rate of a synthetic server whose synchronous run achieves
    sync_share of its capacity and whose throughput run 98% of it; the SLO bound on
    ttft_p99_s crosses at rho_at_slo. Returns the result, the true crossing and the rounds."""
    rng = random.Random(seed)
    checks = parse_checks([f"ttft_p99_s <= {latency(rho_at_slo)}"], "slo")
    rounds: list[list[Probe]] = []

    def measure(probes: list[Probe]) -> list[Measurement]:
        rounds.append(probes)
        out = []
        for probe in probes:
            if probe.load is None:
                rate = CAPACITY * (sync_share if probe.role == "low" else 0.98)
            else:
                rate = probe.load
            value = latency(rate / CAPACITY) * math.exp(rng.gauss(0, noise))
            out.append(Measurement("complete", {"ttft_p99_s": value, "req_per_s": rate}))
        return out

    result = search(measure, checks, SearchSettings(**settings))  # type: ignore[arg-type]
    return result, rho_at_slo * CAPACITY, rounds


def elasticity(latency: Callable[[float], float], rho: float) -> float:
    """d log(latency) / d log(load) at rho: how much the SLO metric moves per % of load."""
    return (math.log(latency(rho * 1.001)) - math.log(latency(rho))) / math.log(1.001)


CURVES = [
    (f"{name}({a})", curve(a))
    for name, curve in (("queue", queue_latency), ("exp", exp_latency))
    for a in (0.5, 1.0, 2.0, 4.0)
]
CROSSINGS = (0.3, 0.5, 0.7, 0.85, 0.93)
SYNC_SHARES = (0.25, 0.125, 0.05)


def test_noise_free_curves_are_answered_within_10_percent_in_6_runs() -> None:
    for name, curve in CURVES:
        for rho in CROSSINGS:
            for share in SYNC_SHARES:
                result, truth, _ = rate_search(curve, rho, share, 0.0, 0)
                assert result.outcome == "found" and result.answer is not None
                assert len(result.points) <= 6, (name, rho, share)
                assert abs(result.answer - truth) <= 0.1 * truth, (name, rho, share, result)


def test_noisy_curves_are_answered_within_10_percent_in_6_runs() -> None:
    """3% noise on the metric: where the curve moves at least 1% per % of load (else noise,
    not the search, decides), 95% of the searches land within 10% of the true crossing."""
    cases = within = 0
    for name, curve in CURVES:
        for rho in CROSSINGS:
            if elasticity(curve, rho) < 1:
                continue
            for share in SYNC_SHARES:
                for seed in range(4):
                    result, truth, _ = rate_search(curve, rho, share, 0.03, seed)
                    assert len(result.points) <= 6, name
                    cases += 1
                    ok = result.answer is not None and abs(result.answer - truth) <= 0.1 * truth
                    within += ok
    assert cases >= 100
    assert within / cases >= 0.95, f"{within} of {cases}"


def test_a_concurrency_search_ends_on_adjacent_whole_numbers() -> None:
    """TPOT growing linearly with the batch: the largest concurrency that meets, exactly."""
    checks = parse_checks(["tpot_p99_s <= 0.05"], "slo")  # crossing at c = 22.5

    def measure(probes: list[Probe]) -> list[Measurement]:
        loads = [p.load if p.load is not None else (1 if p.role == "low" else 64) for p in probes]
        assert all(float(c).is_integer() for c in loads)
        return [Measurement("complete", {"tpot_p99_s": 0.005 + 0.002 * c}) for c in loads]

    result = search(
        measure, checks, SearchSettings(over="concurrency", max_points=8, tolerance=0.01), 64
    )
    assert result.outcome == "found" and result.answer == 22
    assert result.high is not None and result.high.load == 23
    assert len(result.points) <= 8


def test_a_synchronous_run_that_misses_is_below_range_after_one_run() -> None:
    result, _, rounds = rate_search(queue_latency(1.0), 0.05, 0.25, 0.0, 0)
    assert result.outcome == "below_range" and result.answer is None
    assert len(rounds) == 1 and len(result.points) == 1
    assert "ttft_p99_s <= " in result.note and "misses the SLO" in result.note
    line = console_line(result_record(result))
    assert line.startswith("search: max_rate_at_slo = none, below range: even the lowest")


def test_a_throughput_run_that_meets_is_above_range() -> None:
    result, _, _ = rate_search(queue_latency(1.0), 0.99, 0.25, 0.0, 0)
    assert result.outcome == "above_range"
    assert result.answer == pytest.approx(9.8)  # the throughput run's achieved rate
    record = result_record(result)
    assert record["max_rate_at_slo"] == pytest.approx(9.8)
    assert console_line(record) == (
        "search: max_rate_at_slo >= 9.8 req/s: even the throughput run meets the SLO (2 runs)"
    )


def test_a_server_that_fails_every_request_is_a_failed_search() -> None:
    error = "every measured request failed (8 of 8); the first, r0: connection refused"
    result = search(
        lambda probes: [Measurement("failed", error=error, job="0") for _ in probes],
        parse_checks({"ttft_p99_s": 1}, "slo"),
        SearchSettings(),
    )
    assert result.outcome == "failed" and result.answer is None
    assert result.note == f"the low run (0) failed: {error}"
    assert len(result.points) == 1


def test_failed_and_saturated_runs_count_as_misses_and_say_why() -> None:
    """Past 6 req/s the runs fail or are stopped as saturated, though their partial metrics
    would pass: the answer stays below them, bisecting where they have nothing to
    interpolate on."""
    checks = parse_checks(["ttft_p99_s <= 1"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        out = []
        for probe in probes:
            rate = probe.load or (1.0 if probe.role == "low" else 20.0)
            metrics = {"ttft_p99_s": 0.5, "req_per_s": rate}
            if rate > 8:
                out.append(Measurement("failed", metrics, error="out of memory"))
            elif rate > 6:
                out.append(Measurement("complete", metrics, saturated=True))
            else:
                out.append(Measurement("complete", metrics))
        return out

    result = search(measure, checks, SearchSettings(max_points=10))
    assert result.outcome == "found" and result.answer is not None
    assert 6 / 1.1 <= result.answer <= 6
    reasons = {tuple(p.failed) for p in result.points if not p.meets}
    assert ("run failed: out of memory",) in reasons
    assert ("run stopped as saturated",) in reasons


def test_a_meet_above_a_miss_is_not_the_answer() -> None:
    """Noise near the crossing: a run that meets above one that missed is not trusted."""
    checks = parse_checks(["ttft_p99_s <= 1"], "slo")
    between = 0

    def measure(probes: list[Probe]) -> list[Measurement]:
        nonlocal between
        out = []
        for probe in probes:
            rate = probe.load or (1.0 if probe.role == "low" else 10.0)
            between += probe.role == "between"
            # the high run and the first run between miss, every later one meets
            value = 3.0 if probe.role == "high" or between == 1 else 0.5
            out.append(Measurement("complete", {"ttft_p99_s": value, "req_per_s": rate}))
        return out

    result = search(measure, checks, SearchSettings(max_points=6))
    first_miss = result.points[2]
    assert not first_miss.meets and first_miss.load is not None
    assert result.answer is not None and result.answer < first_miss.load


def test_parallel_rounds_launch_both_bounds_then_several_loads() -> None:
    result, truth, rounds = rate_search(queue_latency(1.0), 0.7, 0.125, 0.0, 0, parallel=3,
                                        max_points=8)  # fmt: skip
    assert [p.role for p in rounds[0]] == ["low", "high"]
    assert all(len(r) <= 3 for r in rounds) and len(rounds[1]) == 3
    loads = [p.load for r in rounds[1:] for p in r]
    assert len(set(loads)) == len(loads)  # never a load twice
    assert result.answer is not None and abs(result.answer - truth) <= 0.1 * truth


def test_slack_is_the_worst_log_margin() -> None:
    checks = parse_checks(["ttft_p99_s <= 2", "slo_attainment >= 0.5"], "slo")
    assert slack(checks, {"ttft_p99_s": 1.0, "slo_attainment": 1.0}) == pytest.approx(math.log(2))
    assert slack(checks, {"ttft_p99_s": 4.0, "slo_attainment": 1.0}) == pytest.approx(-math.log(2))
    assert slack(checks, {"ttft_p99_s": 1.0}) is None  # a value missing
    assert slack(checks, {"ttft_p99_s": 1.0, "slo_attainment": 0.0}) is None  # no log of 0


def test_load_overrides_set_the_process_and_clear_other_keys() -> None:
    arrival = {"process": "poisson", "rate": 1.0, "concurrency": None, "max_concurrency": 4}
    assert load_overrides(Probe("low"), "rate", arrival, 40) == [
        "workload.arrival.process=closed",
        "workload.arrival.concurrency=1",
        "workload.arrival.max_concurrency=null",
        "workload.arrival.rate=null",
    ]
    assert (
        load_overrides(Probe("high"), "rate", arrival, 40)[0] == "workload.arrival.process=offline"
    )
    assert load_overrides(Probe("between", 3.25), "rate", arrival, 40) == [
        "workload.arrival.process=poisson",
        "workload.arrival.rate=3.25",
        "workload.arrival.max_concurrency=null",
    ]
    closed = {"process": "closed", "concurrency": 1}
    assert load_overrides(Probe("high"), "concurrency", closed, 40) == [
        "workload.arrival.process=closed",
        "workload.arrival.concurrency=40",
    ]


@pytest.mark.parametrize(
    ("search_section", "message"),
    [
        ({"slo": []}, "run.search.slo: [] is invalid"),
        ({"slo": {}}, "run.search.slo: {} is invalid"),
        ({"slo": ["ttft_p99_s <= 1", "ttft_p99_s > 2"]}, "run.search.slo: contradictory"),
        ({"slo": ["no_such_metric <= 1"]}, "run.search.slo[0]: 'no_such_metric' is not a metric"),
        ({"slo": {"ttft_p99_s": 1}, "over": "tokens"}, "run.search.over: 'tokens' is invalid"),
        ({"slo": {"ttft_p99_s": 1}, "max_points": 1}, "run.search.max_points: 1 is invalid"),
        (
            {"slo": {"ttft_p99_s": 1}, "over": "concurrency", "min_load": 1.5},
            "run.search.min_load: 1.5 is invalid",
        ),
        ({"slo": {"ttft_p99_s": 1}, "min_load": 4, "max_load": 2}, "min_load 4 is not below"),
    ],
)
def test_bad_searches_are_refused_naming_the_key(
    search_section: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunConfig.from_dict({"search": search_section})


def test_no_slo_is_no_search() -> None:
    assert not RunConfig.from_dict({}).search.enabled
    search_cfg = SearchConfig.from_dict({"slo": {"ttft_p99_s": 2, "slo_attainment": 0.99}})
    assert [str(c) for c in search_cfg.checks] == ["ttft_p99_s <= 2", "slo_attainment >= 0.99"]


@pytest.mark.parametrize(("poisson_at_top", "outcome"), [(1.5, "above_range"), (2.1, "found")])
def test_a_bracket_ending_at_the_burst_is_remeasured_with_poisson_arrivals(
    poisson_at_top: float, outcome: str
) -> None:
    """The throughput run sends every request at once: its TTFT (3 s, a miss) is a burst's,
    not that of Poisson arrivals at its achieved rate (10 req/s). A search that narrows
    against it measures Poisson arrivals at 10 req/s before it answers: meeting there is
    above_range; where Poisson arrivals miss below it, the bracket's upper end is a Poisson
    run, never the burst."""
    checks = parse_checks(["ttft_p99_s <= 2"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        out = []
        for probe in probes:
            if probe.load is None:  # the bounding runs: synchronous 1 req/s, a burst 10 req/s
                rate, ttft = (1.0, 0.2) if probe.role == "low" else (10.0, 3.0)
            else:
                rate = probe.load
                ttft = 0.2 + (poisson_at_top - 0.2) * (rate - 1) / 9
            out.append(Measurement("complete", {"ttft_p99_s": ttft, "req_per_s": rate}))
        return out

    result = search(measure, checks, SearchSettings(max_points=8))
    assert result.outcome == outcome
    if outcome == "above_range":
        loads = [p.load for p in result.points if p.probe.role == "between"]
        assert 10.0 in loads  # the burst's rate, remeasured
        assert result.answer == 10.0 and result.high is None
    else:  # the crossing, 9.53 req/s
        assert result.high is not None and result.high.probe.role == "between"
        assert result.answer is not None and 9.53 * 0.9 <= result.answer < 9.53


def test_a_synchronous_meet_is_remeasured_with_poisson_arrivals() -> None:
    """A server without batching (llama.cpp's Python server): one request at a time meets the
    SLO at 2.54 req/s, the burst achieves 2.61; Poisson arrivals queue near that rate, and
    meet the SLO only below 1.5 req/s. The search must not answer 2.54."""
    checks = parse_checks(["ttft_p99_s <= 0.5"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        out = []
        for probe in probes:
            if probe.load is None:
                rate, ttft = (2.54, 0.2) if probe.role == "low" else (2.61, 37.0)
            else:  # a queue of one server at 2.61 req/s
                rate = probe.load
                ttft = 0.25 / max(1e-3, 1 - rate / 2.61)
            out.append(Measurement("complete", {"ttft_p99_s": ttft, "req_per_s": rate}))
        return out

    result = search(measure, checks, SearchSettings(max_points=8))
    assert result.outcome == "found"
    assert result.answer is not None and 1.2 <= result.answer <= 1.305  # the crossing: 1.305
    assert result.low is not None and result.low.probe.role == "between"
    short = search(measure, checks, SearchSettings(max_points=3))  # no room to halve down
    assert short.outcome == "below_range" and short.answer is None
    assert "Poisson arrivals miss the SLO down to 2.54" in short.note


@pytest.mark.parametrize(
    ("run_section", "message"),
    [
        # a percentile run.percentiles leaves out: every run would miss it as "no value"
        (
            {"search": {"slo": ["ttft_p97_s <= 1"]}},
            "run.search.slo: ttft_p97_s <= 1: run.percentiles [50, 90, 95, 99] has no 97",
        ),
        # SLO figures exist only under a run.slo bound
        (
            {"search": {"slo": ["ttft_p90_s <= 0.5", "slo_attainment >= 0.99"]}},
            "run.search.slo: slo_attainment >= 0.99: a run has slo_attainment only under",
        ),
        (
            {"search": {"slo": {"goodput_req_per_s": 1}}},
            "run.search.slo: goodput_req_per_s >= 1: a run has goodput_req_per_s only under",
        ),
        # the search's own answer is a sweep's, never a run's
        (
            {"search": {"slo": ["max_rate_at_slo >= 1"]}},
            "run.search.slo: max_rate_at_slo >= 1: is the capacity search's answer",
        ),
        # YAML's true is no bound
        ({"search": {"slo": {"ttft_p99_s": True}}}, "bound True is invalid"),
    ],
)
def test_checks_no_run_can_measure_are_refused_before_anything_runs(
    run_section: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunConfig.from_dict(run_section)


def test_checks_on_measured_metrics_are_taken() -> None:
    listed = RunConfig.from_dict(
        {"search": {"slo": ["ttft_p97_s <= 1", "itl_p999_s <= 1"]}, "percentiles": [50, 97]}
    )
    assert [str(c) for c in listed.search.checks] == ["ttft_p97_s <= 1", "itl_p999_s <= 1"]
    bounded = RunConfig.from_dict(
        {"search": {"slo": ["slo_attainment >= 0.99"]}, "slo": {"ttft_s": 2}}
    )
    assert bounded.search.enabled


def test_the_line_names_max_load_when_it_bounded_an_above_range_search() -> None:
    checks = parse_checks(["ttft_p99_s <= 5"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        return [Measurement("complete", {"ttft_p99_s": 1.0, "req_per_s": 1.0}) for _ in probes]

    for max_load, said in (
        (None, "even the throughput run meets"),
        (3.0, "even the run at max_load meets"),
    ):
        result = search(measure, checks, SearchSettings(max_load=max_load), num_requests=8)
        record = result_record(result)
        assert record["outcome"] == "above_range"
        assert record["range"] == {"min_load": None, "max_load": max_load}
        assert said in console_line(record)


@pytest.mark.parametrize(("high_meets", "outcome"), [(False, "found"), (True, "above_range")])
def test_a_max_load_below_the_synchronous_rate_answers_the_highest_load_that_met(
    high_meets: bool, outcome: str
) -> None:
    """run.search.max_load=5 where the synchronous run achieved 100 req/s: no range to search.
    The answer is the 100 req/s measured to meet, never the 5 (it was, above range), and a
    miss at 5 no longer left the line without a bracket to print (a TypeError lost
    search.json)."""
    checks = parse_checks(["duration_s <= 1"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        out = []
        for probe in probes:
            duration = 0.1 if probe.load is None or high_meets else 2.0
            out.append(Measurement("complete", {"duration_s": duration, "req_per_s": 100.0}))
        return out

    result = search(measure, checks, SearchSettings(max_load=5.0), num_requests=8)
    record = result_record(result)
    assert record["outcome"] == outcome and record["max_rate_at_slo"] == 100.0
    assert record["bracket"]["meets"]["load"] == 100.0
    line = console_line(record)
    assert "no range to search; set run.search.max_load above the low run's load" in line
    assert line.startswith(
        "search: max_rate_at_slo = 100 req/s (meets at 100, misses at 5; 2 runs)"
        if outcome == "found"
        else "search: max_rate_at_slo >= 100 req/s: every run met the SLO"
    )


def test_a_metric_the_low_run_does_not_hold_fails_the_search_rather_than_below_range() -> None:
    """mean_batch_size against a server (engine=openai has no engine steps): the low run met
    nothing because it measured nothing, which read as 'below range: even the lowest load
    misses the SLO (mean_batch_size <= 2: no value)'."""
    checks = parse_checks(["mean_batch_size <= 2", "ttft_p99_s <= 1"], "slo")

    def measure(probes: list[Probe]) -> list[Measurement]:
        return [Measurement("complete", {"ttft_p99_s": 0.1, "req_per_s": 5.0}, job="0")]

    result = search(measure, checks, SearchSettings(), num_requests=8)
    assert result.outcome == "failed" and result.answer is None and len(result.points) == 1
    assert result.note.startswith("the low run (0) has no value for mean_batch_size")


def test_a_run_that_lost_requests_misses_whatever_its_latencies() -> None:
    """Latencies count completed requests only: a run whose slowest requests failed, or were
    cut at run.max_duration_s, would look as if it met the SLO."""
    checks = parse_checks(["ttft_p99_s <= 2"], "slo")
    metrics = {"ttft_p99_s": 0.5, "req_per_s": 4.0}
    fine = judge(Probe("between", 4.0), 4.0, checks, Measurement("complete", metrics))
    failed = judge(
        Probe("between", 4.0), 4.0, checks, Measurement("complete", metrics, failed_requests=3)
    )
    cut = judge(
        Probe("between", 4.0), 4.0, checks, Measurement("complete", metrics, cut_requests=2)
    )
    assert fine.meets and not failed.meets and not cut.meets
    assert failed.failed == ["3 request(s) failed"] and cut.failed == [
        "2 request(s) cut by a run bound"
    ]
    assert failed.slack is None  # no interpolating on a run that lost requests
