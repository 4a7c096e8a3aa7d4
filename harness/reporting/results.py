"""The results API: every run under some folders as tidy pandas tables, for notebooks and reports.

    from harness.reporting.results import load
    res = load("results/sweeps/2025-01-01_12-00-00_default")
    res.runs          # one row per run folder: ids, swept parameters, status, metrics, provenance
    res.variants      # one row per variant (a sweep job, an A/B arm): repeats pooled (medians)
    res.spread        # long: variant, metric, median/min/max/std/cv over its repeats
    res.requests      # every request of every run, with run_id (loaded on first use)
    res.join(res.requests, "variant")   # add columns of `runs` to a big table

`load` accepts run folders, Hydra sweep folders, run folders holding repeats (repeat-k/), A/B
gate folders (round-k-a/, round-k-b/) and any folder above them: it looks for summary.json
files. Tables come from parquet, or from the JSONL rows of an interrupted run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.measuring.monitors import SAMPLE_COLUMNS  # an empty samples table's columns
from harness.run_folder import (
    AB_ROUND_DIR,
    COLUMNS,
    HOW_TO_RUN_KEYS,
    REPEAT_DIR,
    SUMMARY_FILE,
    UnreadableFile,
    is_sweep,
    is_sweep_job,
    json_kind,
    read_config,
    read_json_object,
    read_jsonl,
    read_provenance,
    read_sweep_overrides,
    table_path,
)

BIG_TABLES = ("requests", "tokens", "steps", "samples")
ID_COLUMNS = ["run_id", "variant", "path", "sweep", "job", "repeat", "round", "arm"]
PROVENANCE_COLUMNS = ["machine", "hostname_hash", "git_commit", "git_dirty", "config_hash"]
SPREAD_STATS = ("median", "min", "max", "std", "cv")


def _hashable(value: Any) -> Any:
    """Lists and dicts become their JSON text, so that columns can be grouped and compared."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, default=str)
    return value


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix: _hashable(config)} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name))
        else:
            out[name] = _hashable(value)
    return out


def _task_overrides(job: Path) -> dict[str, Any]:
    """A job's overrides as sweep.csv shows them, without Hydra's own (hydra.*) and the keys
    that only say how to run."""
    values = read_sweep_overrides(job) or {}
    return {
        key: _hashable(value)
        for key, value in values.items()
        if not (key.startswith("hydra.") or key == "hydra" or key in HOW_TO_RUN_KEYS)
    }


def _machine(provenance: dict[str, Any]) -> str | None:
    cpu = (provenance.get("cpu") or {}).get("model")
    gpu = (provenance.get("gpu") or {}).get("name")
    parts = [p for p in (cpu, gpu) if p]
    return " + ".join(parts) if parts else None


