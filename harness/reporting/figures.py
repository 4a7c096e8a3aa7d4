"""Report figures: each function takes tidy frames and returns a matplotlib Figure.

Figures are built without pyplot, so nothing here picks a backend or keeps figures open:
saving renders with Agg (no display needed, as on a CI machine), and in a notebook the
returned Figure displays inline.

The callers (harness.reporting.report, notebooks) prepare the data; these only draw it. Every
figure has one line (or bar, or point set) per variant, labelled with the variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from harness.measuring.roofline import attainable_flops

LATENCY_TITLES = {"ttft_s": "TTFT", "itl_s": "ITL", "e2e_s": "E2E latency"}
MAX_LINES = 10  # beyond this a legend is unreadable; callers say which variants were left out


def _seconds_axis(values: np.ndarray) -> tuple[float, str]:
    """Scale and unit so that typical values read as plain numbers (ms below a second)."""
    finite = values[np.isfinite(values)]
    return (1e3, "ms") if len(finite) and np.nanmedian(finite) < 1 else (1.0, "s")


def latency_cdfs(latencies: pd.DataFrame) -> Figure:
    """Empirical CDFs, one panel per latency (columns variant, latency, value_s)."""
    kinds = [k for k in LATENCY_TITLES if k in set(latencies["latency"])]
    fig, axes = _subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        rows = latencies[latencies["latency"] == kind]
        scale, unit = _seconds_axis(rows["value_s"].to_numpy(dtype=float))
        for variant, group in rows.groupby("variant", sort=False):
            values = np.sort(group["value_s"].dropna().to_numpy(dtype=float)) * scale
            if len(values):
                fraction = np.arange(1, len(values) + 1) / len(values)
                ax.step(values, fraction, where="post", label=str(variant))
        ax.set_xlabel(f"{LATENCY_TITLES[kind]} ({unit})")
        ax.set_ylabel("fraction of requests" if kind != "itl_s" else "fraction of token gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def throughput_latency(
    points: pd.DataFrame, x: str, ys: Sequence[str], slo: dict[str, float | None]
) -> Figure:
    """Latency against achieved throughput, one line per series (columns series, x, *ys),
    points in offered-load order and labelled with their offered rate (offered_req_per_s);
    dashed lines at the SLO bounds (slo: {column: bound})."""
    fig, axes = _subplots(1, len(ys), figsize=(4.6 * len(ys), 3.6), squeeze=False)
    for ax, y in zip(axes[0], ys, strict=True):
        scale, unit = _seconds_axis(points[y].to_numpy(dtype=float))
        for series, group in points.groupby("series", sort=False):
            ax.plot(group[x], group[y] * scale, marker="o", label=str(series))
            for _, point in group.iterrows():  # which offered rate each point is
                ax.annotate(
                    f"{point['offered_req_per_s']:.3g}/s",
                    (point[x], point[y] * scale),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        bound = slo.get(y)
        if bound is not None:
            ax.axhline(
                bound * scale,
                color="red",
                linestyle="--",
                linewidth=1,
                label=f"SLO {bound * scale:g} {unit}",
            )
        ax.set_xlabel(f"achieved {x}")
        ax.set_ylabel(f"{y} ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def timeline(steps: pd.DataFrame) -> Figure:
    """Batch size and KV memory per engine step over time (columns variant, end_s, num_seqs,
    kv_bytes_used, kv_bytes_reserved)."""
    fig, (batch_ax, kv_ax) = _subplots(2, 1, figsize=(8, 5.2), sharex=True)
    for variant, group in steps.groupby("variant", sort=False):
        group = group.sort_values("end_s")
        line = batch_ax.plot(
            group["end_s"],
            group["num_seqs"],
            drawstyle="steps-post",
            label=str(variant),
            linewidth=1,
        )[0]
        for column, style in (("kv_bytes_used", "-"), ("kv_bytes_reserved", ":")):
            kv_ax.plot(
                group["end_s"],
                group[column] / 2**20,
                drawstyle="steps-post",
                color=line.get_color(),
                linewidth=1,
                linestyle=style,
            )
    batch_ax.set_ylabel("sequences in the step")
    kv_ax.set_ylabel("KV MiB (solid: used,\ndotted: reserved)")
    kv_ax.set_xlabel("time since the run started (s)")
    for ax in (batch_ax, kv_ax):
        ax.grid(alpha=0.3)
    batch_ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def timeslices(table: pd.DataFrame) -> Figure:
    """Output throughput and TTFT p99 per slice of one run (timeslices.csv's columns
    slice_start_s, slice_end_s, output_tok_per_s, ttft_p99_s); a slice's value is drawn
    across it."""
    fig, (rate_ax, ttft_ax) = _subplots(2, 1, figsize=(8, 4.6), sharex=True)
    edges = np.append(table["slice_start_s"].to_numpy(float), table["slice_end_s"].iloc[-1])

    def across_slices(ax: Axes, values: np.ndarray) -> None:
        # the last value repeated so that steps-post draws the last slice too
        ax.plot(edges, np.append(values, values[-1:]), drawstyle="steps-post", linewidth=1.2)

    across_slices(rate_ax, table["output_tok_per_s"].to_numpy(float))
    ttft = table["ttft_p99_s"].to_numpy(float)
    scale, unit = _seconds_axis(ttft)
    across_slices(ttft_ax, ttft * scale)
    rate_ax.set_ylabel("output tok/s")
    ttft_ax.set_ylabel(f"TTFT p99 ({unit})")
    ttft_ax.set_xlabel("time since the run started (s)")
    for ax in (rate_ax, ttft_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def stacked_bars(
    parts: pd.DataFrame,
    xlabel: str,
    scale: float = 1.0,
    marks: pd.Series | None = None,
    mark_label: str = "",
) -> Figure:
    """Horizontal stacked bars: one bar per row (the index, a variant), one segment per
    column (memory kinds, request phases); `marks` (same index) draws a tick on each bar."""
    fig, ax = _subplots(figsize=(9.5, 0.5 * len(parts) + 1.8))
    left = np.zeros(len(parts))
    labels = [str(i) for i in parts.index]
    for column in parts.columns:
        values = parts[column].fillna(0).to_numpy(dtype=float) * scale
        ax.barh(labels, values, left=left, label=column)
        left += values
    if marks is not None:
        values = marks.reindex(parts.index).to_numpy(dtype=float) * scale
        ax.scatter(
            values, labels, marker="|", s=400, color="black", zorder=3, label=mark_label or None
        )
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the bars
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def samples_timeline(samples: pd.DataFrame, columns: Sequence[str]) -> Figure:
    """Monitor samples over time, one panel per column (columns variant, time_s, *columns)."""
    fig, axes = _subplots(
        len(columns), 1, figsize=(8, 2.2 * len(columns) + 0.6), sharex=True, squeeze=False
    )
    for ax, column in zip(axes[:, 0], columns, strict=True):
        in_bytes = column.endswith("_bytes")
        for variant, group in samples.groupby("variant", sort=False):
            # a source read less often than every sample (a server's scrapes) is NaN between
            group = group[["time_s", column]].dropna().sort_values("time_s")
            values = group[column] / 2**20 if in_bytes else group[column]
            ax.plot(group["time_s"], values, label=str(variant), linewidth=1, marker=".")
        ax.set_ylabel(column.replace("_bytes", " (MiB)") if in_bytes else column)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the run started (s)")
    axes[0, 0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def roofline(
    points: pd.DataFrame, peak_flops: float | None, bandwidth: float | None, overlap: float = 1.0
) -> Figure:
    """Left: achieved FLOP/s against arithmetic intensity per step (columns variant,
    intensity, flops_per_s, prefill), under the hardware roofline when its peaks are known
    (and, for a spec that measured an overlap below 1, the curve `predicted_s` follows).
    Right: roofline-predicted against measured step time (columns predicted_s, measured_s)."""
    has_prediction = {"predicted_s", "measured_s"} <= set(points.columns) and points[
        "predicted_s"
    ].notna().any()
    fig, axes = _subplots(
        1, 2 if has_prediction else 1, figsize=(10 if has_prediction else 5.5, 4), squeeze=False
    )
    ax = axes[0, 0]
    for variant, group in points.groupby("variant", sort=False):
        for prefill, marker in ((False, "o"), (True, "^")):
            part = group[group["prefill"] == prefill]
            if len(part):
                ax.scatter(
                    part["intensity"],
                    part["flops_per_s"],
                    s=10,
                    marker=marker,
                    alpha=0.6,
                    label=f"{variant} ({'prefill' if prefill else 'decode'})",
                )
    finite = points["intensity"][np.isfinite(points["intensity"]) & (points["intensity"] > 0)]
    if peak_flops and bandwidth and len(finite):
        lo, hi = finite.min() / 4, max(finite.max() * 4, 2 * peak_flops / bandwidth)
        grid = np.geomspace(lo, hi, 200)
        ax.plot(
            grid,
            attainable_flops(grid, peak_flops, bandwidth),
            color="black",
            linewidth=1.2,
            label="roofline",
        )
        if overlap < 1.0:
            ax.plot(
                grid,
                attainable_flops(grid, peak_flops, bandwidth, overlap),
                color="black",
                linewidth=1.0,
                linestyle="--",
                label=f"with the measured overlap {overlap:.2f} (predicted_s)",
            )
    _log_log(ax, "arithmetic intensity (FLOP / byte moved)", "achieved FLOP/s")
    if has_prediction:
        ax = axes[0, 1]
        for variant, group in points.groupby("variant", sort=False):
            ax.scatter(
                group["predicted_s"] * 1e3,
                group["measured_s"] * 1e3,
                s=10,
                alpha=0.6,
                label=str(variant),
            )
        both = points[["predicted_s", "measured_s"]].to_numpy(dtype=float).ravel() * 1e3
        both = both[np.isfinite(both) & (both > 0)]
        if len(both):
            ax.plot(
                [both.min(), both.max()],
                [both.min(), both.max()],
                color="black",
                linewidth=1,
                label="measured = predicted",
            )
        _log_log(ax, "roofline-predicted step time (ms)", "measured step time (ms)")
    fig.tight_layout()
    return fig


def pareto(points: pd.DataFrame, x: str, ys: Sequence[tuple[str, str]], xlabel: str) -> Figure:
    """One panel per (column, axis label) in `ys` against `x`: every configuration as a grey
    point, the frontier's (column `on_front_<column>`) marked, joined in x order and labelled
    with the configuration (column `label`)."""
    fig, axes = _subplots(1, len(ys), figsize=(6.2 * len(ys), 4.6), squeeze=False)
    for ax, (y, ylabel) in zip(axes[0], ys, strict=True):
        shown = points[np.isfinite(points[x].astype(float)) & np.isfinite(points[y].astype(float))]
        ax.scatter(shown[x], shown[y], color="0.6", s=22, label="configurations")
        front = shown[shown[f"on_front_{y}"].astype(bool)].sort_values(x)
        ax.plot(
            front[x], front[y], color="tab:red", marker="o", linewidth=1.2, label="Pareto frontier"
        )
        # every point named (a dominated one in grey): which configuration lost matters too
        for _, point in shown.iterrows():
            on_front = bool(point[f"on_front_{y}"])
            ax.annotate(
                str(point["label"]),
                (point[x], point[y]),
                fontsize=7 if on_front else 6,
                color="black" if on_front else "0.45",
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.margins(x=0.25, y=0.12)  # room for the labels of the outermost points
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _log_log(ax: Axes, xlabel: str, ylabel: str) -> None:
    """Both axes logarithmic, labelled, gridded, with a small legend."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)


