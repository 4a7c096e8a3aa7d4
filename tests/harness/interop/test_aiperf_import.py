"""Importing AIPerf's exports (tests/fixtures/aiperf/, written by AIPerf 0.13.0 against
`inferlab serve`): the lab's metrics from the per-request records, cross-checked against
AIPerf's own aggregates where both define a metric the same way; the CSV; the records alone;
errors, warm-up and cancelled records; and the fixture checked against AIPerf's own models."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.interop.detect import load
from harness.interop.imported import FROM_REQUESTS, ImportedRun

AIPERF = Path(__file__).resolve().parents[2] / "fixtures" / "aiperf"
SUMMARY = AIPERF / "profile_export_aiperf.json"
RECORDS = AIPERF / "profile_export.jsonl"
AIPERF_PYTHON = Path(__file__).resolve().parents[3] / ".venv-aiperf" / "bin" / "python"


def import_one(path: Path) -> ImportedRun:
    [run] = load(path)
    return run


def records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDS.read_text().splitlines()]


def summary() -> dict[str, Any]:
    return json.loads(SUMMARY.read_text())


def test_records_are_measured_the_labs_way() -> None:
    run = import_one(AIPERF)  # the folder: its profile_export_aiperf.json
    assert (run.tool, run.tool_version) == ("aiperf", "0.13.0")
    assert [p.name for p in run.files] == ["profile_export_aiperf.json", "profile_export.jsonl"]
    meta = [r["metadata"] for r in records()]
    values = {k: np.array([r["metrics"][k]["value"] for r in records()]) / 1000
              for k in ("time_to_first_token", "request_latency")}  # fmt: skip
    # the wait from AIPerf's credit (its schedule) to the request start, in exact nanoseconds
    wait = np.array([m["request_start_ns"] - m["credit_issued_ns"] for m in meta]) / 1e9
    # TTFT from the credit, not from the request start
    ttft = wait + values["time_to_first_token"]
    assert run.metrics["ttft_mean_s"] == pytest.approx(ttft.mean())
    assert run.metrics["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    assert run.definitions["ttft_p99_s"].source == FROM_REQUESTS
    assert run.metrics["send_lateness_p99_s"] == pytest.approx(np.percentile(wait, 99))
    aggregates = summary()
    # AIPerf's "inter_token_latency" is the lab's TPOT: the two computations agree
    assert run.metrics["tpot_mean_s"] == pytest.approx(
        aggregates["inter_token_latency"]["avg"] / 1000, rel=1e-6
    )
    assert run.metrics["tpot_p50_s"] == pytest.approx(
        aggregates["inter_token_latency"]["p50"] / 1000, rel=1e-6
    )
    # ITL from the records' chunk gaps: exactly AIPerf's pooled mean, flagged per chunk
    assert run.metrics["itl_mean_s"] == pytest.approx(
        aggregates["inter_chunk_latency"]["avg"] / 1000
    )
    assert not run.definitions["itl_mean_s"].same_as_lab
    assert run.metrics["num_completed"] == aggregates["request_count"]["avg"] == 6
    assert run.metrics["input_tokens_total"] == aggregates["total_isl"]["avg"]
    assert run.metrics["output_tokens_total"] == aggregates["total_osl"]["avg"]
    assert "time_to_first_token.avg" in run.superseded
    assert {"http_req_duration", "time_to_second_token"} <= set(run.unmapped)
    assert run.config["workload"]["arrival"] == {"process": "closed", "concurrency": 2}
    assert run.requests is not None and len(run.requests) == 6


def test_csv_alone_gives_the_rounded_aggregates(tmp_path: Path) -> None:
    shutil.copy(AIPERF / "profile_export_aiperf.csv", tmp_path)
    run = import_one(tmp_path / "profile_export_aiperf.csv")
    aggregates = summary()
    assert run.requests is None and any("two decimals" in n for n in run.notes)
    for lab, tag, stat in (
        ("ttft_p50_s", "time_to_first_token", "p50"),
        ("tpot_mean_s", "inter_token_latency", "avg"),
        ("itl_p99_s", "inter_chunk_latency", "p99"),
        ("e2e_p99_s", "request_latency", "p99"),
    ):
        assert run.metrics[lab] == pytest.approx(aggregates[tag][stat] / 1000, abs=5e-6), lab
    assert run.definitions["tpot_mean_s"].same_as_lab
    assert not run.definitions["ttft_p50_s"].same_as_lab
    assert run.metrics["duration_s"] == pytest.approx(
        aggregates["benchmark_duration"]["avg"], abs=5e-3
    )
    assert run.metrics["req_per_s"] == pytest.approx(
        aggregates["request_throughput"]["avg"], abs=5e-3
    )
    # no error row: none failed (completed = success + error)
    assert (run.metrics["num_completed"], run.metrics["num_failed"]) == (6, 0)


def test_records_alone_with_an_error_and_a_warmup(tmp_path: Path) -> None:
    lines = records()
    lines[1]["error"] = {"code": 500, "type": "Internal Server Error", "message": "boom"}
    lines[2]["metadata"]["benchmark_phase"] = "warmup"
    path = tmp_path / "profile_export.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = import_one(path)
    assert run.tool_version is None  # no summary beside it
    assert (run.metrics["num_requests"], run.metrics["num_failed"]) == (5, 1)
    assert run.requests is not None
    failed = run.requests[run.requests["status"] == "failed"]
    assert failed["error"].tolist() == ["boom"]
    # the lab's total counts every measured request's output, the failed one's too; the
    # warm-up record is in no figure
    measured = [r for k, r in enumerate(lines) if k != 2]
    osl = sum(r["metrics"]["output_sequence_length"]["value"] for r in measured)
    assert run.metrics["output_tokens_total"] == osl
    ok = [r for k, r in enumerate(lines) if k not in (1, 2)]
    ttft = [r["metrics"]["time_to_first_token"]["value"] for r in ok]
    assert run.metrics["ttft_p50_s"] > np.median(ttft) / 1000  # from the credit, not the send


def test_a_record_without_its_ttft_is_said_and_counted(tmp_path: Path) -> None:
    """A successful record whose time_to_first_token is NaN (or absent) was silently left out
    of the TTFT statistics; that is now a warning and a count (`unusable_values`)."""
    lines = records()
    lines[3]["metrics"]["time_to_first_token"]["value"] = float("nan")
    path = tmp_path / "profile_export.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = import_one(path)
    assert run.unusable_values == {"time_to_first_token": 1}
    assert run.warnings == [
        f"{path}: 1 request(s): 'time_to_first_token' is missing or NaN for a successful "
        "request: counted as completed, left out of the TTFT, TPOT statistics"
    ]


def test_records_that_do_not_match_the_summary_are_not_used(tmp_path: Path) -> None:
    shutil.copy(SUMMARY, tmp_path)
    lines = RECORDS.read_text().splitlines()[:5]
    (tmp_path / "profile_export.jsonl").write_text("\n".join(lines) + "\n")
    run = import_one(tmp_path / "profile_export_aiperf.json")
    assert run.requests is None
    assert any("the records hold 5 valid requests" in n for n in run.notes)
    # the rows were dropped with only a note in summary.json; the import now says so
    [warning] = run.warnings
    assert warning.startswith(f"{tmp_path / 'profile_export.jsonl'}: the records hold 5 valid")
    assert warning.endswith("no per-request rows imported")
    assert run.definitions["ttft_mean_s"].source == "time_to_first_token.avg"
    assert run.metrics["ttft_mean_s"] == pytest.approx(
        summary()["time_to_first_token"]["avg"] / 1000
    )


def test_a_cancelled_profile_is_incomplete(tmp_path: Path) -> None:
    data = summary()
    data["was_cancelled"] = True
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps(data))
    run = import_one(tmp_path / "profile_export_aiperf.json")
    assert run.status == "incomplete" and run.error is not None


@pytest.mark.slow
def test_fixtures_are_aiperfs_own_models() -> None:
    """The summary and every record parse with AIPerf's pydantic models (its own venv)."""
    if not AIPERF_PYTHON.exists():
        pytest.fail(f"{AIPERF_PYTHON} is missing: `make setup-aiperf`")
    check = (
        "import json, sys\n"
        "from aiperf.common.models import MetricRecordInfo\n"
        "from aiperf.common.models.export_models import JsonExportData\n"
        "JsonExportData.model_validate(json.load(open(sys.argv[1])))\n"
        "print(sum(1 for line in open(sys.argv[2]) "
        "if MetricRecordInfo.model_validate_json(line)))\n"
    )
    done = subprocess.run(
        [str(AIPERF_PYTHON), "-c", check, str(SUMMARY), str(RECORDS)],
        cwd=AIPERF,  # not AIPerf's package folder, whose `operator` would shadow the stdlib's
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "6"
