"""The short result table a run prints."""

from __future__ import annotations

from typing import Any

from harness.metrics import REGISTRY

HEADLINE = (
    "num_requests", "num_failed", "duration_s", "output_tok_per_s", "req_per_s",
    "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
    "mean_batch_size", "num_steps", "cold_start_s",
)


def format_value(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if isinstance(value, float):
        return f"{value:,.2f} {unit}".strip()
    return f"{value:,} {unit if unit != 'count' else ''}".strip()


def summary_table(metrics: dict[str, Any], names: tuple[str, ...] = HEADLINE) -> str:
    rows = [(name, format_value(metrics.get(name), REGISTRY[name].unit))
            for name in names if name in metrics]
    width = max(len(n) for n, _ in rows) if rows else 0
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
