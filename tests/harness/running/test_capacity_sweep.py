"""The capacity search end to end: `inferlab run -m` with run.search on the tiny model runs its
rounds as sweep jobs, writes search.json, search.png, sweep.csv and sweep_summary.json, prints
its answer in one line, and resumes without running a finished point again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "experiment=capacity",
    "model=tiny",
    "workload.num_requests=12",
    "workload.input_len=8",
    "workload.output_len=8",
    "run.warmup_requests=0",
    "run.progress=false",
]


def inferlab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_concurrency_search_narrows_to_adjacent_loads_and_resumes(tmp_path: Path) -> None:
    """mean_batch_size follows the closed loop's concurrency on the built-in engine, so the
    search's path is known: 1 meets, 12 misses, and it narrows to 4 | 5."""
    search = [
        "run.search.over=concurrency",
        "run.search.slo=['mean_batch_size <= 4.5']",
        "run.search.max_points=8",
        "run.search.tolerance=0.01",
        f"hydra.sweep.dir={tmp_path}",
    ]
    done = inferlab("-m", *TINY, *search)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["over"] == "concurrency" and record["outcome"] == "found"
    assert record["slo"] == ["mean_batch_size <= 4.5"]
    assert record["max_concurrency_at_slo"] == 4
    assert record["bracket"]["misses"]["load"] == 5
    points = record["points"]
    assert [p["role"] for p in points[:2]] == ["low", "high"] and points[1]["load"] == 12
    assert record["num_points"] == len(points) <= 8
    line = (
        f"search: max_concurrency_at_slo = 4 requests (meets at 4, misses at 5; {len(points)} runs)"
    )
    assert line in done.stdout
    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert len(sweep) == len(points) and set(sweep["status"]) == {"complete"}
    assert list(sweep["workload.arrival.concurrency"]) == [p["load"] for p in points]
    summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert summary["search_outcome"] == "found" and summary["max_concurrency_at_slo"] == 4
    assert (tmp_path / "search.png").stat().st_size > 0

    again = inferlab("-m", *TINY, *search, "run.resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("skipped (already complete)") == len(points)
    assert line in again.stdout


def test_a_rate_search_bounds_with_synchronous_and_throughput_runs(tmp_path: Path) -> None:
    """A loose SLO: the throughput run (every request at once) meets it, above range; a single
    run with a search is refused, naming the key."""
    done = inferlab(
        "-m", *TINY, "run.search.slo=['ttft_p99_s <= 60']", f"hydra.sweep.dir={tmp_path}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["outcome"] == "above_range" and record["num_points"] == 2
    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert list(sweep["workload.arrival.process"]) == ["closed", "offline"]
    high = record["points"][1]
    assert record["max_rate_at_slo"] == high["achieved_req_per_s"] > 0
    assert "search: max_rate_at_slo >= " in done.stdout
    assert "even the throughput run meets the SLO (2 runs)" in done.stdout

    single = inferlab(*TINY, "run.search.slo=['ttft_p99_s <= 60']", f"hydra.run.dir={tmp_path}/one")
    assert single.returncode == 2
    assert "error: run.search: a capacity search runs many jobs" in single.stderr


def test_a_search_runs_its_rounds_in_parallel_on_a_launcher(tmp_path: Path) -> None:
    """run.search.parallel=2 on joblib: each round is one batch of two jobs side by side, and
    the answer is the one the search finds one run at a time (4 | 5)."""
    search = [
        "run.search.over=concurrency",
        "run.search.slo=['mean_batch_size <= 4.5']",
        "run.search.max_points=8",
        "run.search.tolerance=0.01",
        "run.search.parallel=2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={tmp_path}",
    ]
    done = inferlab("-m", *TINY, *search)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["outcome"] == "found" and record["max_concurrency_at_slo"] == 4
    assert record["bracket"]["misses"]["load"] == 5
    points = record["points"]
    assert [p["role"] for p in points[:2]] == ["low", "high"]  # the first round: both bounds
    assert len(points) <= 8
    provenance = json.loads((tmp_path / "0" / "provenance.json").read_text())
    assert provenance["placement"]["launcher"] == "joblib"


def test_a_grid_over_the_arrivals_and_a_concurrency_past_the_workload_are_refused(
    tmp_path: Path,
) -> None:
    """The search sets each run's arrivals: a grid over workload.arrival.rate ran the same
    search once per value; a concurrency range past num_requests measured num_requests again
    (or, from min_load, answered a concurrency the closed loop never reached). Both are
    refused before any job runs, naming the key."""
    slo = "run.search.slo=['ttft_p99_s <= 60']"
    grid = inferlab("-m", *TINY, slo, "workload.arrival.rate=1,2", f"hydra.sweep.dir={tmp_path}/a")
    assert grid.returncode == 2, grid.stderr[-2000:]
    assert "error: workload.arrival.rate: swept, but the capacity search sets" in grid.stderr
    for key, value, most in (("max_load", 64, 12), ("min_load", 12, 11)):
        done = inferlab(
            "-m", *TINY, slo, "run.search.over=concurrency", f"run.search.{key}={value}",
            f"hydra.sweep.dir={tmp_path}/{key}",
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert (
            f"error: run.search.{key}: {value} is invalid with over=concurrency and "
            f"workload.num_requests=12; allowed: at most {most}"
        ) in done.stderr
        assert not (tmp_path / key / "0").exists()  # no job ran
