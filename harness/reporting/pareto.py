"""The decision view: which configuration of a sweep gives the most throughput per device (and
per dollar) for the speed each user sees, and which is best under each SLO.

Per configuration (a variant of the report: a sweep job, repeats pooled):
- throughput per device = output_tok_per_s / devices, devices = tensor x pipeline x data
  parallel size (the engine's summary, else the config; 1 when none is stated);
- output tokens per dollar = output_tok_per_s x 3600 / (hardware.cost_per_hour x devices),
  where the run's hardware states a cost per device-hour;
- throughput per user = 1 / tpot_p50_s: the token rate a typical request streams at once it
  has started. It is defined the same way for the lab's runs and for imported vLLM results
  (vLLM's TPOT), unlike output_tok_per_s / concurrency, which needs a concurrency the run may
  not have (an open-loop rate) and counts queueing and prefill as if they were decode.

The Pareto frontier keeps the configurations no other one beats on both axes at once
(`pareto_front`, a pure function). docs/reports.md describes the section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.measuring.checks import Check, CheckError, parse_checks
from harness.reporting import figures
from harness.reporting.formatting import format_metric
from harness.reporting.results import Results
from harness.run_folder import REPEAT_DIR, read_sweep_overrides

#: the per-user axis and the per-device axis of the frontier
PER_USER, PER_DEVICE, PER_DOLLAR = "tok_per_s_per_user", "tok_per_s_per_device", "tok_per_dollar"
#: engine / config keys whose product is the number of devices one run used
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
#: run.slo's per-request bounds, read as bounds on the 99th percentile for the decision
RUN_SLO_PERCENTILE = {"ttft_s": "ttft_p99_s", "tpot_s": "tpot_p99_s", "e2e_s": "e2e_p99_s"}


def pareto_front(
    points: pd.DataFrame, x: str, y: str, label: str = "variant"
) -> tuple[pd.Series, list[str]]:
    """Which rows are on the frontier when both `x` and `y` are better higher: a row is left
    off when another row is at least as good on both and better on one. Identical points are
    both kept (neither beats the other). A row whose x or y is missing, NaN or infinite is
    neither on nor off the frontier: it is False in the mask and named in the notes (by its
    `label`), so that it is not silently read as dominated."""
    xs = pd.to_numeric(points[x], errors="coerce").to_numpy(dtype=float)
    ys = pd.to_numeric(points[y], errors="coerce").to_numpy(dtype=float)
    usable = np.isfinite(xs) & np.isfinite(ys)
    notes = []
    if (~usable).any():
        names = [str(v) for v in points.loc[~usable, label]] if label in points else []
        notes.append(
            f"{int((~usable).sum())} configuration(s) without {x} or {y} left out of the "
            f"frontier: {', '.join(names)}"
        )
    mask = np.zeros(len(points), dtype=bool)
    idx = np.flatnonzero(usable)
    for i in idx:
        at_least = (xs[idx] >= xs[i]) & (ys[idx] >= ys[i])
        better = (xs[idx] > xs[i]) | (ys[idx] > ys[i])
        mask[i] = not (at_least & better).any()
    return pd.Series(mask, index=points.index), notes


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def devices_of(summary: Mapping[str, Any], config: Mapping[str, Any]) -> int:
    """Devices one run used: the product of its parallel sizes, from summary.json's engine
    facts first (what the engine ran with), else any config key ending in one of
    PARALLEL_KEYS (an engine option, or an imported vLLM sweep's server arguments); 1 when none
    is stated."""
    engine = summary.get("engine") if isinstance(summary.get("engine"), Mapping) else {}
    flat = _flat(config)
    devices = 1
    for key in PARALLEL_KEYS:
        value = _number((engine or {}).get(key))
        if value is None:
            value = next((_number(v) for k, v in flat.items() if k.rsplit(".", 1)[-1] == key), None)
        devices *= int(value) if value else 1
    return devices


def cost_of(summary: Mapping[str, Any], config: Mapping[str, Any]) -> float | None:
    """hardware.cost_per_hour (per device) as the run recorded it, else as configured."""
    hardware = summary.get("hardware")
    if isinstance(hardware, Mapping) and _number(hardware.get("cost_per_hour")):
        return _number(hardware.get("cost_per_hour"))
    configured = config.get("hardware")
    return _number(configured.get("cost_per_hour")) if isinstance(configured, Mapping) else None


def short_labels(
    variants: pd.DataFrame, keys: Sequence[str], fallback: pd.Series | None = None
) -> pd.Series:
    """Each configuration as the swept keys that vary between them, `max_num_seqs=8
    variant=int8`: a key by its last dotted part unless two keys share it; `fallback` (by
    default the `variant` column) where no key varies."""
    fallback = variants["variant"] if fallback is None else fallback
    varying = [
        k for k in keys if k in variants and variants[k].astype(str).nunique(dropna=False) > 1
    ]
    last = [k.rsplit(".", 1)[-1] for k in varying]
    names = [s if last.count(s) == 1 else k for k, s in zip(varying, last, strict=True)]

    def label(row: pd.Series) -> str:
        parts = [f"{n}={_shown(row[k])}" for k, n in zip(varying, names, strict=True)]
        return " ".join(parts) or str(fallback[row.name])

    return variants.apply(label, axis=1) if len(variants) else pd.Series(dtype=str)


def _shown(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _swept_values(row: pd.Series, keys: Sequence[str], run_path: Path) -> dict[str, Any]:
    """The swept settings of a configuration. The runs table names its label column
    `variant`, so a sweep over the `variant` config group (variant=int8) has its value read
    back from the job's overrides."""
    job = run_path.parent if REPEAT_DIR.match(run_path.name) else run_path
    overrides = read_sweep_overrides(job) or {}
    return {k: overrides[k] if k in overrides else row.get(k) for k in keys}


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    """A metric column as floats; all NaN where no configuration has it (an aggregate
    summary of repeats may hold only some metrics)."""
    if name not in frame:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[name], errors="coerce").astype(float)


