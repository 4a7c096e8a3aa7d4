"""Every percentile another tool's file holds (p75, p95, p25, guidellm's p001 ...) is kept
under the lab's name for it, not only the ones the lab's default summary has."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.interop.detect import load
from harness.interop.imported import ImportedRun

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def import_one(path: Path) -> ImportedRun:
    [run] = load(path)
    return run


def test_vllm_percentiles_of_any_metric_percentiles(tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "vllm" / "summary_only.json").read_text())
    data.update(
        {"p95_ttft_ms": 95.0, "p75_e2el_ms": 750.0, "p99.9_itl_ms": 9.99, "p5_tpot_ms": 5.0}
    )
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(data))
    run = import_one(path)
    assert run.metrics["ttft_p95_s"] == pytest.approx(0.095)
    assert run.metrics["e2e_p75_s"] == pytest.approx(0.75)
    assert run.metrics["itl_p999_s"] == pytest.approx(0.00999)
    assert run.metrics["tpot_p5_s"] == pytest.approx(0.005)
    assert run.definitions["e2e_p75_s"].source == "p75_e2el_ms"


def test_guidellm_percentiles_all_kept_in_the_labs_spelling(tmp_path: Path) -> None:
    data: dict[str, Any] = json.loads((FIXTURES / "guidellm" / "benchmarks.json").read_text())
    sampled = copy.deepcopy(data)
    sampled["benchmarks"][0]["requests"]["successful"].pop()  # its aggregates, not its rows
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps(sampled))
    run = import_one(path)
    ttft = data["benchmarks"][0]["metrics"]["time_to_first_token_ms"]["successful"]["percentiles"]
    for word, lab in (
        ("p75", "p75"),
        ("p95", "p95"),
        ("p25", "p25"),
        ("p05", "p5"),
        ("p001", "p001"),
        ("p999", "p999"),
    ):
        assert run.metrics[f"ttft_{lab}_s"] == pytest.approx(ttft[word] / 1000), word
    assert run.definitions["ttft_p5_s"].source.endswith("percentiles.p05")


def test_llmperf_quantiles_all_kept(tmp_path: Path) -> None:
    summary = FIXTURES / "llmperf" / "Qwen-Qwen2-5-0-5B-Instruct_550_150_summary.json"
    shutil.copy(summary, tmp_path)  # alone: its aggregates, not recomputed rows
    run = import_one(tmp_path / summary.name)
    data = json.loads(summary.read_text())
    for q in (25, 75, 95):
        assert run.metrics[f"ttft_p{q}_s"] == pytest.approx(data[f"results_ttft_s_quantiles_p{q}"])
        assert run.metrics[f"e2e_p{q}_s"] == pytest.approx(
            data[f"results_end_to_end_latency_s_quantiles_p{q}"]
        )
    assert "ttft_std_s" not in run.metrics  # pandas' stddev has ddof=1, not the lab's


def test_genai_perf_p75_and_std_kept() -> None:
    path = FIXTURES / "genai_perf" / "profile_export_genai_perf.json"
    data = json.loads(path.read_text())
    run = import_one(path)
    ttft = data["time_to_first_token"]
    assert run.metrics["ttft_p75_s"] == pytest.approx(ttft["p75"] / 1000)
    assert run.metrics["ttft_p25_s"] == pytest.approx(ttft["p25"] / 1000)
    assert run.metrics["ttft_std_s"] == pytest.approx(ttft["std"] / 1000)
    assert "ttft_max_s" not in run.metrics  # max: ITL's only
