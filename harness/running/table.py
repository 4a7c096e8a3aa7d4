"""The short result table a run prints."""

from __future__ import annotations

from typing import Any

from harness.measuring.metrics import REGISTRY

HEADLINE = (
    "num_requests",
    "num_failed",
    "duration_s",
    "output_tok_per_s",
    "req_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "itl_p50_s",
    "itl_p99_s",
    "e2e_p50_s",
    "mean_batch_size",
    "num_steps",
    "cold_start_s",
)


def format_value(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if isinstance(value, float):
        return f"{value:,.2f} {unit}".strip()
    return f"{value:,} {unit if unit != 'count' else ''}".strip()


WHOLE_RUN_MARK = "*"


def summary_table(
    metrics: dict[str, Any], names: tuple[str, ...] = HEADLINE, window: dict[str, Any] | None = None
) -> str:
    """The metrics as aligned lines. With the run's `window` (summary.json): the values taken
    from the whole run because the window is not valid are marked, and a footnote says why."""
    window = window or {}
    whole_run = set(window.get("whole_run_metrics") or ())
    rows = [
        (
            name,
            format_value(metrics.get(name), REGISTRY[name].unit)
            + (f" {WHOLE_RUN_MARK}" if name in whole_run else ""),
        )
        for name in names
        if name in metrics
    ]
    width = max(len(n) for n, _ in rows) if rows else 0
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    if whole_run & {name for name, _ in rows}:
        lines.append(
            f"  {WHOLE_RUN_MARK} over the whole run: the steady-state window is not "
            f"valid ({window.get('reason')})"
        )
    return "\n".join(lines)
