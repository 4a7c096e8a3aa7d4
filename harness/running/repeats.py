"""Repeats: one configuration run N times, each in a fresh process, and its spread.

`inferlab run repeats=N ...` (N > 1) starts `python -m harness.running.app` N times in turn with the
same overrides, `repeats=1` and `hydra.run.dir=<run_dir>/repeat-<k>`: a fresh interpreter
each time, so allocator state, caches, JIT and thread pools do not carry over from one repeat
to the next. The folder's own summary.json (written atomically after every repeat) holds the
per-metric median over the complete repeats and, under `metrics_spread`, the median, min, max,
sample std, cv and the values (one per complete repeat, in order).

A repeat that fails stops the series (a broken configuration fails every time); an
interrupted one (Ctrl-C, SIGTERM) stops it too and the summary says `incomplete`. Children
run in their own session, so a Ctrl-C reaches this process only, which passes one SIGINT on
to the running repeat and waits for it to write its rows and summary.

In a sweep on a launcher that runs jobs side by side (joblib, Ray, submitit; docs/scaling.md)
the sweeper makes each repeat a job of its own, into the same repeat-<k>/ folders, so repeats
spread over the workers like any other job; every repeat runs, and the folder's summary is
written once they have (summarize_launched_repeats).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from harness import source_env
from harness.measuring import provenance
from harness.run_folder import (
    read_summary,
    remove_summary,
    repeat_dir,
    write_config,
    write_provenance,
    write_summary,
)
from harness.running.experiment import RunFolderError
from harness.running.interrupts import interruption, interrupts

CHILD_STOP_TIMEOUT_S = 120.0  # how long an interrupted repeat gets to write its summary


def validate_repeats(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"repeats: {value!r} is invalid; allowed: an integer >= 1")
    return value


def one_repeat(overrides: list[str]) -> list[str]:
    """A job's overrides for one of its repeats: the same, with `repeats=1`."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "repeats"]
    return [*kept, "repeats=1"]


def repeat_command(overrides: list[str], run_dir: Path) -> list[str]:
    """The command line of one repeat: the job's overrides, one run, into `run_dir`."""
    return [
        sys.executable,
        "-m",
        "harness.running.app",
        *one_repeat(overrides),
        "hydra.mode=RUN",
        f"hydra.run.dir={run_dir}",
    ]


def spread(values: list[float | None]) -> dict[str, Any]:
    """median, min, max, sample std and cv of the non-null values, and the values themselves."""
    numbers = np.array([v for v in values if v is not None], dtype=float)
    if not len(numbers):
        return {"median": None, "min": None, "max": None, "std": None, "cv": None, "values": values}
    std = float(numbers.std(ddof=1)) if len(numbers) > 1 else None
    mean = float(numbers.mean())
    return {
        "median": _as_number(float(np.median(numbers)), values),
        "min": _as_number(float(numbers.min()), values),
        "max": _as_number(float(numbers.max()), values),
        "std": std,
        "cv": std / mean if std is not None and mean != 0 else None,
        "values": values,
    }


def _as_number(x: float, values: list[float | None]) -> float | int:
    """Counts stay integers when every value is one and the statistic is whole."""
    whole = all(isinstance(v, int) for v in values if v is not None)
    return int(x) if whole and x.is_integer() else x


