"""`run.percentiles`: every latency family's mean, std and chosen percentiles, names derived
from the family's declaration (no fixed list), and the option's checks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.measuring.checks import parse_check
from harness.measuring.metrics import (
    LATENCY_FAMILIES,
    REGISTRY,
    compute_summary,
    find_metric,
    percentile_stat,
    stat_percentile,
)
from harness.run_folder import REQUEST_COLUMNS, STEP_COLUMNS, TOKEN_COLUMNS
from harness.running.run_config import RunConfig

#: what the report, the gate and older baselines read, whatever run.percentiles says
ALWAYS = (
    *("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"),
    *("tpot_mean_s", "tpot_p50_s", "tpot_p99_s"),
    *("e2e_mean_s", "e2e_p50_s", "e2e_p99_s"),
    *("queue_p50_s", "queue_p99_s"),
    *("itl_mean_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "itl_p999_s", "itl_max_s"),
)


def ten_requests() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Request k arrives at 0 and has TTFT (k + 1) / 10 s, then 3 tokens 0.05 s apart."""
    ttfts = np.arange(1, 11) / 10
    requests = pd.DataFrame(
        {
            "request_id": [f"r{k}" for k in range(10)],
            "status": "ok",
            "arrival_s": 0.0,
            "sent_s": 0.0,
            "scheduled_s": ttfts / 2,
            "first_token_s": ttfts,
            "last_token_s": ttfts + 0.1,
            "prompt_tokens": 4,
            "output_tokens": 3,
        }
    ).reindex(columns=REQUEST_COLUMNS)
    tokens = pd.DataFrame(
        [
            {"request_id": f"r{k}", "index": i, "time_s": ttfts[k] + 0.05 * i}
            for k in range(10)
            for i in range(3)
        ]
    ).reindex(columns=TOKEN_COLUMNS)
    return requests, tokens, pd.DataFrame(columns=STEP_COLUMNS)


@pytest.mark.parametrize(
    ("q", "stat"),
    [(50, "p50"), (5, "p5"), (99.9, "p999"), (99.99, "p9999"), (0.1, "p001"), (37.5, "p375")],
)
def test_a_percentile_is_named_without_its_point(q: float, stat: str) -> None:
    assert percentile_stat(q) == stat
    assert stat_percentile(stat) == pytest.approx(q)


def test_only_the_canonical_spelling_names_a_percentile() -> None:
    assert stat_percentile("p05") is None  # 5 is p5
    assert stat_percentile("p100") is None and stat_percentile("p0") is None
    assert find_metric("ttft_p05_s") is None and "ttft_p5_s" in REGISTRY


def test_summary_holds_mean_std_and_each_listed_percentile() -> None:
    s = compute_summary(*ten_requests(), percentiles=[75, 99.9])
    ttfts = np.arange(1, 11) / 10
    assert s["ttft_p75_s"] == pytest.approx(np.percentile(ttfts, 75))
    assert s["ttft_p999_s"] == pytest.approx(np.percentile(ttfts, 99.9))
    assert s["ttft_std_s"] == pytest.approx(ttfts.std())  # ddof 0, as vLLM
    assert s["e2e_p75_s"] == pytest.approx(np.percentile(ttfts + 0.1, 75))
    assert s["queue_mean_s"] == pytest.approx((ttfts / 2).mean())
    assert s["itl_std_s"] == pytest.approx(0.0, abs=1e-12)  # every gap 0.05 s
    assert s["tpot_p999_s"] == pytest.approx(0.05)
    assert "ttft_p95_s" not in s  # not asked for, and not one of the names always present
    assert set(ALWAYS) <= set(s)


def test_the_default_percentiles_are_50_90_95_99() -> None:
    s = compute_summary(*ten_requests())
    for family in LATENCY_FAMILIES:
        for stat in ("mean", "std", "p50", "p90", "p95", "p99"):
            assert f"{family}_{stat}_s" in s
    assert set(ALWAYS) <= set(s)


def test_a_derived_member_is_a_metric_everywhere_a_name_is_looked_up() -> None:
    metric = find_metric("e2e_p75_s")
    assert metric is not None and (metric.unit, metric.better, metric.kind) == (
        "s",
        "lower",
        "timing",
    )
    assert "p75" in metric.description and "linear interpolation" in metric.description
    assert REGISTRY["itl_p9999_s"].better == "lower"
    assert REGISTRY.get("itl_p75_s") is not None
    # declared members only: the docs' table and A/B's loop see a fixed set
    assert "e2e_p75_s" not in list(REGISTRY)
    assert find_metric("tpot_max_s") is None  # max: ITL's only
    # other metrics that share a prefix are no family members
    assert find_metric("server_ttft_p75_s") is None
    assert find_metric("itl_p99_decode_s") is REGISTRY["itl_p99_decode_s"]
    check = parse_check("ttft_p75_s <= 2", "run.search.slo")
    assert check.holds({"ttft_p75_s": 1.5}) is True


@pytest.mark.parametrize(
    "value",
    [[], [0], [100], [-5], ["a"], [50, 50.0], [True], [99.99999], [50, None], "50", None],
)
def test_bad_percentiles_are_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"run\.percentiles: .* is invalid; allowed: a non-empty"):
        RunConfig.from_dict({"percentiles": value})


def test_percentiles_are_kept_as_floats() -> None:
    assert RunConfig.from_dict({"percentiles": [50, 99.9]}).percentiles == [50.0, 99.9]
    assert RunConfig.from_dict(None).percentiles == [50.0, 90.0, 95.0, 99.0]
