"""Absolute checks on a run's metrics (harness/measuring/checks.py)."""

from __future__ import annotations

import math

import pytest

from harness.measuring.checks import (
    Check,
    CheckError,
    contradictions,
    failed_checks,
    parse_check,
    parse_checks,
)


def test_string_form_reads_metric_operator_and_bound() -> None:
    assert parse_check("ttft_p99_s <= 2", "where") == Check("ttft_p99_s", "<=", 2.0)
    assert parse_check(" slo_attainment>=0.99 ", "where") == Check("slo_attainment", ">=", 0.99)


def test_mapping_form_takes_the_operator_from_the_metric_direction() -> None:
    checks = parse_checks({"ttft_p99_s": 2, "slo_attainment": 0.99}, "run.search.slo")
    assert checks == (Check("ttft_p99_s", "<=", 2.0), Check("slo_attainment", ">=", 0.99))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("ttft_p99 <= 2", "'ttft_p99' is not a metric"),
        ("ttft_p99_s == 2", "allowed: 'METRIC OP BOUND'"),
        ("ttft_p99_s <= nan", "allowed: a finite number"),
        ("ttft_p99_s <= two", "allowed: a finite number"),
        ({"duration_s": 3}, "has no better direction"),
        (3, "allowed: a list of"),
    ],
)
def test_bad_checks_name_where_and_what_is_allowed(value: object, named: str) -> None:
    with pytest.raises(CheckError, match=r"gate\.checks") as caught:
        parse_checks(value, "gate.checks")
    assert named in str(caught.value)


def test_holds_and_failures_report_the_value() -> None:
    checks = parse_checks(["ttft_p99_s <= 2", "slo_attainment >= 0.99"], "c")
    metrics = {"ttft_p99_s": 2.5, "slo_attainment": 0.995}
    assert [c.holds(metrics) for c in checks] == [False, True]
    assert failed_checks(checks, metrics) == ["ttft_p99_s <= 2: 2.5"]
    assert failed_checks(checks, {"ttft_p99_s": math.nan}) == [
        "ttft_p99_s <= 2: no value",
        "slo_attainment >= 0.99: no value",
    ]


def test_contradictory_bounds_are_found() -> None:
    assert contradictions(parse_checks(["ttft_p99_s <= 1", "ttft_p99_s >= 2"], "c")) == [
        "ttft_p99_s <= 1 and ttft_p99_s >= 2 cannot both hold"
    ]
    assert contradictions(parse_checks(["ttft_p99_s < 1", "ttft_p99_s >= 1"], "c"))
    assert not contradictions(parse_checks(["ttft_p99_s <= 1", "ttft_p99_s >= 1"], "c"))
    assert not contradictions(parse_checks(["ttft_p99_s <= 1", "tpot_p99_s <= 0.1"], "c"))
