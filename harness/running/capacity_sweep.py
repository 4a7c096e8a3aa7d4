"""The capacity search as a sweep (docs/capacity.md): what inferlab's sweeper
(hydra_plugins/inferlab_sweeper) needs to run harness/running/capacity_search.py through its
launcher: the overrides that put a job at a load, the measurement a finished job folder holds,
and the search's outputs in the sweep folder (search.json, search.png, the keys it adds to
sweep_summary.json, the console line)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.run_folder import (
    SEARCH_FILE,
    UnreadableFile,
    read_search_records,
    read_summary,
    write_json_atomic,
)
from harness.running.capacity_search import (
    ANSWER_KEY,
    UNIT,
    Measurement,
    Point,
    Probe,
    SearchResult,
)
from harness.running.run_config import RunConfig, SearchConfig

SEARCH_FIGURE = "search.png"
_ROLES = {"low": "synchronous", "high": "throughput"}


def search_of(config: Mapping[str, Any]) -> tuple[SearchConfig, dict[str, Any], int | None]:
    """A job's `run.search` (checked), its `workload.arrival` and `workload.num_requests`.
    Raises ValueError naming the key when the workload cannot be put at a load."""
    # the whole run section: a check is held against run.percentiles and run.slo too
    search = RunConfig.from_dict(config.get("run")).search
    workload = config.get("workload") or {}
    arrival = workload.get("arrival") if isinstance(workload, Mapping) else None
    if not isinstance(arrival, Mapping):
        raise ValueError(
            f"run.search: the workload ({workload.get('type', '?')}) has no workload.arrival "
            "to set a load with; allowed: a workload with arrivals (synthetic, prompts, mixed)"
        )
    num = workload.get("num_requests")
    num_requests = num if isinstance(num, int) and not isinstance(num, bool) else None
    if num_requests is None and (search.over == "concurrency" or search.max_load is None):
        raise ValueError(
            "run.search: workload.num_requests is not set; the throughput run (and a "
            "concurrency range) needs it, or set run.search.max_load"
        )
    if search.over == "concurrency" and num_requests is not None:
        # a closed loop keeps no more in flight than there are requests: a concurrency past
        # num_requests measures num_requests again
        for name in ("min_load", "max_load"):
            value = getattr(search, name)
            if value is not None and value > num_requests - (name == "min_load"):
                most = num_requests - (name == "min_load")
                raise ValueError(
                    f"run.search.{name}: {value:g} is invalid with over=concurrency and "
                    f"workload.num_requests={num_requests}; allowed: at most {most} (a closed "
                    "loop keeps no more requests in flight than the workload has)"
                )
    return search, dict(arrival), num_requests


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def load_overrides(
    probe: Probe, over: str, arrival: Mapping[str, Any], num_requests: int | None
) -> list[str]:
    """The overrides that put a job at the probe's load: the low bounding run synchronous
    (a closed loop of 1), the high one every request at once; any other at its load. Keys of
    the configured arrival that the new process does not take are set to null."""
    if probe.load is None and probe.role == "low":
        keys: dict[str, Any] = {"process": "closed", "concurrency": 1}
    elif probe.load is None and over == "rate":
        keys = {"process": "offline"}
    elif probe.load is None:
        keys = {"process": "closed", "concurrency": num_requests}
    elif over == "rate":
        keys = {"process": "poisson", "rate": probe.load}
    else:
        keys = {"process": "closed", "concurrency": int(probe.load)}
    out = [f"workload.arrival.{k}={v if k == 'process' else _number(v)}" for k, v in keys.items()]
    stale = [k for k, v in arrival.items() if v is not None and k not in keys]
    return out + [f"workload.arrival.{k}=null" for k in sorted(stale)]


def measurement(job_dir: Path, job: str) -> Measurement:
    """What a finished job folder measured (a folder without a summary: a job that did not
    run, `missing`)."""
    summary = read_summary(job_dir)
    if summary is None:
        return Measurement("missing", error="no summary.json (the job did not run?)", job=job)
    metrics = summary.get("metrics")
    whole = summary.get("metrics_whole_run")
    counts = whole if isinstance(whole, dict) else metrics if isinstance(metrics, dict) else {}
    workload = summary.get("workload")
    planned = workload.get("cancel_planned") if isinstance(workload, dict) else None
    cancelled = _count(counts.get("num_cancelled"))
    return Measurement(
        str(summary.get("status")),
        metrics if isinstance(metrics, dict) else {},
        summary.get("saturated") is True,
        summary.get("error"),
        job,
        failed_requests=_count(counts.get("num_failed")),
        # the workload's own cancellations are its plan; the rest a bound cut
        cut_requests=max(0, cancelled - _count(planned)),
    )


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def _finite(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _load(value: float | None, over: str) -> float | int | None:
    """A load as search.json holds it: a concurrency as a whole number."""
    return int(value) if value is not None and over == "concurrency" else value


def _point(point: Point, metrics: Sequence[str], over: str) -> dict[str, Any]:
    got = point.measurement
    return {
        "job": got.job,
        "role": point.probe.role,
        "load": _load(point.load, over),
        "achieved_req_per_s": _finite(got.metrics.get("req_per_s")),
        "meets": point.meets,
        "failed_checks": point.failed,
        "saturated": got.saturated,
        "status": got.status,
        "error": got.error,
        "metrics": {m: _finite(got.metrics.get(m)) for m in metrics},
    }


def result_record(result: SearchResult, grid: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """search.json's content for one search."""
    metrics = list(dict.fromkeys(c.metric for c in result.checks))
    metrics += [m for m in ("req_per_s", "goodput_req_per_s") if m not in metrics]
    record: dict[str, Any] = {
        "over": result.over,
        "slo": [str(c) for c in result.checks],
        "outcome": result.outcome,
        ANSWER_KEY[result.over]: _load(result.answer, result.over),
        "unit": UNIT[result.over],
        "bracket": {
            "meets": None if result.low is None else _point(result.low, metrics, result.over),
            "misses": None if result.high is None else _point(result.high, metrics, result.over),
        },
        "points": [_point(p, metrics, result.over) for p in result.points],
        "num_points": len(result.points),
        "note": result.note,
        # the range's ends as asked (run.search.min_load / max_load; null: the synchronous
        # and throughput runs' own loads)
        "range": {
            f"{role_}_load": next(
                (_load(p.probe.load, result.over) for p in result.points if p.probe.role == role),
                None,
            )
            for role, role_ in (("low", "min"), ("high", "max"))
        },
    }
    if grid is not None:
        record["grid"] = dict(grid)
    return record


