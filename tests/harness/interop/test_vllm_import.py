"""Importing `vllm bench serve --save-result` JSON (tests/fixtures/vllm/): the lab's metrics
recomputed from the per-request lists, vLLM's aggregates taken (and flagged) without them,
appended results, older files without start times, vLLM's zero placeholders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.interop.detect import load
from harness.interop.errors import InteropError
from harness.interop.imported import FROM_REQUESTS, ImportedRun

VLLM = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def import_one(path: Path) -> ImportedRun:
    [run] = load(path)
    return run


def test_detailed_file_is_measured_the_labs_way() -> None:
    run = import_one(VLLM / "detailed.json")
    data = json.loads((VLLM / "detailed.json").read_text())
    assert run.tool == "vllm" and run.status == "complete"
    ok = [i for i, e in enumerate(data["errors"]) if not e]
    start, queue = np.array(data["start_times"]), np.array(data["queue_times"])
    ttft, latency = np.array(data["ttfts"]), np.array(data["latencies"])
    # the lab's TTFT runs from the scheduled arrival: vLLM's TTFT plus its client queue time
    from_arrival = (ttft + queue)[ok]
    assert run.metrics["ttft_mean_s"] == pytest.approx(from_arrival.mean())
    assert run.metrics["ttft_p90_s"] == pytest.approx(np.percentile(from_arrival, 90))
    assert run.metrics["e2e_p99_s"] == pytest.approx(np.percentile((latency + queue)[ok], 99))
    n = np.array(data["output_lens"])[ok]
    tpot = (latency[ok] - ttft[ok]) / (n - 1)
    assert run.metrics["tpot_mean_s"] == pytest.approx(tpot.mean())
    for name in ("ttft_mean_s", "tpot_p50_s", "e2e_p50_s", "duration_s", "req_per_s"):
        assert run.definitions[name].source == FROM_REQUESTS
        assert run.definitions[name].same_as_lab, name
    # ITL from vLLM's chunk gaps: pooled like the lab's, but one gap per chunk
    gaps = [g for i in ok for g in data["itls"][i]]
    assert run.metrics["itl_p99_s"] == pytest.approx(np.percentile(gaps, 99))
    assert run.metrics["itl_max_s"] == pytest.approx(0.080)
    assert not run.definitions["itl_p99_s"].same_as_lab
    assert "per streamed chunk" in run.definitions["itl_p99_s"].note
    # every request counts, the failed one too (vLLM's totals: successful requests only)
    assert (run.metrics["num_requests"], run.metrics["num_failed"]) == (4, 1)
    assert (
        run.metrics["input_tokens_total"] == sum(data["input_lens"]) != data["total_input_tokens"]
    )
    # the lab's duration: first arrival -> last completion (vLLM's: its benchmark's start)
    arrival = start - queue
    ends = (start + latency)[ok]
    assert run.metrics["duration_s"] == pytest.approx(ends.max() - arrival.min())
    assert run.metrics["req_per_s"] == pytest.approx(3 / (ends.max() - arrival.min()))
    assert run.metrics["send_lateness_p99_s"] == pytest.approx(np.percentile(queue, 99))
    # the per-request rows, rebased to the first arrival
    rows = run.requests
    assert rows is not None
    assert rows["status"].tolist() == ["ok", "ok", "failed", "ok"]
    assert rows.loc[2, "error"] == "Internal Server Error"
    np.testing.assert_allclose(rows["sent_s"], start - arrival.min())
    # what vLLM computes the lab's way already (TPOT, std) was superseded, not dropped silently
    assert {"mean_tpot_ms", "std_ttft_ms"} <= set(run.superseded)
    assert {"max_output_tokens_per_s", "mean_client_queue_time_ms"} <= set(run.unmapped)
    assert run.config["workload"]["arrival"] == {
        "process": "poisson",
        "rate": 8.0,
        "max_concurrency": 2,
    }
    assert run.config["model"]["name"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_summary_only_file_takes_vllms_aggregates() -> None:
    run = import_one(VLLM / "summary_only.json")
    data = json.loads((VLLM / "summary_only.json").read_text())
    assert run.requests is None
    for lab, key, same in (
        ("ttft_p90_s", "p90_ttft_ms", False),
        ("ttft_p50_s", "median_ttft_ms", False),
        ("tpot_mean_s", "mean_tpot_ms", True),
        ("itl_p99_s", "p99_itl_ms", False),
        ("e2e_mean_s", "mean_e2el_ms", False),
    ):
        assert run.metrics[lab] == pytest.approx(data[key] / 1000)
        assert (run.definitions[lab].source, run.definitions[lab].same_as_lab) == (key, same)
    assert run.metrics["req_per_s"] == data["request_throughput"]
    assert run.metrics["goodput_req_per_s"] == data["request_goodput"]
    assert run.metrics["spec_acceptance_rate"] == pytest.approx(0.625)  # vLLM's percent
    assert run.metrics["spec_acceptance_rate_pos2"] == pytest.approx(0.4)
    # one failure: vLLM's token totals (successful requests) are not the lab's (every request)
    assert not run.definitions["input_tokens_total"].same_as_lab
    # every family's p90 and std (np.std, ddof=0: the lab's) are kept
    assert run.metrics["tpot_p90_s"] == pytest.approx(data["p90_tpot_ms"] / 1000)
    assert run.metrics["e2e_p90_s"] == pytest.approx(data["p90_e2el_ms"] / 1000)
    assert run.metrics["e2e_std_s"] == pytest.approx(data["std_e2el_ms"] / 1000)
    assert "spec_decode_num_drafts" in run.unmapped
    assert "itl_p999_s" not in run.metrics  # the file has no p99.9: absent, not guessed
    assert run.config["workload"]["arrival"] == {"process": "offline"}


def test_appended_results_are_one_run_each() -> None:
    first, second = load(VLLM / "appended.json")
    assert (first.label, second.label) == ("result 0", "result 1")
    assert second.config["workload"]["arrival"] == {
        "process": "gamma",
        "rate": 16.0,
        "burstiness": 0.5,
    }
    assert first.metrics == second.metrics


def test_file_without_start_times_has_no_timeline(tmp_path: Path) -> None:
    """Older vLLM versions kept the per-request lists but no start times, queue times or
    latencies: latencies still come out (from the send), durations and rates from vLLM."""
    data = json.loads((VLLM / "detailed.json").read_text())
    for key in ("start_times", "queue_times", "latencies"):
        del data[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    ok = [0, 1, 3]
    ttft = np.array(data["ttfts"])[ok]
    assert run.metrics["ttft_mean_s"] == pytest.approx(ttft.mean())
    assert not run.definitions["ttft_mean_s"].same_as_lab  # from the send
    e2e = ttft + np.array([sum(data["itls"][i]) for i in ok])
    assert run.metrics["e2e_mean_s"] == pytest.approx(e2e.mean())
    assert run.definitions["duration_s"].source == "duration"  # vLLM's, not recomputed
    assert "send_lateness_p99_s" not in run.metrics
    assert run.requests is not None and run.requests["sent_s"].isna().all()


def test_zero_statistics_are_vllms_placeholders(tmp_path: Path) -> None:
    """vLLM writes np.mean([] or 0) = 0 for a statistic without samples (every request
    failed): absent in the lab, never a latency of 0."""
    data = json.loads((VLLM / "summary_only.json").read_text())
    data.update(completed=0, failed=4, request_throughput=0.0)
    data.update({k: 0.0 for k in data if k.endswith("_ms")})
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    assert not any(name.split("_")[0] in ("ttft", "tpot", "itl", "e2e") for name in run.metrics)
    assert (run.metrics["num_completed"], run.metrics["num_failed"]) == (0, 4)


@pytest.mark.parametrize("duration", [0, 1e308])
def test_a_duration_its_rates_contradict_is_said_not_reported(
    tmp_path: Path, duration: float
) -> None:
    """vLLM's request_throughput is completed / duration: a duration that disagrees (0, or
    1e308 from an edited file) was reported (1e308 s) or dropped without a word (0)."""
    data = json.loads((VLLM / "summary_only.json").read_text())
    data["duration"] = duration
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    assert "duration_s" not in run.metrics and "input_tok_per_s" not in run.metrics
    assert run.metrics["req_per_s"] == data["request_throughput"]  # vLLM's, as given
    [warning] = run.warnings
    assert f"'duration' is {duration:g} s" in warning and "not reported" in warning


def test_a_request_that_ends_after_the_benchmark_is_said_and_counted_failed(
    tmp_path: Path,
) -> None:
    """A latency of 1e308 s in a benchmark of 0.5 s (an edited file) was taken as measured:
    the run's duration_s became 1e308, e2e_mean_s 3.3e307, output_tok_per_s 1.5e-307. A
    request cannot end after vLLM's `duration` (benchmark start -> every request done)."""
    data = json.loads((VLLM / "detailed.json").read_text())
    data["latencies"][1] = 1e308
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    [warning] = run.warnings
    assert "1 request(s): 'latencies' ends after the benchmark's duration (0.5 s)" in warning
    assert run.unusable_values == {"latencies": 1}
    assert run.requests is not None
    assert list(run.requests["status"]) == ["ok", "failed", "failed", "ok"]
    assert run.metrics["duration_s"] < 1 and run.metrics["e2e_mean_s"] < 1
    clean = import_one(VLLM / "detailed.json")
    assert clean.warnings == [] and clean.metrics["num_completed"] == 3
    data["latencies"][1], data["duration"] = 0.2, 0.001  # a duration its rate contradicts
    path.write_text(json.dumps(data))
    [warning] = import_one(path).warnings  # said; no request judged by it
    assert "'duration' is 0.001 s" in warning and "counted as failed" not in warning


