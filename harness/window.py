"""The measurement window: the steady-state part of a run.

Requests sent before the first `skip_fraction` of sends are the ramp-up; requests sent after
the last send cannot exist, so the window ends at the last send, after which the system only
drains. Summary metrics are computed over the requests sent inside [start, end] (their whole
lifetimes), with the whole-run figures kept beside them. When every request was due at the
same moment (an offline workload) there is no ramp to skip: the window is the whole run.

As MLPerf does, a run can demand a minimum window duration and request count; a window
short of either is reported as not valid (with the reason), never silently stretched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.metrics import compute_summary


@dataclass
class WindowConfig:
    skip_fraction: float = 0.1
    min_duration_s: float = 0.0
    min_requests: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> WindowConfig:
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"run.window: unknown key(s) {unknown}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}")
        cfg = cls(**values)
        if not 0.0 <= cfg.skip_fraction < 1.0:
            raise ValueError(f"run.window.skip_fraction: {cfg.skip_fraction} is invalid; "
                             "allowed: a number in [0, 1)")
        return cfg


def steady_state(requests: pd.DataFrame, cfg: WindowConfig) -> dict[str, Any]:
    sent = requests["sent_s"].dropna().sort_values()
    arrivals = requests["arrival_s"].dropna()
    if len(sent) < 2 or arrivals.nunique() <= 1:  # offline: everything due at once
        kind, start, end = "whole_run", None, None
    else:
        start = float(sent.iloc[int(cfg.skip_fraction * len(sent))])
        end = float(sent.iloc[-1])
        kind = "steady_state" if end > start else "whole_run"
    if kind == "whole_run":
        members = requests
        start = float(requests["arrival_s"].min()) if len(requests) else 0.0
        end = float(requests["last_token_s"].max()) if requests["last_token_s"].notna().any() \
            else start
    else:
        members = requests[(requests["sent_s"] >= start) & (requests["sent_s"] <= end)]
    duration = end - start
    reasons = []
    if duration < cfg.min_duration_s:
        reasons.append(f"window {duration:.3f} s < min_duration_s {cfg.min_duration_s}")
    if len(members) < cfg.min_requests:
        reasons.append(f"window holds {len(members)} requests < min_requests {cfg.min_requests}")
    return {"kind": kind, "start_s": start, "end_s": end, "num_requests": len(members),
            "valid": not reasons, "reason": "; ".join(reasons) or None,
            "request_ids": members["request_id"].tolist()}


def summarize(frames: dict[str, pd.DataFrame], info: dict[str, Any],
              slo: dict[str, float | None] | None, cfg: WindowConfig) -> dict[str, Any]:
    """`metrics` over the window, `metrics_whole_run` over everything, and the window itself."""
    requests, tokens, steps = frames["requests"], frames["tokens"], frames["steps"]
    whole = compute_summary(requests, tokens, steps, info, slo)
    window = steady_state(requests, cfg) if len(requests) else {
        "kind": "whole_run", "valid": cfg.min_requests == 0 and cfg.min_duration_s == 0,
        "reason": None, "request_ids": []}
    ids = set(window.pop("request_ids"))
    if window["kind"] == "whole_run":
        metrics = whole
    else:
        in_window = requests[requests["request_id"].isin(ids)]
        metrics = compute_summary(
            in_window, tokens[tokens["request_id"].isin(ids)],
            steps[(steps["start_s"] >= window["start_s"]) & (steps["end_s"] <= window["end_s"])],
            info, slo)
    return {"metrics": metrics, "metrics_whole_run": whole, "window": window}
