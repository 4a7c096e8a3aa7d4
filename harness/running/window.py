"""The measurement window: the steady-state part of a run.

Requests sent before the first `skip_fraction` of sends are the ramp-up; the window ends at
the last send, after which the system only drains. Latency statistics cover the requests sent
inside [start, end]; rates count what completed inside it over its length, so the drain of the
last requests does not dilute throughput. The whole-run figures are kept beside them. When
every request was due at the same moment (an offline workload) there is no ramp to skip: the
window is the whole run.

As MLPerf does, a run can demand a minimum window duration and request count; a window
short of either is reported as not valid (with the reason), never silently stretched. A
window that no completion falls into (overload: every request sent inside it finishes after
the last send) is not valid either. Where the window is not valid, the rates in `metrics`
are the whole run's, and the window says which (`whole_run_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from engines.options import option
from harness.config_section import ConfigSection
from harness.measuring.metrics import DEFAULT_PERCENTILES, compute_summary


@dataclass(frozen=True)
class WindowConfig(ConfigSection):
    section = "run.window"

    skip_fraction: float = option(
        0.1, ge=0, lt=1, help="the first sends (this fraction of them) are the ramp-up"
    )
    min_duration_s: float = option(
        0.0,
        ge=0,
        unit="seconds",
        help="a shorter window is reported as not valid (as MLPerf does)",
    )
    min_requests: int = option(
        0, ge=0, help="a window holding fewer requests is reported as not valid"
    )


def steady_state(requests: pd.DataFrame, cfg: WindowConfig) -> dict[str, Any]:
    sent = requests["sent_s"].dropna().sort_values()
    ok = requests[requests["status"] == "ok"]
    # offline (everything due at once), or a closed loop wider than the workload (every
    # request sent at the start): no ramp, no steady state to cut out
    if (
        len(sent) < 2
        or requests["arrival_s"].dropna().nunique() <= 1
        or sent.iloc[-1] - sent.iloc[0] < 1e-3
    ):
        # offline: everything was due at once, so there is no ramp to skip
        start = float(requests["arrival_s"].min()) if len(requests) else 0.0
        # the last completion, as the run's duration ends (a cancelled request's last token
        # is no completion)
        last = ok["last_token_s"].max() if len(ok) else None
        end = float(last) if last is not None and pd.notna(last) else start
        kind, inside = "whole_run", pd.Series(True, index=requests.index)
    else:
        start = float(sent.iloc[int(cfg.skip_fraction * len(sent))])
        end = float(sent.iloc[-1])
        kind = "steady_state"
        inside = requests["sent_s"].between(start, end)
    members = int(inside.sum())
    cancelled = int((inside & (requests["status"] == "cancelled")).sum())
    duration = end - start
    completed = ok["last_token_s"].between(start, end)
    reasons = []
    if duration < cfg.min_duration_s:
        reasons.append(f"window {duration:.3f} s < min_duration_s {cfg.min_duration_s}")
    # a cancelled request gives the window no latency: it does not make up the minimum
    if members - cancelled < cfg.min_requests:
        held = f"{members - cancelled} requests"
        if cancelled:
            held += f" ({cancelled} more cancelled)"
        reasons.append(f"window holds {held} < min_requests {cfg.min_requests}")
    if kind == "steady_state" and not completed.any():
        # overload: every request sent inside the window finishes after the last send, so a
        # rate over the window counts 0 requests beside a positive token rate
        reasons.append("no request completed inside the window")
    return {
        "kind": kind,
        "start_s": start,
        "end_s": end,
        "num_requests": members,
        "num_completed": int(completed.sum()),
        "num_cancelled": cancelled,
        "valid": not reasons,
        "reason": "; ".join(reasons) or None,
    }


#: Metrics that count events inside the window over its length. A window that is not valid
#: gives them no meaning (under overload: 0 req/s while tokens flow), so `metrics` then holds
#: the whole run's values, and `window.whole_run_metrics` names them.
RATE_METRICS = (
    "duration_s",
    "req_per_s",
    "output_tok_per_s",
    "input_tok_per_s",
    "total_tok_per_s",
    "goodput_req_per_s",
    "energy_j",
    "j_per_output_token",
)


def summarize(
    frames: dict[str, pd.DataFrame],
    info: dict[str, Any],
    slo: dict[str, float | None] | None,
    cfg: WindowConfig,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """`metrics` over the window, `metrics_whole_run` over everything, and the window itself.
    With a steady-state window that is not valid, the rates in `metrics` are the whole run's
    (listed under `window.whole_run_metrics`); latencies stay those of the window's requests.
    `percentiles`: run.percentiles, the latency families' percentiles in both."""
    requests, tokens, steps = frames["requests"], frames["tokens"], frames["steps"]
    whole = compute_summary(requests, tokens, steps, info, slo, percentiles=percentiles)
    window = steady_state(requests, cfg)
    window["whole_run_metrics"] = []
    if window["kind"] == "whole_run":
        metrics = whole
    else:
        span = (window["start_s"], window["end_s"])
        metrics = compute_summary(
            requests, tokens, steps, info, slo, span=span, percentiles=percentiles
        )
        if not window["valid"]:
            replaced = [name for name in RATE_METRICS if name in whole or name in metrics]
            for name in replaced:
                metrics[name] = whole.get(name)
            window["whole_run_metrics"] = replaced
    return {"metrics": metrics, "metrics_whole_run": whole, "window": window}