def test_a_negative_duration_is_refused(tmp_path: Path) -> None:
    data = json.loads((VLLM / "summary_only.json").read_text())
    data["duration"] = -3.0
    path = tmp_path / "negative.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        InteropError, match=r"negative.json: duration: -3 is invalid; allowed: a time >= 0"
    ):
        import_one(path)


def test_written_rows_round_trip_through_parquet(tmp_path: Path) -> None:
    from datetime import datetime, timezone

    from harness.interop.write import write_imported_run

    run = import_one(VLLM / "detailed.json")
    write_imported_run(run, tmp_path / "out", datetime.now(timezone.utc))
    rows = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    assert rows["prompt_tokens"].tolist() == [32, 48, 40, 16]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["metrics"]["num_completed"] == 3
    assert summary["definitions"]["itl_p50_s"]["same_as_lab"] is False
    assert summary["imported"]["tool"] == "vllm"


def test_a_nan_ttft_is_said_and_counted_not_silently_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM writes NaN into its JSON for some entries: a request with no error but a NaN TTFT
    was silently turned into a failed one. It is still counted as failed (it has no first token
    time), but now a warning on stderr says how many, which field and why, summary.json counts
    them (`unusable_values`), and the row's error says what its entry held."""
    from harness import cli

    data = json.loads((VLLM / "detailed.json").read_text())
    data["ttfts"][1] = float("nan")
    data["latencies"][3] = None
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))  # json.dumps writes NaN, as vLLM's json.dump does
    out = tmp_path / "run"
    assert cli.main(["import", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().err == (
        f"inferlab import: warning: {path}: 1 request(s): 'ttfts' is NaN (1) with no error "
        "recorded: counted as failed (vLLM writes NaN for some requests)\n"
        f"inferlab import: warning: {path}: 1 request(s): 'latencies' is null (1) with no "
        "error recorded: counted as failed (vLLM writes NaN for some requests)\n"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unusable_values"] == {"ttfts": 1, "latencies": 1}
    assert len(summary["warnings"]) == 2
    assert summary["metrics"]["num_completed"] == 1 and summary["metrics"]["num_failed"] == 3
    rows = pd.read_parquet(out / "requests.parquet").set_index("request_id")
    assert rows.loc["1", "error"] == "vLLM's ttfts entry is NaN, with no error recorded"
    assert rows.loc["3", "error"] == "vLLM's latencies entry is null, with no error recorded"
    assert rows.loc["2", "error"] == data["errors"][2]  # vLLM's own failure, unchanged


def test_a_nan_start_time_leaves_the_timeline_out_and_says_so(tmp_path: Path) -> None:
    """One NaN in start_times made every request's time NaN (t0 = NaN)."""
    data = json.loads((VLLM / "detailed.json").read_text())
    data["start_times"][0] = float("nan")
    data["queue_times"][2] = float("inf")
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    assert run.unusable_values == {"start_times": 1, "queue_times": 1}
    assert run.warnings == [
        f"{path}: 1 request(s): 'start_times' is NaN (1): the list is not used",
        f"{path}: 1 request(s): 'queue_times' is infinite (1): the list is not used",
    ]
    assert run.requests is not None and run.requests["sent_s"].isna().all()
    assert np.isfinite(run.metrics["ttft_mean_s"])
    clean = import_one(VLLM / "detailed.json")
    assert clean.unusable_values == {} and clean.warnings == []
