"""A metric's value as the report and the printed tables show it: with its unit, bytes in
binary units, fractions as percentages."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from harness.measuring.metrics import find_metric
from harness.running.table import format_value


def format_metric(name: str, value: Any) -> str:
    """A metric value with its unit, as the run's printed table shows it."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "-"
    metric = find_metric(name)  # a percentile of run.percentiles (ttft_p75_s) too
    unit = metric.unit if metric is not None else ""
    if name.endswith("_bytes") or unit == "B":
        return _bytes(float(value))
    if name.endswith("_s") and not unit:
        unit = "s"
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if unit == "fraction":
        return f"{value:.1%}"
    if isinstance(value, float) and value.is_integer() and unit in ("count", "tokens", "seqs"):
        value = int(value)
    if isinstance(value, float) and not unit:
        return f"{value:.4g}"
    return format_value(value, unit)


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"
