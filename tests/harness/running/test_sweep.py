"""sweep.csv post-processing: the KV speed-up curve (experiment=kv_speedup's own output) and the
saturation rate, also on a real rate sweep that goes past saturation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import configs
import engines.registry  # noqa: F401  (registers the config groups' schemas)
import harness.running.config_schema  # noqa: F401  (likewise)
import workloads  # noqa: F401  (likewise)
from harness.reporting.results import load
from harness.running.sweep import (
    SweepTable,
    note_unrecorded,
    saturation_rate,
    saturation_summary,
    sweep_rows,
    write_sweep_csv,
)
from harness.running.sweep_outputs import kv_speedup_curve, named_outputs

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]


def test_kv_speedup_curve_per_context_length() -> None:
    frame = pd.DataFrame(
        {
            "engine.kv_cache": ["none", "contiguous", "none", "contiguous"],
            "workload.input_len": [32, 32, 128, 128],
            "tpot_p50_s": [0.04, 0.02, 0.16, 0.02],
            "status": ["complete"] * 4,
        }
    )
    curve = kv_speedup_curve(frame)
    assert curve is not None
    assert curve["context_len"].tolist() == [32, 128]
    assert curve["speedup_contiguous"].tolist() == pytest.approx([2.0, 8.0])


def test_kv_speedup_curve_skips_swept_length_ranges() -> None:
    # a [low, high] range is a distribution, not a context length: no curve, no crash
    frame = pd.DataFrame(
        {
            "engine.kv_cache": ["none", "contiguous"],
            "workload.input_len": [[8, 24], [8, 24]],
            "tpot_p50_s": [0.04, 0.02],
            "status": ["complete"] * 2,
        }
    )
    assert kv_speedup_curve(frame) is None


def _kv_sweep(sweep_dir: Path) -> None:
    """Two finished jobs of a KV-cache sweep over one context length."""
    for job, (kv_cache, tpot) in enumerate([("none", 0.04), ("contiguous", 0.02)]):
        folder = sweep_dir / str(job)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(
            f"- engine.kv_cache={kv_cache}\n- workload.input_len=32\n"
        )
        summary = {"status": "complete", "metrics": {"tpot_p50_s": tpot}}
        (folder / "summary.json").write_text(json.dumps(summary))


def test_the_kv_speedup_table_is_written_where_the_experiment_names_it(tmp_path: Path) -> None:
    # the generic writer knows no experiment's columns: a sweep that does not name the
    # output gets sweep.csv alone, one that does (experiment=kv_speedup) gets the curve too
    _kv_sweep(tmp_path / "plain")
    write_sweep_csv(tmp_path / "plain")
    assert not (tmp_path / "plain" / "kv_speedup.csv").exists()
    _kv_sweep(tmp_path / "named")
    write_sweep_csv(tmp_path / "named", ["kv_speedup"])
    curve = pd.read_csv(tmp_path / "named" / "kv_speedup.csv")
    assert curve["speedup_contiguous"].tolist() == pytest.approx([2.0])


def _hydra_node(*overrides: str) -> Any:
    with initialize_config_dir(version_base="1.3", config_dir=str(configs.CONFIG_DIR)):
        return compose("config", list(overrides), return_hydra_config=True).hydra


def test_the_kv_speedup_preset_names_its_output() -> None:
    assert named_outputs(_hydra_node("experiment=kv_speedup")) == ["kv_speedup"]
    assert named_outputs(_hydra_node()) == []


def test_an_unknown_output_is_named_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as error:
        SweepTable(outputs=["kv_speed"])
    assert str(error.value) == (
        "hydra.callbacks.sweep_table.outputs: 'kv_speed' is invalid; allowed: kv_speedup"
    )


def test_one_output_named_without_a_list_is_that_output() -> None:
    """Before: `hydra.callbacks.sweep_table.outputs=kv_speedup` was split into its letters,
    "outputs: 'k' is invalid"."""
    assert SweepTable(outputs="kv_speedup").outputs == ["kv_speedup"]
    one = "hydra.callbacks.sweep_table.outputs=kv_speedup"
    assert named_outputs(_hydra_node("experiment=kv_speedup", one)) == ["kv_speedup"]


def test_saturation_rate_is_the_highest_rate_still_served() -> None:
    frame = pd.DataFrame(
        {"offered_req_per_s": [1.0, 2.0, 4.0, 8.0], "req_per_s": [1.0, 1.95, 3.0, 3.1]}
    )
    assert saturation_rate(frame) == 2.0


def test_saturation_counts_only_complete_jobs() -> None:
    # a failed job's rates measured nothing of the configuration
    frame = pd.DataFrame(
        {
            "offered_req_per_s": [1.0, 2.0, 4.0, 8.0],
            "req_per_s": [1.0, 1.95, 3.0, 8.0],
            "status": ["complete", "complete", "complete", "failed"],
        }
    )
    assert saturation_rate(frame) == 2.0


def test_saturation_past_every_offered_rate_is_null_and_says_why() -> None:
    frame = pd.DataFrame(
        {
            "offered_req_per_s": [50.0, 400.0],
            "req_per_s": [1.1, 1.3],
            "status": ["complete", "complete"],
        }
    )
    summary = saturation_summary(frame)
    assert summary["saturation_req_per_s"] is None
    assert summary["saturation_note"] == (
        "every offered rate was past saturation: the lowest, 50 req/s, was served at 1.1 req/s"
    )
    assert summary["peak_req_per_s"] == 1.3
    served = saturation_summary(frame.assign(req_per_s=[49.0, 1.3]))
    assert served["saturation_req_per_s"] == 50.0 and served["saturation_note"] is None


def test_a_swept_value_is_read_back_as_hydra_wrote_it(tmp_path: Path) -> None:
    """Hydra writes `workload.arrival={process: poisson, rate: 1}` into overrides.yaml as
    `{process:poisson,rate:1}`, which YAML reads as {'process:poisson': None, 'rate:1': None}:
    that garbled mapping was sweep.csv's workload.arrival column (and a report's variant)."""
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(
        "- workload.arrival={process:poisson,rate:1}\n- engine.kv_cache=none\n"
        "- run.name=yes\n- +engine.draft=[1,2]\n- workload.seed=3\n"
    )
    [row] = sweep_rows(tmp_path)
    assert row["workload.arrival"] == {"process": "poisson", "rate": 1}
    assert row["engine.kv_cache"] == "none" and row["run.name"] == "yes"  # as Hydra set them
    assert row["engine.draft"] == [1, 2] and row["workload.seed"] == 3


def test_a_job_without_a_summary_gets_the_reason_it_was_noted_with(tmp_path: Path) -> None:
    for job in ("0", "1"):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- workload.seed={job}\n")
    note_unrecorded(tmp_path / "1", "summary.json not written: [Errno 28] No space left")
    rows = {row["job"]: row for row in sweep_rows(tmp_path)}
    assert rows["0"]["status"] == "missing"
    assert rows["1"]["status"] == "failed"
    assert rows["1"]["error"] == "summary.json not written: [Errno 28] No space left"


def test_a_rate_sweep_past_saturation_reports_whole_run_throughput(tmp_path: Path) -> None:
    # 10000 req/s: all 8 requests arrive within about a millisecond, far faster than the
    # engine's first steps, so none can complete inside the steady-state window (it ends at
    # the last send, and every request needs 8 steps)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "-m",
            "model=tiny",
            "workload.num_requests=8",
            "workload.input_len=8",
            "workload.output_len=8",
            "run.warmup_requests=0",
            "workload.arrival.process=poisson",
            "workload.arrival.rate=4,10000",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    assert summary["status"] == "complete", summary["error"]
    window, metrics = summary["window"], summary["metrics"]
    assert window["valid"] is False and "no request completed" in window["reason"]
    assert "req_per_s" in window["whole_run_metrics"]
    assert metrics["req_per_s"] == summary["metrics_whole_run"]["req_per_s"] > 0
    assert metrics["output_tok_per_s"] == summary["metrics_whole_run"]["output_tok_per_s"] > 0
    # the printed table marks the whole-run values and says why
    job_1 = done.stdout[done.stdout.index("job 1:") :]
    assert re.search(r"req_per_s +[0-9.,]+ req/s \*\n", job_1), job_1
    assert (
        "* over the whole run: the steady-state window is not valid (no request completed" in job_1
    )
    sweep = pd.read_csv(tmp_path / "sweep.csv").set_index("job")
    assert (sweep["req_per_s"] > 0).all()
    # 10000 req/s is far past what a CPU serves: not served, and the saturation estimate
    # is the lower rate exactly when that one was served
    assert sweep.loc[1, "req_per_s"] < 0.9 * sweep.loc[1, "offered_req_per_s"]
    low = sweep.loc[0]
    sweep_summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    if low["req_per_s"] >= 0.9 * low["offered_req_per_s"]:
        assert sweep_summary["saturation_req_per_s"] == pytest.approx(low["offered_req_per_s"])
    else:  # a machine too busy to serve even 4 req/s
        assert sweep_summary["saturation_req_per_s"] is None
        assert "past saturation" in sweep_summary["saturation_note"]
    assert sweep_summary["peak_req_per_s"] == pytest.approx(sweep["req_per_s"].max())
    # the report's throughput curve reads the same rates: no point falls back to zero
    variants = load(tmp_path).variants
    assert (variants["req_per_s"] > 0).all() and (variants["output_tok_per_s"] > 0).all()
