"""`inferlab import` of a `vllm bench sweep serve` folder (tests/fixtures/vllm/sweep/): one run
folder per combination, repeats as repeat-<k>/, the settings in the config, and the report's
Pareto section reading them with throughput per GPU from tensor_parallel_size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness import cli
from harness.reporting.pareto import PER_DEVICE, PER_USER, decision_points
from harness.reporting.results import load

SWEEP = Path(__file__).parents[2] / "fixtures" / "vllm" / "sweep"
COMBINATION = (
    "SERVE--max_num_seqs={seqs}-tensor_parallel_size={tp}-BENCH--request_rate=8-num_prompts=4"
)


def test_a_sweep_folder_imports_as_one_run_per_combination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "imported"
    assert cli.main(["import", str(SWEEP), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "4 result(s) of 3 combination(s)" in captured.out
    assert "1 failed run(s) left out (vLLM's *.failure.json)" in captured.err
    repeats = out / COMBINATION.format(seqs=8, tp=1)
    assert sorted(p.name for p in repeats.iterdir()) == ["repeat-0", "repeat-1"]
    single = out / COMBINATION.format(seqs=32, tp=2)
    summary = json.loads((single / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["imported"]["tool"] == "vllm"
    assert summary["metrics"]["output_tok_per_s"] == 100.0
    assert summary["metrics"]["tpot_p50_s"] == pytest.approx(0.025)
    config = yaml.safe_load((single / "config.yaml").read_text())
    # the sweep's settings, without vLLM's own keys or the repeat number
    assert config["settings"] == {"max_num_seqs": 32, "tensor_parallel_size": 2}
    assert config["workload"]["num_requests"] == 4


def test_the_report_draws_the_pareto_frontier_of_an_imported_sweep(tmp_path: Path) -> None:
    out = tmp_path / "imported"
    assert cli.main(["import", str(SWEEP), "--out", str(out)]) == 0
    points, _ = decision_points(load(out))
    by = points.set_index("label")
    assert sorted(by.index) == [
        "max_num_seqs=32 tensor_parallel_size=1",
        "max_num_seqs=32 tensor_parallel_size=2",
        "max_num_seqs=8 tensor_parallel_size=1",
    ]
    tp2 = by.loc["max_num_seqs=32 tensor_parallel_size=2"]
    assert tp2["devices"] == 2 and tp2[PER_DEVICE] == pytest.approx(50.0)
    assert tp2[PER_USER] == pytest.approx(40.0)  # 1 / 25 ms
    # the two repeats of max_num_seqs=8 pool to their median: (30 + 32) / 2 tok/s
    assert by.loc["max_num_seqs=8 tensor_parallel_size=1", PER_DEVICE] == pytest.approx(31.0)
    report = tmp_path / "report"
    code = cli.main(["report", str(out), "--out", str(report), "--slo", "tpot_p99_s <= 0.028"])
    assert code == 0
    markdown = (report / "report.md").read_text()
    assert (report / "pareto.png").is_file()
    # max_num_seqs=32 tp=1 (60 tok/s per GPU at 25 tok/s per user) beats tp=2 per GPU; but
    # only max_num_seqs=8 (TPOT p99 24 ms) meets 28 ms (tp=2: 30 ms)
    assert "| tpot_p99_s <= 0.028 | max_num_seqs=8 tensor_parallel_size=1 |" in markdown


def test_benchmark_is_refused_for_a_sweep_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["import", str(SWEEP), "--out", str(tmp_path / "x"), "--benchmark", "0"])
    assert code == 2
    assert "--benchmark: " in capsys.readouterr().err and not (tmp_path / "x").exists()


def _copy_result(source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text((SWEEP / COMBINATION.format(seqs=8, tp=1) / source).read_text())


@pytest.mark.parametrize(
    ("files", "said"),
    [
        # both repeat-0: the second was written over the first ("2 result(s)", one kept)
        (["a/run=0.json", "a/run=00.json"], "run=0.json and run=00.json are both repeat 0"),
        # a run folder holding another: the report read only one of them
        (["run=0.json", "b/run=0.json"], "results both in '.' and below it, in 'b'"),
        (
            ["a/run=0.json", "a/request_rate=1/run=0.json"],
            "results both in 'a' and below it, in 'a/request_rate=1'",
        ),
    ],
)
def test_results_that_would_land_on_one_another_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], files: list[str], said: str
) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "summary.csv").write_text((SWEEP / "summary.csv").read_text())
    for k, name in enumerate(files):
        _copy_result(f"run={k}.json", sweep / name)
    out = tmp_path / "imported"
    assert cli.main(["import", str(sweep), "--out", str(out)]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()  # nothing written
