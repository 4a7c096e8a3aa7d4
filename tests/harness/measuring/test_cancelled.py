"""Cancelled requests (status "cancelled": a run bound stopped them) are counted apart: in
num_requests and num_cancelled only, never as completed, failed, in a latency or an SLO."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

from harness.measuring.metrics import compute_summary
from harness.run_folder import REQUEST_COLUMNS, STEP_COLUMNS, TOKEN_COLUMNS
from harness.running.experiment import _fail_if_every_request_failed
from harness.running.window import WindowConfig, steady_state, summarize


def request(request_id: str, status: str, sent: float, first: float | None, last: float | None,
            tokens: int, error: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "request_id": request_id,
        "status": status,
        "error": error,
        "arrival_s": sent,
        "sent_s": sent,
        "scheduled_s": sent,
        "first_token_s": first,
        "last_token_s": last,
        "finished_s": last if last is not None else sent + 0.5,
        "prompt_tokens": 10,
        "output_tokens": tokens,
    }


def frames() -> dict[str, pd.DataFrame]:
    # a, b: ok; c: failed at once; x: cancelled mid-stream with 2 tokens (a slow TTFT that must
    # not count); y: cancelled before its first token
    requests = pd.DataFrame(
        [
            request("a", "ok", 0.0, 0.2, 0.4, 3),
            request("b", "ok", 0.1, 0.4, 0.6, 2),
            request("c", "failed", 0.2, None, None, 0, "backend: refused"),
            request("x", "cancelled", 0.3, 5.0, 5.1, 2, "run.max_duration_s reached"),
            request("y", "cancelled", 0.4, None, None, 0, "run.max_duration_s reached"),
        ]
    ).reindex(columns=REQUEST_COLUMNS)
    times = {"a": [0.2, 0.3, 0.4], "b": [0.4, 0.6], "x": [5.0, 5.1]}
    tokens = pd.DataFrame(
        [
            {"request_id": rid, "index": i, "time_s": t}
            for rid, ts in times.items()
            for i, t in enumerate(ts)
        ]
    ).reindex(columns=TOKEN_COLUMNS)
    return {"requests": requests, "tokens": tokens, "steps": pd.DataFrame(columns=STEP_COLUMNS)}


def test_cancelled_requests_are_counted_apart() -> None:
    f = frames()
    s = compute_summary(f["requests"], f["tokens"], f["steps"], slo={"ttft_s": 0.25})
    counts = ("num_requests", "num_completed", "num_failed", "num_cancelled")
    assert [s[name] for name in counts] == [5, 2, 1, 2]
    assert s["ttft_p99_s"] == pytest.approx(0.2 + 0.99 * (0.3 - 0.2))  # a 0.2, b 0.3 only
    assert s["itl_max_s"] == pytest.approx(0.2)  # b's gap; x's tokens left out
    assert s["duration_s"] == pytest.approx(0.6)  # first arrival -> b's last token, not x's
    assert s["req_per_s"] == pytest.approx(2 / 0.6)
    assert s["output_tok_per_s"] == pytest.approx(5 / 0.6)
    assert s["slo_attainment"] == pytest.approx(1 / 2)  # over a and b, not the cancelled
    assert s["goodput_req_per_s"] == pytest.approx(1 / 0.6)
    assert s["output_tokens_total"] == 7  # the engine did generate x's two tokens


def test_an_offline_window_ends_at_the_last_completion_not_a_cancelled_token() -> None:
    requests = frames()["requests"].assign(arrival_s=0.0)
    window = steady_state(requests, WindowConfig())
    assert window["kind"] == "whole_run" and window["end_s"] == pytest.approx(0.6)
    assert (window["num_requests"], window["num_cancelled"]) == (5, 2)


def test_cancelled_requests_do_not_make_up_a_windows_minimum() -> None:
    out = summarize(frames(), {}, None, WindowConfig(skip_fraction=0.0, min_requests=4))
    window = out["window"]
    assert window["valid"] is False
    assert "window holds 3 requests (2 more cancelled) < min_requests 4" in window["reason"]


def run_with(statuses: list[str]) -> SimpleNamespace:
    requests = pd.DataFrame(
        {
            "request_id": [f"r{k}" for k in range(len(statuses))],
            "status": statuses,
            "error": ["boom" if s == "failed" else "bound" for s in statuses],
        }
    )
    run = SimpleNamespace(status="complete", error=None)
    _fail_if_every_request_failed(run, requests)  # type: ignore[arg-type]
    return run


def test_a_run_whose_requests_were_all_cancelled_did_not_fail() -> None:
    assert run_with(["cancelled", "cancelled"]).status == "complete"
    assert run_with(["failed", "ok", "cancelled"]).status == "complete"


def test_a_run_whose_every_request_not_cancelled_failed_did() -> None:
    run = run_with(["cancelled", "failed", "failed"])
    assert run.status == "failed"
    assert run.error == ("every measured request failed (2 of 2, 1 cancelled); the first, r1: boom")
    assert (
        run_with(["failed"]).error == "every measured request failed (1 of 1); the first, r0: boom"
    )
