"""sweep.csv: one row per Hydra multirun job, its overrides as columns, then its metrics; and
resume (`run.resume=true`): a job whose folder already holds a complete run of the same
configuration is skipped, every other one (incomplete, failed, missing) runs again."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from engines.openai import server_keeper
from harness.run_folder import (
    HOW_TO_RUN_KEYS,
    SWEEP_SUMMARY_FILE,
    SWEEP_TABLE_FILE,
    is_sweep_job,
    read_config,
    read_summary,
    read_sweep_overrides,
    write_json_atomic,
    write_text_atomic,
)
from harness.running.capacity_sweep import search_summary
from harness.running.sweep_outputs import SWEEP_OUTPUTS, checked_outputs


class ResumeMismatch(ValueError):
    """The folder resume would skip holds a run of another configuration."""


#: Jobs of this process whose summary.json could not be written (a full disk): job folder ->
#: the error, so that their sweep.csv rows say `failed` and why instead of `missing`.
_UNRECORDED: dict[Path, str] = {}


def note_unrecorded(job_dir: str | Path, error: str) -> None:
    _UNRECORDED[Path(job_dir).resolve()] = error


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The config as YAML stores it (config.yaml), less the keys in HOW_TO_RUN_KEYS."""
    plain = yaml.safe_load(yaml.safe_dump(config)) or {}
    run = dict(plain.get("run") or {})
    for key in HOW_TO_RUN_KEYS:
        run.pop(key.split(".", 1)[1], None)
    return {**plain, "run": run}


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def completed_run(run_dir: str | Path, config: dict[str, Any]) -> bool:
    """Does `run_dir` hold a complete run of `config`? Raises ResumeMismatch when it holds a
    run (of any status) of another configuration: skipping it would report the wrong thing,
    running over it would destroy another variant's record."""
    run_dir = Path(run_dir)
    stored = read_config(run_dir)
    if stored is None:
        return False  # never started (or not a run folder): run it
    differing = _differences(_comparable(stored), _comparable(config))
    if differing:
        raise ResumeMismatch(
            f"run.resume: {run_dir} holds a run of another configuration (it differs in "
            f"{differing[:5]}); resume a sweep with the command that started it"
        )
    summary = read_summary(run_dir)
    return summary is not None and summary.get("status") == "complete"


def server_columns(summary: dict[str, Any]) -> dict[str, Any]:
    """The server a job started (engine.launch), as sweep.csv's columns; none otherwise."""
    server = (summary.get("engine") or {}).get("launched_server")
    if not isinstance(server, dict):
        return {}
    return {
        "server_version": server.get("version"),
        "server_startup_s": server.get("startup_s"),
        "server_reused": server.get("reused"),
        "server_command": server.get("command"),
    }


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    jobs = [p for p in sweep_dir.iterdir() if is_sweep_job(p)]
    for job in sorted(
        jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    ):
        row: dict[str, Any] = {"job": job.name}
        overrides = read_sweep_overrides(job) or {}
        row.update({k: v for k, v in overrides.items() if k not in HOW_TO_RUN_KEYS})
        unrecorded = _UNRECORDED.get(job.resolve())
        summary = read_summary(job)
        if unrecorded is not None:
            row["status"], row["error"] = "failed", unrecorded
        elif summary is not None:
            row["status"] = summary.get("status")
            row["error"] = summary.get("error")
            row.update(server_columns(summary))
            row.update(summary.get("metrics") or {})
        else:
            row["status"], row["error"] = "missing", "no summary.json (the job did not start?)"
        row["run_dir"] = str(job)
        rows.append(row)
    return rows


SATURATION_SERVED = 0.9


def _rate_points(frame: pd.DataFrame) -> pd.DataFrame:
    """Complete jobs with an offered and an achieved rate, in offered order. A job that failed
    or was cut short measured no throughput of the configuration."""
    needed = ["offered_req_per_s", "req_per_s"]
    if not set(needed) <= set(frame.columns):
        return pd.DataFrame(columns=needed)
    rows = frame if "status" not in frame else frame[frame["status"] == "complete"]
    rows = rows.assign(**{c: pd.to_numeric(rows[c], errors="coerce") for c in needed})
    return rows.dropna(subset=needed).sort_values("offered_req_per_s")