OUTCOMES = ("found", "below_range", "above_range", "failed")


def record_problem(record: Any) -> str | None:
    """What makes a search.json record (a hand-edited or damaged file) unusable for its line,
    table and figure, else None."""
    if not isinstance(record, Mapping):
        return f"a record is {type(record).__name__}, not an object"
    over = record.get("over")
    if over not in ANSWER_KEY:
        return f"over: {over!r} is invalid; allowed: {'|'.join(ANSWER_KEY)}"
    if record.get("outcome") not in OUTCOMES:
        return f"outcome: {record.get('outcome')!r} is invalid; allowed: {'|'.join(OUTCOMES)}"
    answer = record.get(ANSWER_KEY[over])
    if answer is not None and _finite(answer) is None:
        return f"{ANSWER_KEY[over]}: {answer!r} is invalid; allowed: a finite number or null"
    if record["outcome"] in ("found", "above_range") and answer is None:
        return f"{ANSWER_KEY[over]}: null with outcome {record['outcome']!r}"
    slo = record.get("slo")
    if not isinstance(slo, list) or not all(
        isinstance(c, str) and len(c.split()) == 3 for c in slo
    ):
        return f"slo: {slo!r} is invalid; allowed: a list of 'METRIC OP BOUND' strings"
    points = record.get("points")
    if not isinstance(points, list) or not all(isinstance(p, Mapping) for p in points):
        return "points: not a list of objects"
    if any(p.get("load") is not None and _finite(p.get("load")) is None for p in points):
        return "points: a load that is not a finite number"
    num = record.get("num_points")
    if not isinstance(num, int) or isinstance(num, bool):
        return f"num_points: {num!r} is invalid; allowed: a whole number"
    bracket = record.get("bracket")
    if not isinstance(bracket, Mapping):
        return "bracket: not an object"
    for end in ("meets", "misses"):
        point = bracket.get(end)
        if point is not None and (
            not isinstance(point, Mapping) or _finite(point.get("load")) is None
        ):
            return f"bracket.{end}: neither null nor a point with a finite load"
    if record["outcome"] == "found" and bracket.get("meets") is None:
        return "bracket.meets: null with outcome 'found'"
    return None