def decision_points(res: Results) -> tuple[pd.DataFrame, list[str]]:
    """One row per complete configuration: its label, throughput per user, per device and per
    dollar, devices, cost, and every metric (for the SLO checks); notes on what is missing."""
    variants = res.variants
    notes: list[str] = []
    if variants.empty:
        return variants, notes
    done = variants[variants["status"].astype(str).str.startswith("complete")].copy()
    if len(done) < len(variants):
        notes.append(f"{len(variants) - len(done)} configuration(s) did not complete: left out")
    first_run = res.runs.groupby("variant", sort=False)["run_id"].first()
    paths = res.runs.set_index("run_id")["path"]
    devices, costs, settings = [], [], []
    for _, row in done.iterrows():
        run_id = first_run[row["variant"]]
        summary, config = res.summary(run_id), res.config(run_id)
        devices.append(devices_of(summary, config))
        costs.append(cost_of(summary, config))
        settings.append(_swept_values(row, res.swept, Path(paths[run_id])))
    done["devices"] = devices
    done["cost_per_hour"] = pd.array(costs, dtype="Float64")
    swept = pd.DataFrame(settings, index=done.index, columns=list(res.swept))
    done["label"] = short_labels(swept, res.swept, done["variant"]).to_numpy()
    tput, tpot = _column(done, "output_tok_per_s"), _column(done, "tpot_p50_s")
    done[PER_DEVICE] = tput / done["devices"]
    done[PER_USER] = (1.0 / tpot.where(tpot > 0)).astype(float)
    cost = done["cost_per_hour"].astype(float)
    done[PER_DOLLAR] = tput * 3600.0 / (cost * done["devices"])
    return done.reset_index(drop=True), notes


def given_slos(
    res: Results, slos: Sequence[str]
) -> tuple[list[tuple[str, tuple[Check, ...]]], list[str]]:
    """The SLOs to decide on, each as (name, checks): every --slo given (one check each, the
    report's argument parser has checked them), then the sweeps' own: `run.search.slo` (the
    capacity search's checks) and `run.slo` (per-request bounds, read as bounds on p99), once
    each. Notes say which configured SLOs could not be read."""
    out: list[tuple[str, tuple[Check, ...]]] = []
    for k, text in enumerate(slos):
        checks = parse_checks(text, f"--slo[{k}]")
        out.append((" and ".join(map(str, checks)), checks))
    notes: list[str] = []
    seen = {name for name, _ in out}
    for run_id in res.runs["run_id"]:
        config = res.config(run_id)
        run = config.get("run") if isinstance(config, dict) else None
        if not isinstance(run, Mapping):
            continue
        candidates: list[tuple[str, Any]] = []
        search = run.get("search")
        if isinstance(search, Mapping) and search.get("slo"):
            candidates.append(("run.search.slo", search.get("slo")))
        slo = run.get("slo")
        if isinstance(slo, Mapping):
            bounds = [
                f"{RUN_SLO_PERCENTILE[k]} <= {v}"
                for k, v in slo.items()
                if k in RUN_SLO_PERCENTILE and v is not None
            ]
            if bounds:
                candidates.append(("run.slo", bounds))
        for where, value in candidates:
            try:
                checks = parse_checks(value, where)
            except CheckError as exc:
                if str(exc) not in notes:
                    notes.append(f"{exc}: not used")
                continue
            name = " and ".join(map(str, checks))
            if checks and name not in seen:
                seen.add(name)
                out.append((name, checks))
    return out, notes


def meeting(points: pd.DataFrame, checks: tuple[Check, ...]) -> pd.Series:
    """Which configurations meet every check (a metric one lacks does not meet it)."""
    if points.empty:
        return pd.Series(dtype=bool)
    met = points.apply(lambda row: all(c.holds(row.to_dict()) is True for c in checks), axis=1)
    return met.astype(bool)