def aggregate(summaries: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, metrics_spread) over the complete repeats' summaries, metrics in first-seen
    order; non-numeric metrics are left out."""
    names: list[str] = []
    for summary in summaries:
        names += [m for m in summary.get("metrics") or {} if m not in names]
    metrics: dict[str, Any] = {}
    spreads: dict[str, Any] = {}
    for name in names:
        values = [(s.get("metrics") or {}).get(name) for s in summaries]
        if any(
            v is not None and (isinstance(v, bool) or not isinstance(v, int | float))
            for v in values
        ):
            continue
        stats = spread(values)
        metrics[name] = stats["median"]
        spreads[name] = stats
    return metrics, spreads


def write_repeats_summary(
    run_dir: Path,
    statuses: list[str],
    summaries: list[dict[str, Any]],
    status: str,
    error: str | None,
) -> dict[str, Any]:
    """Write (and return) the folder's summary.json over its repeats' statuses and summaries."""
    repeats = len(statuses)
    complete = [k for k in range(repeats) if statuses[k] == "complete"]
    metrics, spreads = aggregate([summaries[k] for k in complete])
    summary = {
        "status": status,
        "error": error,
        "repeats": repeats,
        "repeat_status": statuses,
        "complete_repeats": complete,
        "metrics": metrics,
        "metrics_spread": spreads,
        "repeat_dirs": [repeat_dir(run_dir, k).name for k in range(repeats)],
        "run_dir": str(run_dir),
    }
    try:
        write_summary(run_dir, summary)
    except OSError as exc:  # a full disk: no stale `running` summary is left either
        with suppress(OSError):
            remove_summary(run_dir)
        raise RunFolderError(f"{run_dir}: writing summary.json failed: {exc}", summary) from exc
    return summary


def summarize_launched_repeats(run_dir: Path, repeats: int) -> dict[str, Any]:
    """The summary of repeats a launcher ran side by side (each a job of the sweep, into
    run_dir/repeat-<k>/): every repeat ran, so the folder is complete only if all are, else
    it takes the first unfinished repeat's status and error."""
    summaries = [read_summary(repeat_dir(run_dir, k)) or {} for k in range(repeats)]
    statuses = [s.get("status") or "failed" for s in summaries]
    statuses = ["failed" if s == "running" else s for s in statuses]
    bad = next((k for k in range(repeats) if statuses[k] != "complete"), None)
    if bad is None:
        return write_repeats_summary(run_dir, statuses, summaries, "complete", None)
    error = summaries[bad].get("error") or "no summary.json"
    status = "incomplete" if statuses[bad] == "incomplete" else "failed"
    return write_repeats_summary(run_dir, statuses, summaries, status, f"repeat {bad}: {error}")


def _run_child(command: list[str]) -> tuple[int, str | None]:
    """Run one repeat to its end; (exit code, interruption or None)."""
    child = subprocess.Popen(command, env=source_env(), start_new_session=True)
    try:
        return child.wait(), None
    except KeyboardInterrupt as exc:
        child.send_signal(signal.SIGINT)  # the repeat keeps its rows and says incomplete
        try:
            child.wait(timeout=CHILD_STOP_TIMEOUT_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            child.kill()
            child.wait()
        return child.returncode, interruption(exc)


def run_repeats(
    config: dict[str, Any],
    overrides: list[str],
    run_dir: str | Path,
    repeats: int,
    resume: bool = False,
    provenance_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the configuration `repeats` times into run_dir/repeat-<k>/; return (and write)
    the folder's summary. With `resume`, complete repeats of the same config are kept."""
    from harness.running.sweep import completed_run  # sweep imports Hydra; keep this module light

    repeats = validate_repeats(repeats)
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, config)
    write_provenance(run_dir, {**provenance.collect(config), **(provenance_extra or {})})
    statuses: list[str] = ["not run"] * repeats
    summaries: list[dict[str, Any]] = [{} for _ in range(repeats)]

    def write(status: str, error: str | None) -> dict[str, Any]:
        return write_repeats_summary(run_dir, statuses, summaries, status, error)

    write("running", None)
    child_config = {**config, "repeats": 1}
    with interrupts():
        for k in range(repeats):
            child_dir = repeat_dir(run_dir, k)
            try:
                code, interrupted = 0, None
                if not (resume and completed_run(child_dir, child_config)):
                    print(f"repeat {k + 1}/{repeats} -> {child_dir}", flush=True)
                    code, interrupted = _run_child(repeat_command(overrides, child_dir))
            except KeyboardInterrupt as exc:  # between two repeats
                interrupted = interruption(exc)
            summaries[k] = read_summary(child_dir) or {}
            if interrupted:
                statuses[k] = "incomplete"
                return write("incomplete", f"repeat {k}: {interrupted}")
            statuses[k] = summaries[k].get("status") or "failed"
            if statuses[k] == "running":  # the child died without finishing its summary
                statuses[k] = "failed"
            if statuses[k] != "complete":
                error = summaries[k].get("error") or f"no summary.json (exit code {code})"
                status = "incomplete" if statuses[k] == "incomplete" else "failed"
                return write(status, f"repeat {k}: {error}")
            write("running", None)
    return write("complete", None)