def speculative_speedups(points: pd.DataFrame, axis: str) -> Figure:
    """Speculative decoding's speed-up in output tokens/s over no speculation: against the load
    (`axis`: concurrency or batch size), one line per series, and against the acceptance rate,
    one point per variant (columns series, speedup, spec_acceptance_rate and `axis`)."""
    fig, (load_ax, accept_ax) = _subplots(1, 2, figsize=(10, 3.8))
    for series, group in points.groupby("series", sort=False):
        group = group.sort_values(axis)
        (line,) = load_ax.plot(group[axis], group["speedup"], marker="o", label=str(series))
        accept_ax.scatter(
            group["spec_acceptance_rate"], group["speedup"], color=line.get_color(), s=18
        )
    for ax in (load_ax, accept_ax):
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel("speed-up (output tok/s vs no speculation)")
        ax.grid(alpha=0.3)
    load_ax.set_xlabel(axis)
    if (points[axis] > 0).all():  # concurrency doubles from point to point
        load_ax.set_xscale("log", base=2)
    load_ax.legend(fontsize=6)
    accept_ax.set_xlabel("acceptance rate (drafts kept / proposed)")
    fig.tight_layout()
    return fig


def _subplots(rows: int = 1, cols: int = 1, *, figsize: tuple[float, float], **kwargs: Any) -> Any:
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(rows, cols, **kwargs)


