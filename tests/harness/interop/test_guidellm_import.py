"""Importing guidellm's benchmark report (tests/fixtures/guidellm/benchmarks.json, written by
guidellm 0.8.1 against `inferlab serve`): the lab's metrics from every request's timings, the
aggregates with their definitions when the report keeps only a sample, YAML, several
benchmarks, and the fixture checked against guidellm's own schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from harness import cli
from harness.interop.detect import load
from harness.interop.imported import FROM_REQUESTS, ImportedRun
from harness.run_folder import read_config, read_summary

REPORT = Path(__file__).resolve().parents[2] / "fixtures" / "guidellm" / "benchmarks.json"


def report() -> dict[str, Any]:
    return json.loads(REPORT.read_text())


def import_one(path: Path) -> ImportedRun:
    [run] = load(path)
    return run


def timings(data: dict[str, Any]) -> dict[str, np.ndarray]:
    requests = data["benchmarks"][0]["requests"]["successful"]
    keys = ("targeted_start", "request_start", "first_token_iteration", "last_token_iteration")
    out = {k: np.array([r["info"]["timings"][k] for r in requests]) for k in keys}
    out["n"] = np.array([r["output_tokens"] for r in requests])
    return out


def test_every_request_kept_is_measured_the_labs_way() -> None:
    run = import_one(REPORT)
    data = report()
    t = timings(data)
    assert (run.tool, run.tool_version, run.label) == (
        "guidellm",
        "0.8.1",
        "benchmark 0 (synchronous)",
    )
    # TTFT from guidellm's targeted start (its schedule), not from the send
    ttft = t["first_token_iteration"] - t["targeted_start"]
    assert run.metrics["ttft_mean_s"] == pytest.approx(ttft.mean())
    assert run.metrics["ttft_p90_s"] == pytest.approx(np.percentile(ttft, 90))
    definition = run.definitions["ttft_p90_s"]
    assert (definition.source, definition.same_as_lab) == (FROM_REQUESTS, True)
    tpot = (t["last_token_iteration"] - t["first_token_iteration"]) / (t["n"] - 1)
    assert run.metrics["tpot_p99_s"] == pytest.approx(np.percentile(tpot, 99))
    assert run.metrics["num_completed"] == 4 and run.metrics["output_tokens_total"] == 32
    # guidellm's "ITL" weighted by N - 1 has the mean of every gap: the lab's ITL mean
    gaps = (t["last_token_iteration"] - t["first_token_iteration"]).sum() / (t["n"] - 1).sum()
    itl = data["benchmarks"][0]["metrics"]["inter_token_latency_ms"]["successful"]["mean"]
    assert run.metrics["itl_mean_s"] == pytest.approx(itl / 1000) == pytest.approx(gaps)
    assert run.definitions["itl_mean_s"].same_as_lab
    assert "itl_p99_s" not in run.metrics  # guidellm keeps no per-gap data
    assert run.metrics["send_lateness_p99_s"] == pytest.approx(
        np.percentile(t["request_start"] - t["targeted_start"], 99)
    )
    assert run.config["workload"] == {
        "arrival": {"process": "closed", "concurrency": 1},
        "input_len": 16,
        "output_len": 8,
    }
    assert run.config["model"]["name"] == "tiny"
    assert "time_per_output_token_ms" in run.unmapped


def test_a_sampled_report_takes_guidellms_aggregates(tmp_path: Path) -> None:
    data = report()
    data["benchmarks"][0]["requests"]["successful"].pop()  # as --sample-requests keeps fewer
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    metrics = data["benchmarks"][0]["metrics"]
    assert run.requests is None and any("sample" in note for note in run.notes)
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert run.metrics["ttft_p50_s"] == pytest.approx(ttft["percentiles"]["p50"] / 1000)
    assert not run.definitions["ttft_p50_s"].same_as_lab
    assert "nearest-rank" in run.definitions["ttft_p50_s"].note
    itl = metrics["inter_token_latency_ms"]["successful"]
    assert run.metrics["tpot_p99_s"] == pytest.approx(itl["percentiles"]["p99"] / 1000)
    assert "weighted by N - 1" in run.definitions["tpot_p99_s"].note
    assert run.metrics["e2e_mean_s"] == pytest.approx(
        metrics["request_latency"]["successful"]["mean"]
    )
    assert run.metrics["req_per_s"] == pytest.approx(
        metrics["requests_per_second"]["successful"]["mean"]
    )
    assert run.metrics["duration_s"] == pytest.approx(data["benchmarks"][0]["duration"])
    assert run.metrics["num_completed"] == 4  # guidellm's totals, not the sample's


def test_yaml_report_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.yaml"
    path.write_text(yaml.dump(report()))  # as guidellm's --output kind=yaml writes it
    assert import_one(path).metrics == import_one(REPORT).metrics


def test_a_sweep_imports_one_folder_per_benchmark(tmp_path: Path) -> None:
    data = report()
    second = copy.deepcopy(data["benchmarks"][0])
    second["config"]["strategy"] = {"type_": "constant", "rate": 5.0, "worker_count": 1}
    data["benchmarks"].append(second)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "imported"
    assert cli.main(["import", str(path), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["benchmark-0", "benchmark-1"]
    config = read_config(out / "benchmark-1")
    assert config is not None
    assert config["workload"]["arrival"] == {"process": "constant", "rate": 5.0}
    summary = read_summary(out / "benchmark-1")
    assert summary is not None and summary["imported"]["benchmark"] == "benchmark 1 (constant)"
    only = tmp_path / "only"
    assert cli.main(["import", str(path), "--out", str(only), "--benchmark", "1"]) == 0
    assert read_summary(only) is not None  # one benchmark: the folder is the run


@pytest.mark.slow
def test_fixture_is_guidellms_own_schema() -> None:
    """The fixture parses with guidellm's pydantic report model (the importer's models are a
    subset of it)."""
    from guidellm.benchmark.schemas import GenerativeBenchmarksReport

    parsed = GenerativeBenchmarksReport.model_validate(report())
    assert parsed.benchmarks[0].metrics.request_totals.successful == 4
