"""harness.reporting.results.load on a real tiny sweep, one run of it, an interrupted run (JSONL
only), and the repeats and A/B layouts (built from the sweep's run folders)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.reporting.results import ID_COLUMNS, load, newest
from harness.run_folder import TABLES


# two variants, by Poisson rate (conftest.tiny_rate_sweep)
@pytest.fixture(scope="module")
def sweep(tiny_rate_sweep: Path) -> Path:
    return tiny_rate_sweep


def summaries(sweep: Path) -> dict[str, dict]:
    return {
        job.name: json.loads((job / "summary.json").read_text())
        for job in sorted(sweep.iterdir())
        if (job / "summary.json").is_file()
    }


def test_sweep_gives_the_rows_of_sweep_csv_plus_provenance(sweep: Path) -> None:
    res = load(sweep)
    runs = res.runs
    assert len(runs) == 2
    assert list(runs.columns[: len(ID_COLUMNS)]) == ID_COLUMNS
    assert runs["run_id"].tolist() == [f"{sweep.name}/0", f"{sweep.name}/1"]
    assert runs["job"].tolist() == [0, 1] and runs["sweep"].eq(sweep.name).all()
    assert res.swept == ["workload.arrival.rate"]
    assert runs["workload.arrival.rate"].tolist() == [100, 400]
    assert runs["variant"].tolist() == ["workload.arrival.rate=100", "workload.arrival.rate=400"]
    provenance = json.loads((sweep / "0" / "provenance.json").read_text())
    assert runs.loc[0, "config_hash"] == provenance["config_hash"]
    assert runs.loc[0, "git_commit"] == provenance["git_commit"]
    assert runs["machine"].notna().all()
    csv = pd.read_csv(sweep / "sweep.csv")
    shared = [c for c in csv.columns if c not in ("job", "run_dir", "error") and c in runs]
    assert {"status", "ttft_p50_s", "output_tok_per_s", "model"} <= set(shared)
    for column in shared:
        for mine, theirs in zip(runs[column], csv[column], strict=True):
            if isinstance(theirs, float) and np.isnan(theirs):
                assert mine is None or pd.isna(mine), column
            elif isinstance(theirs, float):
                assert float(mine) == pytest.approx(theirs, rel=1e-12), column
            else:
                assert str(mine) == str(theirs), column
    variants = res.variants
    assert variants["variant"].tolist() == runs["variant"].tolist()
    assert variants["ttft_p50_s"].tolist() == runs["ttft_p50_s"].tolist()


def test_big_tables_hold_every_row_with_run_ids(sweep: Path) -> None:
    res = load(sweep)
    for job, summary in summaries(sweep).items():
        run_id = f"{sweep.name}/{job}"
        metrics = summary["metrics_whole_run"]
        assert (res.requests["run_id"] == run_id).sum() == metrics["num_requests"]
        assert (res.tokens["run_id"] == run_id).sum() == metrics["output_tokens_total"]
        assert (res.steps["run_id"] == run_id).sum() == metrics["num_steps"]
    for table in (res.requests, res.tokens, res.steps, res.samples):
        assert table.columns[0] == "run_id"
        assert set(table["run_id"]) <= set(res.runs["run_id"])
    assert "time_s" in res.samples.columns  # rows when the monitor sampled, never an error
    joined = res.join(res.tokens, "variant", "workload.arrival.rate")
    assert len(joined) == len(res.tokens) and joined["variant"].notna().all()


def test_latencies_are_the_ones_the_metrics_describe(sweep: Path) -> None:
    res = load(sweep)
    latencies = res.latencies()
    assert set(latencies["latency"]) == {"ttft_s", "itl_s", "e2e_s"}
    for _, run in res.runs.iterrows():
        mine = latencies[latencies["run_id"] == run["run_id"]]
        for latency, metric in (
            ("ttft_s", "ttft_p50_s"),
            ("e2e_s", "e2e_p50_s"),
            ("itl_s", "itl_p50_s"),
        ):
            values = mine.loc[mine["latency"] == latency, "value_s"]
            assert np.percentile(values, 50) == pytest.approx(run[metric], rel=1e-12)
        requests = res.requests[res.requests["run_id"] == run["run_id"]]
        assert requests["in_window"].sum() == (mine["latency"] == "ttft_s").sum()


def test_a_single_run_folder_loads(sweep: Path) -> None:
    res = load(sweep / "1")
    assert len(res.runs) == 1
    row = res.runs.iloc[0]
    assert row["run_id"] == "1" and row["sweep"] == sweep.name and row["job"] == 1
    assert row["status"] == "complete" and row["workload.arrival.rate"] == 400
    assert len(res.requests) == row["num_requests"]
    assert res.spread.empty  # one run: no spread


def test_an_interrupted_run_loads_from_its_jsonl_rows(sweep: Path, tmp_path: Path) -> None:
    run = tmp_path / "interrupted"
    shutil.copytree(sweep / "0", run)
    for table in TABLES:  # a run killed before it could write parquet
        (run / f"{table}.parquet").unlink()
    (run / "samples.parquet").unlink(missing_ok=True)
    kept = (run / "requests.jsonl").read_text().splitlines()[:5]
    (run / "requests.jsonl").write_text("\n".join(kept) + '\n{"request_id": "torn')
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(
        json.dumps(
            {"status": "incomplete", "error": "interrupted: SIGTERM", "metrics": summary["metrics"]}
        )
    )
    res = load(run)
    row = res.runs.iloc[0]
    assert row["status"] == "incomplete" and row["error"] == "interrupted: SIGTERM"
    assert len(res.requests) == 5 and res.requests["request_id"].notna().all()
    assert len(res.tokens) == summary["metrics_whole_run"]["output_tokens_total"]
    assert len(res.steps) == summary["metrics_whole_run"]["num_steps"]
    # a run that died before writing anything but its first summary
    (run / "summary.json").write_text(json.dumps({"status": "running"}))
    for table in TABLES:
        (run / f"{table}.jsonl").unlink()
    res = load(run)
    assert res.runs.iloc[0]["status"] == "running"
    assert res.requests.empty and "request_id" in res.requests.columns


def test_repeats_and_ab_folders(sweep: Path, tmp_path: Path) -> None:
    repeats = tmp_path / "repeats"
    throughputs = []
    for k in range(3):
        shutil.copytree(sweep / "0", repeats / f"repeat-{k}")
        throughputs.append(summaries(sweep)["0"]["metrics"]["output_tok_per_s"] * (1 + k / 10))
        path = repeats / f"repeat-{k}" / "summary.json"
        summary = json.loads(path.read_text())
        summary["metrics"]["output_tok_per_s"] = throughputs[-1]
        path.write_text(json.dumps(summary))
    spread = {
        "median": float(np.median(throughputs)),
        "min": min(throughputs),
        "max": max(throughputs),
        "std": float(np.std(throughputs, ddof=1)),
        "cv": float(np.std(throughputs, ddof=1) / np.mean(throughputs)),
        "values": throughputs,
    }
    (repeats / "summary.json").write_text(
        json.dumps(
            {
                "status": "complete",
                "repeats": 3,
                "metrics": {"output_tok_per_s": spread["median"]},
                "metrics_spread": {"output_tok_per_s": spread},
            }
        )
    )
    res = load(repeats)
    assert res.runs["repeat"].tolist() == [0, 1, 2]
    assert res.runs["variant"].nunique() == 1 and len(res.variants) == 1
    assert res.variants.loc[0, "runs"] == 3
    assert res.variants.loc[0, "output_tok_per_s"] == spread["median"]
    written = res.spread.set_index("metric").loc["output_tok_per_s"]
    assert written["n"] == 3 and written["cv"] == pytest.approx(spread["cv"])

    gate = tmp_path / "gate"
    for k in range(3):
        for arm, job in (("a", "0"), ("b", "1")):
            shutil.copytree(sweep / job, gate / f"round-{k}-{arm}")
            shutil.rmtree(gate / f"round-{k}-{arm}" / ".hydra")  # the gate runs no Hydra
    (gate / "ab.json").write_text("{}")
    res = load(gate)
    assert res.runs["round"].tolist() == [0, 0, 1, 1, 2, 2]
    assert res.runs["arm"].tolist() == ["a", "b"] * 3
    # the arms differ in their config: that names them
    assert res.swept == ["workload.arrival.rate"]
    assert set(res.variants["variant"]) == {
        "workload.arrival.rate=100",
        "workload.arrival.rate=400",
    }
    computed = res.spread[res.spread["metric"] == "ttft_p50_s"]
    assert computed["n"].tolist() == [3, 3] and (computed["std"] < 1e-12).all()

    everything = load(tmp_path)  # a folder above all of them
    assert len(everything.runs) == 3 + 6
    assert everything.runs["run_id"].is_unique and everything.runs["variant"].nunique() == 3


def test_bad_input_is_named(tmp_path: Path, sweep: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run folder"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load(tmp_path / "missing")
    with pytest.raises(ValueError, match="allowed: requests"):
        load(sweep).table("nope")
    with pytest.raises(ValueError, match="unknown runs column"):
        load(sweep).join(pd.DataFrame({"run_id": []}), "nope")


def test_newest_finds_the_latest_result_folder(tmp_path: Path, sweep: Path) -> None:
    assert newest(tmp_path / "results") is None
    run, sweep_copy = tmp_path / "results" / "runs" / "a", tmp_path / "results" / "sweeps" / "b"
    shutil.copytree(sweep / "0", run)
    shutil.copytree(sweep, sweep_copy)
    (tmp_path / "results" / "runs" / "empty").mkdir()  # no runs inside: never chosen
    os.utime(run, (1e9, 1e9))
    os.utime(sweep_copy, (2e9, 2e9))
    assert newest(tmp_path / "results") == sweep_copy
    os.utime(run, (3e9, 3e9))
    assert newest(tmp_path / "results") == run


def test_thousands_of_run_folders_are_found_in_linear_time(tmp_path: Path) -> None:
    # finding which run folders hold others compared every pair: 3000 jobs took minutes
    from harness.reporting.results import _find_run_dirs

    for job in range(3000):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "summary.json").write_text("{}")
    (tmp_path / "7" / "repeat-0").mkdir()
    (tmp_path / "7" / "repeat-0" / "summary.json").write_text("{}")
    started = time.perf_counter()
    leaves, parents = _find_run_dirs(tmp_path)
    assert time.perf_counter() - started < 5
    assert len(leaves) == 3000 and parents == [tmp_path / "7"]
    assert tmp_path / "7" / "repeat-0" in leaves and tmp_path / "7" not in leaves


@pytest.mark.parametrize(
    "damage, why",
    [
        ("", "empty file"),
        ('{"status": "compl', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"status": "complete", "metrics": [1, 2]}', "`metrics` must be an object"),
        ('{"status": "complete", "window": "x"}', "`window` must be an object"),
        ('{"status": 5}', "`status` must be a string"),
    ],
)
def test_a_damaged_summary_is_reported_as_unreadable_beside_the_others(
    sweep: Path, tmp_path: Path, damage: str, why: str
) -> None:
    # a summary.json with the wrong types crashed the loader (a traceback for the whole
    # sweep), and an unparseable one showed as status 'missing' with no word on why
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    (copy / "1" / "summary.json").write_text(damage)
    res = load(copy)
    runs = res.runs.set_index("job")
    assert runs.loc[1, "status"] == "unreadable"
    assert str(copy / "1" / "summary.json") in runs.loc[1, "error"] and why in runs.loc[1, "error"]
    assert runs.loc[0, "status"] == "complete" and runs.loc[0, "ttft_p50_s"] > 0
    assert len(res.variants) == 2 and len(res.requests)


def test_jsonl_lines_that_are_not_rows_are_skipped(sweep: Path, tmp_path: Path) -> None:
    # a JSONL line holding a list, a string or a number made pandas raise (a traceback)
    copy = tmp_path / "run"
    shutil.copytree(sweep / "0", copy)
    for table in TABLES:
        (copy / f"{table}.parquet").unlink()
        kept = (copy / f"{table}.jsonl").read_text()
        (copy / f"{table}.jsonl").write_text('[1, 2]\n"text"\n5\nnull\n' + kept)
    res = load(copy)
    assert len(res.requests) == res.runs.loc[0, "num_requests"]
    assert len(res.tokens) and len(res.steps)