def save(fig: Figure, path: str) -> None:
    fig.savefig(path, dpi=110)


def _or_nan(value: Any) -> float:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else np.nan
    )


def capacity_search(records: Sequence[dict[str, Any]]) -> Figure:
    """A capacity search (harness/running/capacity_sweep.py records, one per search): for each
    SLO check a panel of its metric against load, points that meet filled, misses crossed,
    the bound dashed and the answer a vertical line; several searches (a grid) one colour
    each."""
    checks = list(dict.fromkeys(c for r in records for c in r.get("slo") or []))
    fig, axes = _subplots(1, max(1, len(checks)), figsize=(4.4 * max(1, len(checks)), 3.6),
                          squeeze=False)  # fmt: skip
    for ax, check in zip(axes[0], checks, strict=False):
        metric, op, bound_text = check.split()
        bound = float(bound_text)
        values = [
            (p.get("metrics") or {}).get(metric) for r in records for p in r.get("points") or []
        ]
        seconds = metric.endswith("_s")
        finite = np.array([v for v in values if v is not None], dtype=float)
        scale, unit = _seconds_axis(finite) if seconds else (1.0, "")
        for index, record in enumerate(records):
            colour = f"C{index % 10}"
            grid = record.get("grid") or {}
            label = ", ".join(f"{k}={v}" for k, v in grid.items()) or None
            points = sorted(
                (p for p in record.get("points") or [] if p.get("load") is not None),
                key=lambda p: p["load"],
            )
            xs = [p["load"] for p in points]
            # a failed run has no value: a gap (a value of 0 is a value: num_failed <= 0)
            ys = [_or_nan((p.get("metrics") or {}).get(metric)) * scale for p in points]
            ax.plot(xs, ys, color=colour, linewidth=1, alpha=0.6, label=label)
            for x, y, point in zip(xs, ys, points, strict=True):
                meets = point.get("meets")
                ax.scatter([x], [y], color=colour, marker="o" if meets else "x",
                           facecolors=colour if meets else None, zorder=3)  # fmt: skip
            answer = record.get("max_rate_at_slo", record.get("max_concurrency_at_slo"))
            if answer is not None:
                ax.axvline(answer, color=colour, linestyle=":", linewidth=1.2)
                ax.annotate(f"{answer:.3g}", (answer, 1), xycoords=("data", "axes fraction"),
                            fontsize=7, xytext=(2, -10), textcoords="offset points")  # fmt: skip
        ax.axhline(bound * scale, color="red", linestyle="--", linewidth=1,
                   label=f"SLO {op} {bound * scale:g}{' ' + unit if unit else ''}")  # fmt: skip
        loads = [p["load"] for r in records for p in r.get("points") or [] if p.get("load")]
        if loads and max(loads) / min(loads) > 10:
            ax.set_xscale("log")
        over = records[0].get("over", "rate")
        ax.set_xlabel("request rate (req/s)" if over == "rate" else "concurrency (requests)")
        ax.set_ylabel(f"{metric}" + (f" ({unit})" if unit else ""))
        ax.set_title(check, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("capacity search: o meets, x misses, dotted: the answer", fontsize=9)
    fig.tight_layout()
    return fig