def best_under(points: pd.DataFrame, checks: tuple[Check, ...]) -> pd.Series | None:
    """The configuration with the highest throughput per device among those meeting every
    check; None when none does."""
    eligible = points[meeting(points, checks)] if len(points) else points
    eligible = eligible[pd.to_numeric(eligible[PER_DEVICE], errors="coerce").notna()]
    if eligible.empty:
        return None
    return eligible.loc[pd.to_numeric(eligible[PER_DEVICE]).idxmax()]


def _table(points: pd.DataFrame, with_cost: bool) -> pd.DataFrame:
    columns = {
        "label": "configuration",
        PER_USER: "tok/s per user (1/TPOT p50)",
        PER_DEVICE: "tok/s per device",
        "devices": "devices",
        "output_tok_per_s": "output tok/s",
        "tpot_p50_s": "TPOT p50",
        "ttft_p99_s": "TTFT p99",
    }
    if with_cost:
        columns[PER_DOLLAR] = "output tokens per $"
    table = points[[c for c in columns if c in points]].copy()
    for column in table.columns:
        if column in ("output_tok_per_s", "tpot_p50_s", "ttft_p99_s"):
            table[column] = [format_metric(column, v) for v in table[column]]
        elif column in (PER_USER, PER_DEVICE, PER_DOLLAR):
            table[column] = [f"{v:,.4g}" if pd.notna(v) else "-" for v in table[column]]
    return table.rename(columns=columns)


def section_decision(res: Results, doc: Any, slos: Sequence[str] = ()) -> None:
    """The report's decision section: the frontier figure and table, the best configuration
    under each SLO (`doc` is report.Document; a capacity search's answer is in its own
    section, report.section_search)."""
    doc.heading("Pareto frontier and decision")
    points, notes = decision_points(res)
    if len(points) < 2:
        doc.note(
            "Skipped the frontier: needs two or more complete configurations (a sweep, or "
            "several run folders)."
        )
    else:
        _frontier(points, notes, doc)
        _decisions(res, points, slos, doc)


def _frontier(points: pd.DataFrame, notes: list[str], doc: Any) -> None:
    with_cost = bool(points[PER_DOLLAR].notna().any())
    panels = [(PER_DEVICE, "output tok/s per device")]
    if with_cost:
        panels.append((PER_DOLLAR, "output tokens per dollar"))
    for y, _ in panels:
        mask, skipped = pareto_front(points, PER_USER, y, label="label")
        points[f"on_front_{y}"] = mask
        notes += skipped
    front = points[points[f"on_front_{PER_DEVICE}"]]
    if front.empty:
        doc.note("Skipped the frontier: no configuration has both output_tok_per_s and tpot_p50_s.")
        return
    doc.figure(
        figures.pareto(points, PER_USER, panels, "output tok/s per user (1 / TPOT p50)"),
        "pareto",
        "Throughput per device"
        + (" and per dollar" if with_cost else "")
        + " against throughput per user (1 / TPOT p50), one point per configuration; red: "
        "the Pareto frontier (no other configuration is better on both axes).",
    )
    for note in dict.fromkeys(notes):
        doc.note(note)
    doc.text(f"Frontier configurations ({len(front)} of {len(points)}), slowest per user first:")
    doc.table(_table(front.sort_values(PER_USER), with_cost))
    if with_cost and (points["cost_per_hour"].isna()).any():
        doc.note("Some configurations state no hardware.cost_per_hour: no tokens per dollar.")


def _decisions(res: Results, points: pd.DataFrame, slos: Sequence[str], doc: Any) -> None:
    decisions, notes = given_slos(res, slos)
    for note in notes:
        doc.note(note)
    if not decisions:
        doc.text(
            "No SLO given (`inferlab report --slo 'tpot_p99_s <= 0.05'`, or the sweep's "
            "run.slo / run.search.slo): no best configuration named."
        )
        return
    rows = []
    for name, checks in decisions:
        best = best_under(points, checks)
        # a metric no configuration has (ttft_p97_s outside run.percentiles, a search's
        # max_rate_at_slo): not a verdict on the configurations
        absent = [
            c.metric
            for c in checks
            if c.metric not in points
            or pd.to_numeric(points[c.metric], errors="coerce").isna().all()
        ]
        verdict = f"no configuration has {', '.join(dict.fromkeys(absent))}" if absent else None
        rows.append(
            {
                "SLO": name,
                "best configuration": verdict
                or ("none meets it" if best is None else best["label"]),
                "tok/s per device": "-" if best is None else f"{best[PER_DEVICE]:,.4g}",
                "tok/s per user": "-"
                if best is None or pd.isna(best[PER_USER])
                else f"{best[PER_USER]:,.4g}",
                "meet it": f"{int(meeting(points, checks).sum())} of {len(points)}",
            }
        )
    doc.text(
        "Best configuration per SLO: the highest throughput per device among the "
        "configurations meeting every check of it (a metric a configuration lacks does not "
        "meet it)."
    )
    doc.table(pd.DataFrame(rows))