def console_line(record: Mapping[str, Any]) -> str:
    """The search's answer in one line."""
    over, outcome = record["over"], record["outcome"]
    key, unit = ANSWER_KEY[over], UNIT[over]
    runs = f"{record['num_points']} run{'s' if record['num_points'] != 1 else ''}"
    where = ""
    if record.get("grid"):
        where = " [" + ", ".join(f"{k}={v}" for k, v in record["grid"].items()) + "]"
    # a high run at no more than the low run's load: no range was searched (the note says why)
    high = next((p for p in record["points"] if p.get("role") == "high"), None)
    no_range = high is not None and record[key] is not None and high["load"] < record[key]
    if outcome == "found":
        meets, misses = record["bracket"]["meets"], record["bracket"]["misses"]
        around = f"meets at {meets['load']:.4g}" + (
            f", misses at {misses['load']:.4g}" if misses is not None else ""
        )
        why = f": {record['note']}" if no_range else ""
        return f"search{where}: {key} = {record[key]:.4g} {unit} ({around}; {runs}){why}"
    if outcome == "above_range":
        if no_range:
            return (
                f"search{where}: {key} >= {record[key]:.4g} {unit}: every run met the SLO; "
                f"{record['note']} ({runs})"
            )
        asked = (record.get("range") or {}).get("max_load")
        run = "the throughput run" if asked is None else "the run at max_load"
        return (
            f"search{where}: {key} >= {record[key]:.4g} {unit}: even {run} meets the SLO ({runs})"
        )
    label = "below range" if outcome == "below_range" else "failed"
    return f"search{where}: {key} = none, {label}: {record['note']} ({runs})"


def write_search(sweep_dir: Path, records: Sequence[dict[str, Any]]) -> None:
    """search.json and search.png: the one search's record, or for a grid of searches
    {"searches": [record, ...]}, each with its grid point."""
    if not records:
        return
    data = records[0] if len(records) == 1 else {"searches": list(records)}
    write_json_atomic(sweep_dir / SEARCH_FILE, data)
    from harness.reporting import figures  # matplotlib: only once a search has run

    figures.save(figures.capacity_search(list(records)), str(sweep_dir / SEARCH_FIGURE))


def read_search(sweep_dir: Path) -> list[dict[str, Any]]:
    """The search records of a sweep folder's search.json (none: no search ran there)."""
    try:
        return read_search_records(sweep_dir)
    except UnreadableFile:  # a damaged file: the sweep's other outputs are still written
        return []


def search_summary(sweep_dir: Path) -> dict[str, Any]:
    """The keys sweep_summary.json gets from the sweep's search: its outcome and answer, or
    for a grid of searches one entry per grid point."""
    records = read_search(sweep_dir)
    if not records:
        return {}

    def brief(record: Mapping[str, Any]) -> dict[str, Any]:
        key = ANSWER_KEY.get(str(record.get("over")), "max_rate_at_slo")
        return {
            "search_outcome": record.get("outcome"),
            key: record.get(key),
            "search_num_points": record.get("num_points"),
        }

    if len(records) == 1:
        return brief(records[0])
    return {"searches": [{"grid": r.get("grid"), **brief(r)} for r in records]}
