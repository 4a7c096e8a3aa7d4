"""A lab run exported as vLLM's JSON and imported back gives the lab's own metrics (the import
recomputes them from vLLM's per-request lists: arrival = send - client queue time), and the
imported folder works with `inferlab report` and `inferlab gate` next to the lab run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness import cli
from harness.gating.cli import gate_dirs
from harness.gating.rules import load_rules
from harness.reporting.report import write_report
from harness.run_folder import load_table, read_summary

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def round_trip(lab_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("round_trip")
    assert cli.main(["export", str(lab_run), "--out", str(folder / "vllm.json")]) == 0
    assert cli.main(["import", str(folder / "vllm.json"), "--out", str(folder / "imported")]) == 0
    return folder / "imported"


def test_round_trip_gives_the_labs_metrics(lab_run: Path, round_trip: Path) -> None:
    lab, imported = read_summary(lab_run), read_summary(round_trip)
    assert lab is not None and imported is not None
    whole_run, metrics = lab["metrics_whole_run"], imported["metrics"]
    shared = sorted(set(metrics) & {k for k, v in whole_run.items() if v is not None})
    for prefix in ("ttft_", "tpot_", "e2e_", "itl_"):
        assert any(name.startswith(prefix) for name in shared), prefix
    for name in ("num_completed", "output_tokens_total", "duration_s", "req_per_s",
                 "output_tok_per_s", "send_lateness_p99_s"):  # fmt: skip
        assert name in shared
    for name in shared:
        assert metrics[name] == pytest.approx(whole_run[name], rel=1e-9, abs=1e-12), name
    # only what the import could not measure the lab's way is flagged: ITL per chunk
    differ = {n for n, d in imported["definitions"].items() if not d["same_as_lab"]}
    assert differ == {n for n in metrics if n.startswith("itl_")}
    # and nothing it does not have is there (no steps, no KV, no monitor)
    assert not {"num_steps", "kv_utilization_mean", "peak_rss_bytes"} & set(metrics)


def test_round_trip_keeps_the_requests(lab_run: Path, round_trip: Path) -> None:
    lab = load_table(lab_run, "requests").sort_values(["arrival_s", "request_id"])
    back = pd.read_parquet(round_trip / "requests.parquet")
    assert len(back) == len(lab) and (back["status"] == "ok").all()
    columns = ["arrival_s", "sent_s", "first_token_s", "last_token_s"]
    np.testing.assert_allclose(
        back[columns].to_numpy(), (lab[columns] - lab["arrival_s"].min()).to_numpy(), atol=1e-9
    )
    assert back["output_tokens"].tolist() == lab["output_tokens"].tolist()
    provenance = json.loads((round_trip / "provenance.json").read_text())["imported"]
    assert provenance["tool"] == "vllm" and len(provenance["files"][0]["sha256"]) == 64
    assert provenance["files"][0]["path"].endswith("vllm.json")


def test_report_on_an_imported_folder_beside_a_lab_run(
    lab_run: Path, round_trip: Path, tmp_path: Path
) -> None:
    aiperf = tmp_path / "aiperf"
    assert cli.main(["import", str(FIXTURES / "aiperf"), "--out", str(aiperf)]) == 0
    written = write_report([lab_run, round_trip, aiperf], tmp_path / "report")
    variants = pd.read_csv(written["variants"])
    assert len(variants) == 3
    assert sorted(variants["num_completed"]) == [6, 8, 8]
    lab_ttft = read_summary(lab_run)["metrics"]["ttft_p50_s"]  # type: ignore[index]
    assert lab_ttft in variants["ttft_p50_s"].tolist()
    assert "ttft_s" in written["markdown"].read_text()  # the imported rows' latency table


def test_gate_on_an_imported_folder(lab_run: Path, round_trip: Path, tmp_path: Path) -> None:
    rules = load_rules(None, ())
    result = gate_dirs(lab_run, round_trip, rules)
    rows = {row.metric: row for row in result.rows}
    for counter in ("num_completed", "num_failed", "output_tokens_total", "input_tokens_total"):
        assert rows[counter].verdict == "pass", counter
    assert rows["tpot_p50_s"].ratio == pytest.approx(1.0)
    assert not any("defines" in w for w in result.warnings)  # the same definitions
    # vLLM's own aggregates (no per-request lists): the gate names what is defined
    # differently, and that the run came from elsewhere
    summary_only = tmp_path / "vllm"
    assert (
        cli.main(["import", str(FIXTURES / "vllm/summary_only.json"), "--out", str(summary_only)])
        == 0
    )
    other = gate_dirs(lab_run, summary_only, rules)
    assert any("ran on different machines" in w for w in other.warnings)
    [defines] = [w for w in other.warnings if "defines" in w]
    assert "the candidate holds imported runs" in defines
    assert "output_tok_per_s" in defines and "tpot_p50_s" not in defines  # vLLM's TPOT is ours
    other_rows = {row.metric: row for row in other.rows}
    assert (other_rows["num_completed"].baseline, other_rows["num_completed"].candidate) == (8, 3)
    # from the command line: a verdict, not an error (one run per side: inconclusive)
    assert cli.main(["gate", "--baseline", str(lab_run), "--candidate", str(round_trip)]) in (0, 2)
