"""Repeats: `repeats=N` runs a configuration N times, each in a fresh process, and the
folder's summary carries the median and the spread; in sweeps, each job holds its repeats;
resume re-runs only the repeats that did not complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from harness.running.repeats import aggregate, repeat_command, validate_repeats

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "model=tiny",
    "workload.num_requests=2",
    "workload.input_len=8",
    "workload.output_len=3",
    "run.warmup_requests=0",
]


def inferlab_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_validate_repeats_names_the_field() -> None:
    assert validate_repeats(3) == 3
    for bad in (0, -1, 1.5, "two", True, None):
        with pytest.raises(ValueError, match=r"repeats: .* is invalid; allowed: an integer >= 1"):
            validate_repeats(bad)


def test_repeat_command_runs_one_repeat_into_its_folder(tmp_path: Path) -> None:
    command = repeat_command(
        ["model=tiny", "repeats=3", "+repeats=3", "run.resume=true"], tmp_path / "repeat-1"
    )
    assert command[:3] == [sys.executable, "-m", "harness.running.app"]
    assert command[3:] == [
        "model=tiny",
        "run.resume=true",
        "repeats=1",
        "hydra.mode=RUN",
        f"hydra.run.dir={tmp_path / 'repeat-1'}",
    ]


def test_aggregate_medians_and_spread() -> None:
    summaries = [
        {"metrics": {"ttft_p50_s": 1.0, "num_steps": 4, "note": "x", "goodput": None}},
        {"metrics": {"ttft_p50_s": 3.0, "num_steps": 4, "note": "y", "goodput": None}},
        {"metrics": {"ttft_p50_s": 2.0, "num_steps": 5, "note": "z", "goodput": 1.0}},
    ]
    metrics, spread = aggregate(summaries)
    assert metrics == {"ttft_p50_s": 2.0, "num_steps": 4, "goodput": 1.0}  # no text metrics
    ttft = spread["ttft_p50_s"]
    assert ttft["values"] == [1.0, 3.0, 2.0]
    assert (ttft["min"], ttft["max"], ttft["std"]) == (1.0, 3.0, pytest.approx(1.0))
    assert ttft["cv"] == pytest.approx(0.5)
    assert isinstance(metrics["num_steps"], int)  # counts stay integers
    assert spread["goodput"]["values"] == [None, None, 1.0]  # aligned with the repeats
    assert spread["goodput"]["std"] is None  # one value: no spread


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sweep of two jobs with repeats=2 (every `inferlab run` costs a process per repeat):
    job 0 (max_num_seqs=0) fails, job 1 is the repeated run the other tests read."""
    sweep_dir = tmp_path_factory.mktemp("repeats") / "sweep"
    result = inferlab_run(
        "-m", *TINY, "repeats=2", "engine.max_num_seqs=0,2", f"hydra.sweep.dir={sweep_dir}"
    )
    assert result.returncode == 1, result.stderr  # both jobs ran; job 0 failed
    assert "sweep: 1 of 2 job(s) did not complete" in result.stderr
    assert "repeat 1/2" in result.stdout and "repeat 2/2" in result.stdout
    return sweep_dir


@pytest.fixture(scope="module")
def repeated(swept: Path) -> Path:
    return swept / "1"


def test_repeats_run_in_fresh_processes_and_summarize(repeated: Path) -> None:
    summary = read_summary(repeated)
    assert summary["status"] == "complete" and summary["repeats"] == 2
    assert summary["repeat_status"] == ["complete", "complete"]
    repeat_summaries = [read_summary(repeated / f"repeat-{k}") for k in range(2)]
    for k, child in enumerate(repeat_summaries):
        assert child["status"] == "complete"
        # each repeat was its own `python -m harness.running.app` command line: Hydra recorded it
        overrides = yaml.safe_load(
            (repeated / f"repeat-{k}" / ".hydra" / "overrides.yaml").read_text()
        )
        assert "repeats=1" in overrides and "model=tiny" in overrides
        assert child["metrics"]["load_s"] > 0  # each process loaded the model itself
    spread = summary["metrics_spread"]
    for name in ("ttft_p50_s", "output_tok_per_s", "load_s", "output_tokens_total"):
        values = [child["metrics"][name] for child in repeat_summaries]
        assert spread[name]["values"] == values
        assert summary["metrics"][name] == pytest.approx(sum(values) / 2)  # median of two
        assert spread[name]["min"] == min(values) and spread[name]["max"] == max(values)
    assert spread["output_tokens_total"]["std"] == 0.0  # deterministic: equal every time
    assert (repeated / "config.yaml").is_file() and (repeated / "provenance.json").is_file()


def test_repeats_inside_a_sweep(swept: Path) -> None:
    """Each job folder holds its repeats; a failing job stops at its first repeat, is
    recorded as failed, and the sweep goes on."""
    sweep = pd.read_csv(swept / "sweep.csv").set_index("engine.max_num_seqs")
    assert sweep.loc[0, "status"] == "failed"
    assert "repeat 0" in sweep.loc[0, "error"] and "engine.max_num_seqs" in sweep.loc[0, "error"]
    assert read_summary(swept / "0")["repeat_status"] == ["failed", "not run"]
    assert not (swept / "0" / "repeat-1").exists()
    assert sweep.loc[2, "status"] == "complete"
    job = read_summary(swept / "1")
    assert sorted(p.name for p in (swept / "1").glob("repeat-*")) == ["repeat-0", "repeat-1"]
    assert sweep.loc[2, "ttft_p50_s"] == pytest.approx(job["metrics"]["ttft_p50_s"])
    assert len(job["metrics_spread"]["ttft_p50_s"]["values"]) == 2


def test_resume_reruns_only_unfinished_repeats(repeated: Path) -> None:
    """Last: it rewrites the job folder the tests above read."""
    first = (repeated / "repeat-0" / "summary.json").read_bytes()
    # what a series interrupted in its second repeat leaves: both summaries say incomplete
    for folder in (repeated / "repeat-1", repeated):
        interrupted = {**read_summary(folder), "status": "incomplete"}
        (folder / "summary.json").write_text(json.dumps(interrupted))
    result = inferlab_run(
        *TINY,
        "repeats=2",
        "engine.max_num_seqs=2",  # the job's configuration, resumed as a run of its own
        "run.resume=true",
        f"hydra.run.dir={repeated}",
    )
    assert result.returncode == 0, result.stderr
    assert "repeat 1/2" not in result.stdout and "repeat 2/2" in result.stdout
    assert (repeated / "repeat-0" / "summary.json").read_bytes() == first
    assert read_summary(repeated / "repeat-1")["status"] == "complete"
    assert read_summary(repeated)["status"] == "complete"
