"""Importing genai-perf's export (JSON and CSV, tests/fixtures/genai_perf/) and LLMPerf's
results (summary and individual responses, tests/fixtures/llmperf/): values, definitions,
and which file is found from which."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.interop.detect import load
from harness.interop.imported import FROM_REQUESTS, ImportedRun

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GENAI = FIXTURES / "genai_perf" / "profile_export_genai_perf.json"
LLMPERF = FIXTURES / "llmperf"
SUMMARY = LLMPERF / "Qwen-Qwen2-5-0-5B-Instruct_550_150_summary.json"
RESPONSES = LLMPERF / "Qwen-Qwen2-5-0-5B-Instruct_550_150_individual_responses.json"


def import_one(path: Path) -> ImportedRun:
    [run] = load(path)
    return run


# ---- genai-perf --------------------------------------------------------------------------


def test_genai_perf_json() -> None:
    run = import_one(GENAI)
    data = json.loads(GENAI.read_text())
    assert run.tool == "genai-perf" and run.requests is None
    assert run.metrics["ttft_p90_s"] == pytest.approx(data["time_to_first_token"]["p90"] / 1000)
    assert run.metrics["tpot_mean_s"] == pytest.approx(data["inter_token_latency"]["avg"] / 1000)
    assert run.metrics["e2e_p99_s"] == pytest.approx(data["request_latency"]["p99"] / 1000)
    assert run.metrics["req_per_s"] == data["request_throughput"]["avg"]
    assert run.metrics["output_tok_per_s"] == data["output_token_throughput"]["avg"]
    # genai-perf's ITL is per request (latency - TTFT) / (N - 1): the lab's TPOT
    assert run.definitions["tpot_mean_s"].same_as_lab
    assert not run.definitions["ttft_p90_s"].same_as_lab
    assert "errored ones too" in run.definitions["req_per_s"].note
    # no request counts and no p99.9 in the file: absent
    assert not {"num_completed", "itl_mean_s", "input_tokens_total"} & set(run.metrics)
    assert {"output_sequence_length", "output_token_throughput_per_request"} <= set(run.unmapped)
    assert run.config["workload"]["arrival"] == {"process": "closed", "concurrency": 8}
    assert run.config["model"]["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert run.config["target"]["streaming"] is True


def test_genai_perf_csv_matches_its_json() -> None:
    from_csv = import_one(GENAI.with_suffix(".csv"))
    from_json = import_one(GENAI)
    # the CSV has no std column
    assert set(from_csv.metrics) == set(from_json.metrics) - {
        "ttft_std_s",
        "tpot_std_s",
        "e2e_std_s",
    }
    for name, value in from_json.metrics.items():  # the CSV keeps two decimals (of ms)
        if name.endswith("_std_s"):
            continue
        assert from_csv.metrics[name] == pytest.approx(
            value, abs=5e-3 if name.endswith("per_s") else 5e-6
        )
    assert from_csv.metrics["e2e_mean_s"] == pytest.approx(1.65025)  # "1,650.25" in the CSV


# ---- LLMPerf -----------------------------------------------------------------------------


def test_llmperf_summary_with_its_responses() -> None:
    run = import_one(SUMMARY)
    assert [p.name for p in run.files] == [SUMMARY.name, RESPONSES.name]
    responses = pd.DataFrame(json.loads(RESPONSES.read_text()))
    ok = responses[responses["error_code"].isna()]
    assert run.metrics["ttft_p50_s"] == pytest.approx(np.percentile(ok["ttft_s"], 50))
    assert run.metrics["e2e_mean_s"] == pytest.approx(ok["end_to_end_latency_s"].mean())
    # the lab's TPOT over LLMPerf's E2E, which ends when the stream closed: flagged
    tpot = (ok["end_to_end_latency_s"] - ok["ttft_s"]) / (ok["number_output_tokens"] - 1)
    assert run.metrics["tpot_p99_s"] == pytest.approx(np.percentile(tpot, 99))
    assert run.definitions["tpot_p99_s"].source == FROM_REQUESTS
    assert not run.definitions["tpot_p99_s"].same_as_lab
    assert "stream" in run.definitions["tpot_p99_s"].note
    assert (run.metrics["num_requests"], run.metrics["num_failed"]) == (5, 1)
    assert run.metrics["input_tokens_total"] == responses["number_input_tokens"].sum()
    summary = json.loads(SUMMARY.read_text())
    assert run.metrics["req_per_s"] == pytest.approx(
        summary["results_num_completed_requests_per_min"] / 60
    )
    assert run.metrics["output_tok_per_s"] == summary["results_mean_output_throughput_token_per_s"]
    # no start times: no timeline, so no duration, and the rows carry no times
    assert "duration_s" not in run.metrics
    assert run.requests is not None and run.requests["first_token_s"].isna().all()
    assert run.requests["status"].tolist().count("failed") == 1
    # LLMPerf's "inter token latency" (every gap, TTFT included, / N) is neither ITL nor TPOT
    assert "results_inter_token_latency_s_mean" in run.unmapped
    assert not any(name.startswith("itl_") for name in run.metrics)
    assert run.config["workload"]["arrival"] == {"process": "closed", "concurrency": 2}


def test_llmperf_from_either_file_or_the_folder() -> None:
    assert import_one(RESPONSES).metrics == import_one(SUMMARY).metrics
    assert import_one(LLMPERF).metrics == import_one(SUMMARY).metrics


def test_llmperf_summary_alone(tmp_path: Path) -> None:
    shutil.copy(SUMMARY, tmp_path)
    run = import_one(tmp_path / SUMMARY.name)
    summary = json.loads(SUMMARY.read_text())
    assert run.requests is None
    assert run.metrics["ttft_p90_s"] == summary["results_ttft_s_quantiles_p90"]
    assert run.definitions["ttft_p90_s"].source == "results_ttft_s_quantiles_p90"
    assert run.metrics["num_completed"] == 4
    assert "tpot_mean_s" not in run.metrics  # the summary has no TPOT: absent, not derived


def test_llmperf_stray_text_entries(tmp_path: Path) -> None:
    """token_benchmark_ray.py's last collection loop extends the responses with a response's
    keys (strings) instead of the response; they are skipped, with a note."""
    responses = [*json.loads(RESPONSES.read_text()), "error_code", "ttft_s"]
    path = tmp_path / RESPONSES.name
    path.write_text(json.dumps(responses))
    run = import_one(path)
    assert run.metrics["num_requests"] == 5
    assert any("2 text entries" in note for note in run.notes)


def test_llmperf_a_nan_ttft_is_said_and_counted(tmp_path: Path) -> None:
    """A successful response with a NaN ttft_s was silently left out of the TTFT statistics
    while it counted as completed; that is now a warning and a count (`unusable_values`)."""
    responses = json.loads(RESPONSES.read_text())
    responses[0]["ttft_s"] = float("nan")
    path = tmp_path / RESPONSES.name
    path.write_text(json.dumps(responses))
    run = import_one(path)
    assert run.unusable_values == {"ttft_s": 1}
    assert run.warnings == [
        f"{path}: 1 request(s): 'ttft_s' is missing or NaN for a successful request: counted "
        "as completed, left out of the TTFT, TPOT statistics"
    ]
    assert run.metrics["num_completed"] == 4
    assert import_one(RESPONSES).unusable_values == {}


def test_llmperf_damaged_responses_are_named_not_the_summary(tmp_path: Path) -> None:
    """`inferlab import X_summary.json` with an infinite ttft_s in the individual responses
    beside it said `X_summary.json: request 0: an infinite time`, sending the user to the
    file that was fine; the error (and a warning about a NaN) names the responses file."""
    from harness.interop.errors import InteropError

    shutil.copy(SUMMARY, tmp_path)
    responses = json.loads(RESPONSES.read_text())
    responses[0]["ttft_s"] = float("inf")
    path = tmp_path / RESPONSES.name
    path.write_text(json.dumps(responses))
    with pytest.raises(InteropError, match=rf"^{path}: request 0: an infinite time"):
        import_one(tmp_path / SUMMARY.name)
    responses[0]["ttft_s"] = float("nan")
    path.write_text(json.dumps(responses))
    [warning] = import_one(tmp_path / SUMMARY.name).warnings
    assert warning.startswith(f"{path}: 1 request(s): 'ttft_s'")