def newest(root: str | Path = "results") -> Path | None:
    """The most recently written result folder under `root` (results/<kind>/<name>/ or a run
    folder right under root), or None when there is none."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = [d for d in root.glob("*/*") if d.is_dir() and not d.name.startswith(".")]
    candidates += [d for d in root.glob("*") if (d / SUMMARY_FILE).is_file() or is_sweep(d)]
    with_runs = [d for d in candidates if next(d.rglob(SUMMARY_FILE), None) is not None]
    return max(with_runs, key=lambda d: d.stat().st_mtime) if with_runs else None


# summary.json fields the loader and the report read as objects
SUMMARY_OBJECTS = ("metrics", "window", "engine", "hardware", "metrics_spread")


def _read_usable_summary(folder: Path) -> tuple[dict[str, Any], str | None]:
    """(summary.json, None), or ({}, why it cannot be used) for a summary that is damaged or
    not what the harness writes, so that the run is reported as unreadable (naming the file)
    while every other run is still reported."""
    path = folder / SUMMARY_FILE
    try:
        summary = read_json_object(path)
    except UnreadableFile as exc:
        return {}, str(exc)
    status = summary.get("status")
    if status is not None and not isinstance(status, str):
        return {}, f"{path}: `status` must be a string such as 'complete', got {json_kind(status)}"
    for key in SUMMARY_OBJECTS:
        value = summary.get(key)
        if value is not None and not isinstance(value, dict):
            return {}, f"{path}: `{key}` must be an object, got {json_kind(value)}"
    return summary, None


@dataclass
class _Run:
    """One leaf run folder (the one holding tables) and where it sits."""

    path: Path
    run_id: str
    summary: dict[str, Any]
    group_dir: Path  # the folder whose runs are repeats of one variant
    variant_key: str
    summary_error: str | None = None  # why summary.json cannot be used, naming it
    sweep: str | None = None
    job: Any = None
    repeat: int | None = None
    round: int | None = None
    arm: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)


def _natural(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Path order with numbered folders in numeric order (job 2 before job 10)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in path.parts)


def _find_run_dirs(root: Path) -> tuple[list[Path], list[Path]]:
    """(leaf run folders, folders aggregating repeats): folders holding summary.json, split by
    whether another summary.json lies below them."""
    found = sorted(
        {
            p.parent
            for p in root.rglob(SUMMARY_FILE)
            if not any(part.startswith(".") for part in p.relative_to(root).parts[:-1])
        },
        key=_natural,
    )
    if (root / SUMMARY_FILE).is_file() and root not in found:
        found.insert(0, root)
    # a folder is a parent when it is an ancestor of another found folder: collected by
    # walking each folder's ancestors (linear in the folders, so a sweep of thousands of jobs
    # does not take minutes as comparing every pair did)
    found_set = set(found)
    parents = {a for d in found for a in d.parents if a in found_set}
    return [d for d in found if d not in parents], sorted(parents, key=_natural)


def _describe(leaf: Path, base: Path) -> _Run:
    """Where `leaf` sits; its run_id is its path from `base` (the loaded folders' parent)."""
    summary, summary_error = _read_usable_summary(leaf)
    group, repeat = leaf, None
    if match := REPEAT_DIR.match(leaf.name):
        group, repeat = leaf.parent, int(match.group(1))
    run_id = leaf.relative_to(base).as_posix()
    run = _Run(
        path=leaf,
        run_id=run_id,
        summary=summary,
        group_dir=group,
        variant_key=group.as_posix(),
        summary_error=summary_error,
        repeat=repeat,
    )
    if match := AB_ROUND_DIR.match(group.name):
        run.round, run.arm = int(match.group(1)), match.group(2)
        run.variant_key = f"{group.parent.as_posix()}#{run.arm}"
        run.sweep = group.parent.name
    elif is_sweep(group.parent):
        run.sweep = group.parent.name
        run.job = int(group.name) if group.name.isdigit() else group.name
    for folder in (group, leaf):
        if is_sweep_job(folder):
            run.overrides = _task_overrides(folder)
            break
    run.config = read_config(leaf) or read_config(group) or {}
    run.provenance = read_provenance(leaf) or read_provenance(group) or {}
    return run


def _swept(frame: pd.DataFrame, columns: Iterable[str]) -> list[str]:
    """Columns constant within each variant that vary across variants."""
    out = []
    for column in columns:
        values = frame[column].astype(object).where(frame[column].notna(), None).map(str)
        if values.groupby(frame["variant_key"]).nunique().max() > 1:
            continue
        if values.nunique() > 1:
            out.append(column)
    return out


def _label(row: pd.Series, keys: list[str]) -> str:
    return ", ".join(f"{k}={_shown(row[k])}" for k in keys if pd.notna(row[k]))


def _shown(value: Any) -> Any:
    """A whole float as its integer (`rate=100`, not `rate=100.0`: a typed config stores the
    rate 100 as a float)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


class Results:
    """Tidy tables over many runs. Big tables load lazily, on first use, and are cached."""

    def __init__(self, runs: list[_Run], aggregates: dict[str, dict[str, Any]]) -> None:
        self._runs = runs
        self._aggregates = aggregates  # variant_key -> summary.json of a repeats folder
        self.swept: list[str] = []
        self._variant_keys: dict[str, str] = {}
        self.runs = self._runs_frame()

    # the runs table -----------------------------------------------------------------------
    def _runs_frame(self) -> pd.DataFrame:
        rows = []
        override_keys: list[str] = []
        for run in self._runs:
            override_keys += [k for k in run.overrides if k not in override_keys]
        for run in self._runs:
            summary = run.summary
            row: dict[str, Any] = {
                "run_id": run.run_id,
                "variant": None,
                "path": str(run.path),
                "sweep": run.sweep,
                "job": run.job,
                "repeat": run.repeat,
                "round": run.round,
                "arm": run.arm,
                "variant_key": run.variant_key,
                **{k: run.overrides.get(k) for k in override_keys},
                "status": "unreadable" if run.summary_error else summary.get("status", "missing"),
                "error": run.summary_error or summary.get("error"),
            }
            row.update(summary.get("metrics") or {})
            rows.append(row)
        if not rows:
            return pd.DataFrame(columns=[*ID_COLUMNS, "status", "error", *PROVENANCE_COLUMNS])
        frame = pd.DataFrame(rows)
        # provenance last, after every metric (runs may differ in which metrics they have)
        frame["window_valid"] = [(r.summary.get("window") or {}).get("valid") for r in self._runs]
        frame["machine"] = [_machine(r.provenance) for r in self._runs]
        for key in PROVENANCE_COLUMNS[1:]:
            frame[key] = [r.provenance.get(key) for r in self._runs]
        # a run without an override for a key (another sweep, an A/B arm) still has the value
        # in its config: fill it in where the override names a config key
        for index, run in enumerate(self._runs):
            flat = _flatten(run.config)
            for key in override_keys:
                if key not in run.overrides and key in flat:
                    frame[key] = frame[key].astype(object)
                    frame.at[index, key] = flat[key]
        for column in ("job", "repeat", "round"):
            values = [getattr(run, column) for run in self._runs]
            if all(v is None or isinstance(v, int) for v in values):
                frame[column] = pd.array(values, dtype="Int64")
        swept = _swept(frame, override_keys)
        keys_unique = frame.groupby("variant_key").first()
        if not swept or keys_unique[swept].astype(str).duplicated().any():
            # overrides do not tell the variants apart (A/B arms, separate runs): the
            # configuration keys that differ between variants do
            configs = pd.DataFrame([_flatten(run.config) for run in self._runs])
            configs = configs[[c for c in configs.columns if c not in frame.columns]]
            configs["variant_key"] = frame["variant_key"]
            extra = _swept(configs, [c for c in configs.columns if c != "variant_key"])
            if extra:
                at = frame.columns.get_loc("status")
                for offset, column in enumerate(extra):
                    frame.insert(at + offset, column, configs[column])
                swept += extra
        self.swept = swept
        labels = frame.groupby("variant_key", sort=False).first()
        named = labels.apply(lambda r: _label(r, swept), axis=1) if swept else None
        if named is None or named.duplicated().any() or (named == "").any():
            named = pd.Series({key: self._fallback_label(key) for key in labels.index})
        frame["variant"] = frame["variant_key"].map(named)
        self._variant_keys = {label: key for key, label in named.items()}
        return frame.drop(columns="variant_key")

    def _fallback_label(self, variant_key: str) -> str:
        """The variant's folder relative to what was loaded (an A/B arm: gate folder#arm)."""
        run = next(r for r in self._runs if r.variant_key == variant_key)
        label = Path(run.run_id)
        if run.repeat is not None:
            label = label.parent
        return f"{label.parent.as_posix()}#{run.arm}" if run.arm else label.as_posix()

    # the big tables -----------------------------------------------------------------------
    def table(self, name: str) -> pd.DataFrame:
        """requests, tokens, steps or samples of every run, with run_id first."""
        if name not in BIG_TABLES:
            raise ValueError(f"table: {name!r} is invalid; allowed: {'|'.join(BIG_TABLES)}")
        return getattr(self, name)

    def without_requests_table(self) -> list[tuple[str, Path]]:
        """(run_id, folder) of the runs whose summary counts completed requests but whose
        folder holds neither requests.parquet nor requests.jsonl (deleted, or lost in a copy):
        their per-request figures are missing, not empty. An imported run is not one: a source
        without per-request data (vLLM without --save-detailed) is imported without the table."""
        return [
            (run.run_id, run.path)
            for run in self._runs
            if "imported" not in run.summary
            and ((run.summary.get("metrics") or {}).get("num_completed") or 0) > 0
            and not table_path(run.path, "requests", "parquet").is_file()
            and not table_path(run.path, "requests", "jsonl").is_file()
        ]

    def _concat(self, name: str) -> pd.DataFrame:
        frames = []
        for run in self._runs:
            frame = _load_run_table(run.path, name)
            if name == "requests" and len(frame):
                frame["in_window"] = _in_window(frame, run.summary.get("window"))
            if len(frame):
                frame.insert(0, "run_id", run.run_id)
                frames.append(frame)
        if not frames:
            return pd.DataFrame(columns=["run_id", *_known_columns(name)])
        return pd.concat(frames, ignore_index=True)

    @cached_property
    def requests(self) -> pd.DataFrame:
        return self._concat("requests")

    @cached_property
    def tokens(self) -> pd.DataFrame:
        return self._concat("tokens")

    @cached_property
    def steps(self) -> pd.DataFrame:
        return self._concat("steps")

    @cached_property
    def samples(self) -> pd.DataFrame:
        return self._concat("samples")

    def join(self, frame: pd.DataFrame, *columns: str) -> pd.DataFrame:
        """`frame` with columns of `runs` (default: variant) joined on run_id."""
        wanted = list(columns or ["variant"])
        unknown = [c for c in wanted if c not in self.runs.columns]
        if unknown:
            raise ValueError(
                f"join: unknown runs column(s) {unknown}; allowed: {list(self.runs.columns)}"
            )
        return frame.merge(self.runs[["run_id", *wanted]], on="run_id", how="left")

    # per variant --------------------------------------------------------------------------
    @cached_property
    def spread(self) -> pd.DataFrame:
        """Long table: variant, metric, n, median, min, max, std, cv, over a variant's complete
        repeats (summary.json metrics_spread where written, else computed from the runs)."""
        rows = []
        for variant, runs in self.runs.groupby("variant", sort=False):
            key = self._variant_keys[str(variant)]
            written = (self._aggregates.get(key) or {}).get("metrics_spread") or {}
            if written:
                for metric, stats in written.items():
                    if not isinstance(stats, dict):  # hand-edited: not a spread to show
                        continue
                    # a repeat without this metric holds null: it is not a sample
                    values = stats.get("values")
                    values = (
                        [v for v in values if v is not None] if isinstance(values, list) else []
                    )
                    rows.append(
                        {
                            "variant": variant,
                            "metric": metric,
                            "n": len(values),
                            **{s: stats.get(s) for s in SPREAD_STATS},
                        }
                    )
                continue
            done = runs[runs["status"] == "complete"]
            if len(done) < 2:
                continue
            for metric in self.metric_columns:
                values = pd.to_numeric(done[metric], errors="coerce").dropna()
                if len(values) < 2:
                    continue
                mean = values.mean()
                std = float(values.std(ddof=1))
                rows.append(
                    {
                        "variant": variant,
                        "metric": metric,
                        "n": len(values),
                        "median": float(values.median()),
                        "min": float(values.min()),
                        "max": float(values.max()),
                        "std": std,
                        "cv": std / mean if mean else np.nan,
                    }
                )
        return pd.DataFrame(rows, columns=["variant", "metric", "n", *SPREAD_STATS])

    @cached_property
    def metric_columns(self) -> list[str]:
        """The summary metrics present in `runs`, in order."""
        names: list[str] = []
        for run in self._runs:
            names += [m for m in (run.summary.get("metrics") or {}) if m not in names]
        return [m for m in names if m in self.runs.columns]

    @cached_property
    def variants(self) -> pd.DataFrame:
        """One row per variant (sweep job, A/B arm or lone run): swept parameters, status, runs
        and their metrics; with repeats, each metric is the median over the complete ones."""
        rows = []
        for variant, runs in self.runs.groupby("variant", sort=False):
            key = self._variant_keys[str(variant)]
            first = runs.iloc[0]
            done = runs[runs["status"] == "complete"]
            aggregate = self._aggregates.get(key)
            row: dict[str, Any] = {
                "variant": first["variant"],
                "sweep": first["sweep"],
                "job": first["job"],
                "arm": first["arm"],
                **{k: first[k] for k in self.swept},
                "runs": len(runs),
                "complete": len(done),
            }
            if aggregate is not None:
                row["status"] = aggregate.get("status")
                row.update(aggregate.get("metrics") or {})
            else:
                row["status"] = (
                    "complete"
                    if len(done) == len(runs)
                    else runs["status"].iloc[-1]
                    if len(runs) == 1
                    else "incomplete"
                )
                source = done if len(done) else runs
                for metric in self.metric_columns:
                    values = pd.to_numeric(source[metric], errors="coerce").dropna()
                    row[metric] = float(values.median()) if len(values) else None
            row["error"] = "; ".join(sorted({str(e) for e in runs["error"].dropna()})) or None
            rows.append(row)
        return pd.DataFrame(rows)

    def latencies(self, window: bool = True) -> pd.DataFrame:
        """Long table of per-request TTFT and E2E and per-gap ITL of completed requests:
        run_id, variant, request_id, latency (ttft_s|itl_s|e2e_s), value_s. With `window`,
        only requests inside each run's measurement window: the ones its metrics describe."""
        from harness.measuring.metrics import inter_token_latencies, per_request_latencies

        requests, tokens = self.requests, self.tokens
        if window and "in_window" in requests:
            requests = requests[requests["in_window"].fillna(True).astype(bool)]
        parts = []
        tokens_by_run = dict(iter(tokens.groupby("run_id"))) if len(tokens) else {}
        for run_id, reqs in requests.groupby("run_id", sort=False):
            per_request = per_request_latencies(reqs)
            for kind in ("ttft_s", "e2e_s"):
                parts.append(
                    pd.DataFrame(
                        {
                            "run_id": run_id,
                            "request_id": per_request["request_id"],
                            "latency": kind,
                            "value_s": per_request[kind],
                        }
                    )
                )
            run_tokens = tokens_by_run.get(run_id)
            if run_tokens is not None:
                gaps = inter_token_latencies(run_tokens, per_request["request_id"])
                parts.append(
                    pd.DataFrame(
                        {"run_id": run_id, "request_id": None, "latency": "itl_s", "value_s": gaps}
                    )
                )
        parts = [p for p in parts if len(p)]
        if not parts:
            return pd.DataFrame(columns=["run_id", "variant", "request_id", "latency", "value_s"])
        frame = self.join(pd.concat(parts, ignore_index=True))
        return frame[["run_id", "variant", "request_id", "latency", "value_s"]]

    def provenance(self, run_id: str) -> dict[str, Any]:
        """The provenance.json of one run."""
        return self._run(run_id).provenance

    def config(self, run_id: str) -> dict[str, Any]:
        """The resolved config.yaml of one run."""
        return self._run(run_id).config

    def summary(self, run_id: str) -> dict[str, Any]:
        """The summary.json of one run."""
        return self._run(run_id).summary

    def _run(self, run_id: str) -> _Run:
        for run in self._runs:
            if run.run_id == run_id:
                return run
        raise ValueError(f"run_id: {run_id!r} is not loaded; allowed: {list(self.runs.run_id)}")

    def __repr__(self) -> str:
        variants = self.runs["variant"].nunique() if len(self.runs) else 0
        return f"Results({len(self.runs)} runs, {variants} variants)"


def _known_columns(name: str) -> list[str]:
    return list(COLUMNS.get(name) or (SAMPLE_COLUMNS if name == "samples" else []))


def _load_run_table(run_dir: Path, name: str) -> pd.DataFrame:
    parquet, jsonl = table_path(run_dir, name, "parquet"), table_path(run_dir, name, "jsonl")
    if parquet.is_file():
        try:
            return pd.read_parquet(parquet)
        except (OSError, ValueError):  # being written, or torn: the JSONL rows are the truth
            pass
    if jsonl.is_file():
        return read_jsonl(jsonl, _known_columns(name))
    return pd.DataFrame()


def _in_window(requests: pd.DataFrame, window: dict[str, Any] | None) -> pd.Series:
    """Requests inside the run's measurement window (all of them for a whole-run window)."""
    if not window or window.get("kind") != "steady_state" or "sent_s" not in requests:
        return pd.Series(True, index=requests.index)
    return requests["sent_s"].between(window["start_s"], window["end_s"])


def load(*paths: str | Path) -> Results:
    """Every run under `paths` (run, sweep, repeats or A/B folders, or folders above them)."""
    if not paths:
        raise ValueError("load: give at least one folder (a run, sweep, or results folder)")
    roots = [Path(given).resolve() for given in paths]
    for given, root in zip(paths, roots, strict=True):
        if not root.is_dir():
            raise FileNotFoundError(f"load: {given} is not a folder")
    # run ids are paths from the loaded folders' common parent: unique, and short
    base = Path(os.path.commonpath([root.parent for root in roots]))
    runs: list[_Run] = []
    aggregates: dict[str, dict[str, Any]] = {}
    seen: set[Path] = set()
    for given, root in zip(paths, roots, strict=True):
        leaves, parents = _find_run_dirs(root)
        if not leaves:
            raise FileNotFoundError(f"load: no run folder (summary.json) under {given}")
        for parent in parents:
            aggregate, problem = _read_usable_summary(parent)
            if problem is None:  # else the variant's figures come from its runs
                aggregates[parent.as_posix()] = aggregate
        for leaf in leaves:
            if leaf not in seen:
                seen.add(leaf)
                runs.append(_describe(leaf, base))
    return Results(runs, aggregates)
