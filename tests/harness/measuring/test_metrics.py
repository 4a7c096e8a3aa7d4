"""Summary metrics on hand-made records with known answers (no engine, no timing)."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.measuring.metrics import REGISTRY, compute_summary
from harness.run_folder import REQUEST_COLUMNS, STEP_COLUMNS


def frames() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    # a: arrives 0.0, tokens at 0.5, 0.6, 0.8 (N = 3); b: arrives 0.2, tokens at 1.2, 1.5;
    # c: failed; d: finished with no token (aborted at once)
    requests = pd.DataFrame(
        [
            {
                "request_id": "a",
                "status": "ok",
                "arrival_s": 0.0,
                "scheduled_s": 0.1,
                "first_token_s": 0.5,
                "last_token_s": 0.8,
                "prompt_tokens": 10,
                "output_tokens": 3,
            },
            {
                "request_id": "b",
                "status": "ok",
                "arrival_s": 0.2,
                "scheduled_s": 0.4,
                "first_token_s": 1.2,
                "last_token_s": 1.5,
                "prompt_tokens": 20,
                "output_tokens": 2,
            },
            {
                "request_id": "c",
                "status": "failed",
                "arrival_s": 0.3,
                "scheduled_s": None,
                "first_token_s": None,
                "last_token_s": None,
                "prompt_tokens": None,
                "output_tokens": 0,
                "error": "prompt: empty",
            },
            {
                "request_id": "d",
                "status": "ok",
                "arrival_s": 0.1,
                "scheduled_s": 0.2,
                "first_token_s": None,
                "last_token_s": None,
                "prompt_tokens": 5,
                "output_tokens": 0,
            },
        ]
    ).reindex(columns=REQUEST_COLUMNS)
    tokens = pd.DataFrame(
        {
            "request_id": ["a", "a", "a", "b", "b"],
            "index": [0, 1, 2, 0, 1],
            "step": [1, 2, 3, 4, 5],
            "time_s": [0.5, 0.6, 0.8, 1.2, 1.5],
            "token_id": [1, 2, 3, 4, 5],
        }
    )
    steps = pd.DataFrame(
        [
            {
                "step": i,
                "num_seqs": n,
                "prefill_tokens": p,
                "decode_tokens": d,
                "padding_tokens": 0,
                "kv_bytes_reserved": 100,
                "kv_bytes_used": u,
            }
            for i, n, p, d, u in [(1, 1, 10, 0, 10), (2, 2, 20, 1, 40), (3, 1, 0, 1, 30)]
        ]
    ).reindex(columns=STEP_COLUMNS)
    return requests, tokens, steps


def test_known_values() -> None:
    s = compute_summary(*frames(), {"load_s": 1.0, "cold_start_s": 1.25})
    assert s["ttft_p50_s"] == pytest.approx(0.75)  # TTFTs 0.5 and 1.0
    assert s["ttft_mean_s"] == pytest.approx(0.75)
    assert s["tpot_mean_s"] == pytest.approx((0.15 + 0.3) / 2)  # (0.8-0.5)/2, (1.5-1.2)/1
    assert s["e2e_p50_s"] == pytest.approx((0.8 + 1.3) / 2)
    assert s["queue_p50_s"] == pytest.approx(0.1)  # 0.1, 0.2, 0.1 (d has no first token)
    assert s["itl_max_s"] == pytest.approx(0.3)  # gaps 0.1, 0.2 (a) and 0.3 (b), pooled
    assert s["itl_mean_s"] == pytest.approx(0.2)
    duration = 1.5  # first arrival 0.0 -> last completion 1.5
    assert s["duration_s"] == pytest.approx(duration)
    assert s["output_tok_per_s"] == pytest.approx(5 / duration)
    assert s["input_tok_per_s"] == pytest.approx(35 / duration)
    assert s["req_per_s"] == pytest.approx(3 / duration)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (4, 3, 1)
    assert s["output_tokens_total"] == 5 and s["num_steps"] == 3
    assert s["mean_batch_size"] == pytest.approx(4 / 3)
    assert s["kv_bytes_used_peak"] == 40 and s["prefill_tokens_total"] == 30
    assert s["cold_start_s"] == 1.25


def test_every_metric_is_registered_with_a_direction_and_kind() -> None:
    s = compute_summary(*frames(), {"load_s": 1.0, "cold_start_s": 1.25})
    assert set(s) <= set(REGISTRY)
    for metric in REGISTRY.values():
        assert metric.better in ("lower", "higher", "none")
        assert metric.kind in ("deterministic", "timing")
        assert metric.name == metric.name.lower() and " " not in metric.name


def test_docs_list_every_registered_metric() -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    missing = [name for name in REGISTRY if f"`{name}`" not in docs]
    assert not missing, (
        f"regenerate the table with `python -m harness.measuring.metrics`: {missing}"
    )


def test_goodput_padding_offered_rate_and_window() -> None:
    from harness.running.window import WindowConfig, summarize

    requests, tokens, steps = frames()
    requests["sent_s"] = requests["arrival_s"]
    s = compute_summary(requests, tokens, steps, slo={"ttft_s": 0.6, "tpot_s": None})
    # a meets TTFT <= 0.6; b does not; d (no token, so no TTFT) cannot
    assert s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["goodput_req_per_s"] == pytest.approx(1 / 1.5)
    assert s["offered_req_per_s"] == pytest.approx(3 / 0.3)  # 4 arrivals over 0.3 s
    assert s["padding_fraction"] == 0.0
    out = summarize(
        {"requests": requests, "tokens": tokens, "steps": steps},
        {},
        None,
        WindowConfig(skip_fraction=0.25, min_requests=5),
    )
    window = out["window"]
    # sends in order: 0.0 (a), 0.1 (d), 0.2 (b), 0.3 (c): skip the first quarter
    assert window["kind"] == "steady_state" and window["start_s"] == 0.1
    assert window["end_s"] == 0.3 and window["num_requests"] == 3
    assert window["valid"] is False and "min_requests" in window["reason"]
    assert out["metrics"]["num_requests"] == 3 and out["metrics_whole_run"]["num_requests"] == 4


def test_window_rates_count_events_inside_the_window() -> None:
    requests, tokens, steps = frames()
    requests["sent_s"] = requests["arrival_s"]
    s = compute_summary(requests, tokens, steps, span=(0.1, 1.3))
    assert s["duration_s"] == pytest.approx(1.2)
    # a completes at 0.8 inside; b's last token 1.5 is outside; tokens at 0.5, 0.6, 0.8, 1.2
    assert s["req_per_s"] == pytest.approx(1 / 1.2)
    assert s["output_tok_per_s"] == pytest.approx(4 / 1.2)
    assert s["input_tok_per_s"] == pytest.approx((10 + 20) / 1.2)  # a and b prefilled inside
    assert s["num_requests"] == 3  # sent inside: d (0.1), b (0.2), c (0.3)


def test_a_window_no_request_completed_in_gives_the_whole_runs_rates() -> None:
    # overload: all four requests are sent by 0.3 s, the first completes at 0.8 s; over the
    # window [0.1, 0.3] alone the run would read 0 req/s and 0 tok/s
    from harness.running.window import WindowConfig, summarize

    requests, tokens, steps = frames()
    requests["sent_s"] = requests["arrival_s"]
    assert compute_summary(requests, tokens, steps, span=(0.1, 0.3))["req_per_s"] == 0.0
    out = summarize(
        {"requests": requests, "tokens": tokens, "steps": steps},
        {},
        None,
        WindowConfig(skip_fraction=0.25),
    )
    window, m, whole = out["window"], out["metrics"], out["metrics_whole_run"]
    assert (window["kind"], window["start_s"], window["end_s"]) == ("steady_state", 0.1, 0.3)
    assert window["valid"] is False and window["num_completed"] == 0
    assert window["reason"] == "no request completed inside the window"
    for name in (
        "duration_s",
        "req_per_s",
        "output_tok_per_s",
        "input_tok_per_s",
        "total_tok_per_s",
    ):
        assert name in window["whole_run_metrics"]
        assert m[name] == whole[name], name
    assert m["req_per_s"] == pytest.approx(3 / 1.5) and m["duration_s"] == pytest.approx(1.5)
    # latencies and counts stay those of the requests sent inside the window (d, b, c)
    assert m["num_requests"] == 3 and m["ttft_p50_s"] == pytest.approx(1.0)


def test_a_valid_window_keeps_its_own_rates() -> None:
    from harness.running.window import WindowConfig, summarize

    requests, tokens, steps = frames()
    requests["sent_s"] = requests["arrival_s"]
    requests.loc[requests["request_id"] == "c", "sent_s"] = 1.0  # window [0.1, 1.0]: a inside
    out = summarize(
        {"requests": requests, "tokens": tokens, "steps": steps},
        {},
        None,
        WindowConfig(skip_fraction=0.25),
    )
    window = out["window"]
    assert window["valid"] is True and window["num_completed"] == 1
    assert window["whole_run_metrics"] == []
    assert out["metrics"]["req_per_s"] == pytest.approx(1 / 0.9)
    assert out["metrics_whole_run"]["req_per_s"] == pytest.approx(3 / 1.5)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"skip": 0.2}, "unknown key(s) ['skip']"),
        ({"skip_fraction": "half"}, "run.window.skip_fraction: 'half' is invalid"),
        ({"min_duration_s": -1}, "run.window.min_duration_s: -1 is invalid"),
        ({"min_requests": 2.5}, "run.window.min_requests: 2.5 is invalid"),
        ({"min_requests": True}, "run.window.min_requests: True is invalid"),
        (3, "run.window: 3 is invalid; allowed: a mapping of"),
    ],
)
def test_window_config_names_the_bad_key(values: object, named: str) -> None:
    from harness.running.window import WindowConfig

    with pytest.raises(ValueError, match="allowed") as error:
        WindowConfig.from_dict(values)  # type: ignore[arg-type]
    assert named in str(error.value)