def saturation_rate(frame: pd.DataFrame) -> float | None:
    """Highest offered request rate whose achieved rate is still >= 90% of it.

    Past saturation the engine falls behind: requests queue, achieved throughput flattens
    and latency grows without bound. The achieved rate of a run whose steady-state window is
    not valid (under heavy overload none completes inside it) is its whole run's
    (harness/running/window.py), never a window's 0. None when no complete job has an offered rate,
    or when even the lowest offered rate was not served.
    """
    rows = _rate_points(frame)
    served = rows[rows["req_per_s"] >= SATURATION_SERVED * rows["offered_req_per_s"]]
    return float(served["offered_req_per_s"].max()) if len(served) else None


def saturation_summary(frame: pd.DataFrame) -> dict[str, Any]:
    """The load-sweep part of sweep_summary.json: the saturation rate, the highest achieved
    rate (past saturation, the capacity the engine showed) and, when the saturation rate is
    null, why."""
    rows = _rate_points(frame)
    rate = saturation_rate(frame)
    note = None
    if not len(rows):
        note = "no complete job with an offered rate (open-loop arrivals)"
    elif rate is None:
        lowest = rows.iloc[0]
        note = (
            f"every offered rate was past saturation: the lowest, "
            f"{lowest['offered_req_per_s']:.4g} req/s, was served at "
            f"{lowest['req_per_s']:.4g} req/s"
        )
    return {
        "saturation_req_per_s": rate,
        "saturation_definition": f"highest offered rate with achieved >= "
        f"{SATURATION_SERVED:.0%} of offered",
        "saturation_note": note,
        "peak_req_per_s": float(rows["req_per_s"].max()) if len(rows) else None,
    }


def write_sweep_csv(sweep_dir: str | Path, outputs: Sequence[str] = ()) -> pd.DataFrame:
    """sweep.csv and sweep_summary.json, and the `outputs` the experiment names beside them
    (harness/running/sweep_outputs.py)."""
    sweep_dir = Path(sweep_dir)
    frame = pd.DataFrame(sweep_rows(sweep_dir))
    write_text_atomic(sweep_dir / SWEEP_TABLE_FILE, frame.to_csv(index=False))
    for name in outputs:
        output = SWEEP_OUTPUTS.get(name)
        table = output.make(frame) if len(frame) else None
        if table is not None:
            write_text_atomic(sweep_dir / output.file, table.to_csv(index=False))
    summary = {
        "num_jobs": len(frame),
        "num_failed": int((frame.get("status") == "failed").sum()) if len(frame) else 0,
        **saturation_summary(frame),
        **search_summary(sweep_dir),  # a capacity search's answer (docs/capacity.md)
    }
    write_json_atomic(sweep_dir / SWEEP_SUMMARY_FILE, summary)
    return frame


def unfinished_jobs(frame: pd.DataFrame) -> list[str]:
    """One line per job of sweep.csv that did not complete: its job, status and error."""
    if not len(frame) or "status" not in frame:
        return []
    lines = []
    for _, row in frame[frame["status"] != "complete"].iterrows():
        error = row.get("error")
        reason = f": {' '.join(str(error).split())[:200]}" if isinstance(error, str) else ""
        lines.append(f"job {row['job']} {row['status']}{reason}")
    return lines


class SweepTable(Callback):
    """Hydra callback: after a multirun, tabulate every job into sweep.csv, and exit 1 when a
    job did not complete (unless `run.allow_failed_jobs=true`), so that CI notices. Hydra
    turns an exception of a callback into a warning and exit 0, so an error here (a full
    disk) is printed and exits 1 here. `outputs`: the tables the experiment's preset names
    beside sweep.csv (harness/running/sweep_outputs.py)."""

    def __init__(self, outputs: Sequence[str] | str | None = None) -> None:
        self.outputs = checked_outputs(outputs or [])

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        server_keeper.stop_kept()  # the last job's server (engine.launch.reuse)
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        try:
            frame = write_sweep_csv(sweep_dir, self.outputs)
        except Exception as exc:
            if not isinstance(exc, OSError):  # a bug, not the disk: its traceback too
                traceback.print_exc()
            print(f"error: {sweep_dir}: sweep.csv cannot be written: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"sweep: {len(frame)} job(s) -> {sweep_dir / SWEEP_TABLE_FILE}")
        unfinished = unfinished_jobs(frame)
        if not unfinished:
            return
        allowed = OmegaConf.select(config, "run.allow_failed_jobs", default=False) is True
        print(
            f"sweep: {len(unfinished)} of {len(frame)} job(s) did not complete"
            + ("" if allowed else " (exit 1; run.allow_failed_jobs=true exits 0)")
            + "".join(f"\n  {line}" for line in unfinished),
            file=sys.stderr,
        )
        if not allowed:
            raise SystemExit(1)
