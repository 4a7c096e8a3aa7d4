"""Sweep resume: `run.resume=true` on an existing sweep folder skips complete jobs, re-runs
failed, incomplete and missing ones, rewrites sweep.csv; and refuses a folder that holds
another configuration. A failing variant is recorded as failed and the sweep goes on, then
exits 1 (unless `run.allow_failed_jobs=true`) so that CI notices."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from harness.running.sweep import ResumeMismatch, completed_run

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "model=tiny",
    "workload.num_requests=2",
    "workload.input_len=8",
    "workload.output_len=3",
    "run.warmup_requests=0",
]
SWEEP = [*TINY, "engine.max_num_seqs=0,1,2,4"]  # job 0 fails: max_num_seqs must be >= 1


def sweep(sweep_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "-m",
            *SWEEP,
            *extra,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("sweep")
    result = sweep(sweep_dir)
    # every job ran; job 0 failed, so the sweep says so and exits 1 (it exited 0)
    assert result.returncode == 1, result.stderr
    assert "sweep: 1 of 4 job(s) did not complete (exit 1;" in result.stderr
    assert "job 0 failed: " in result.stderr and "engine.max_num_seqs" in result.stderr
    return sweep_dir


def test_failed_variant_is_recorded_and_the_sweep_goes_on(swept: Path) -> None:
    table = pd.read_csv(swept / "sweep.csv")
    assert list(table["status"]) == ["failed", "complete", "complete", "complete"]
    assert "engine.max_num_seqs" in table.loc[0, "error"]
    assert table.loc[1:, "output_tokens_total"].eq(6).all()
    assert json.loads((swept / "sweep_summary.json").read_text())["num_failed"] == 1


def test_resume_skips_complete_jobs_and_reruns_the_rest(swept: Path) -> None:
    # job 1 complete (kept); job 2 as an interrupted job leaves it; job 3 never ran
    kept = (swept / "1" / "summary.json").read_bytes()
    summary_2 = swept / "2" / "summary.json"
    summary_2.write_text(json.dumps({**json.loads(summary_2.read_text()), "status": "incomplete"}))
    shutil.rmtree(swept / "3")
    (swept / "sweep.csv").unlink()
    result = sweep(swept, "run.resume=true", "run.allow_failed_jobs=true")
    assert result.returncode == 0, result.stderr  # job 0 still fails: allowed
    assert "sweep: 1 of 4 job(s) did not complete\n  job 0 failed: " in result.stderr
    assert "job 0: failed" in result.stdout
    assert "job 1: skipped (already complete)" in result.stdout
    assert "job 2: complete" in result.stdout and "job 3: complete" in result.stdout
    assert (swept / "1" / "summary.json").read_bytes() == kept
    table = pd.read_csv(swept / "sweep.csv")
    assert list(table["job"]) == [0, 1, 2, 3]
    assert list(table["status"]) == ["failed", "complete", "complete", "complete"]
    # how to run, not what was run
    assert "run.resume" not in table.columns and "run.allow_failed_jobs" not in table.columns
    assert table.loc[1:, "output_tokens_total"].eq(6).all()


def test_resume_refuses_a_folder_of_another_configuration(swept: Path) -> None:
    before = {p: p.read_bytes() for p in swept.glob("*/summary.json")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "-m",
            *TINY,
            "workload.output_len=5",
            "engine.max_num_seqs=0,1",
            "run.resume=true",
            f"hydra.sweep.dir={swept}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "run.resume:" in result.stderr and "workload.output_len" in result.stderr
    assert {p: p.read_bytes() for p in swept.glob("*/summary.json")} == before


def test_completed_run_compares_the_stored_configuration(tmp_path: Path) -> None:
    config = {"engine": {"max_num_seqs": 2}, "run": {"resume": True, "progress": True}}
    assert completed_run(tmp_path / "missing", config) is False
    (tmp_path / "config.yaml").write_text("engine: {max_num_seqs: 2}\nrun: {resume: false}\n")
    assert completed_run(tmp_path, config) is False  # no summary yet
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert completed_run(tmp_path, config) is False
    (tmp_path / "summary.json").write_text(json.dumps({"status": "complete"}))
    assert completed_run(tmp_path, config) is True  # run.resume / run.progress ignored
    with pytest.raises(ResumeMismatch, match=r"engine\.max_num_seqs"):
        completed_run(tmp_path, {**config, "engine": {"max_num_seqs": 4}})


def _sweep_into(folder: Path, subdir: str) -> subprocess.CompletedProcess[str]:
    argv = [*TINY, "engine.max_num_seqs=1,2", f"hydra.sweep.dir={folder}", subdir]
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_subdir_that_names_no_job_is_refused_before_any_job_runs(tmp_path: Path) -> None:
    """`hydra.sweep.subdir=same` (no `${hydra.job.num}`) put every job into one folder: job 1
    wrote over job 0's run, sweep.csv listed 1 job of 2, and the sweep exited 0 (and with
    jobs launched side by side, each over the other at once)."""
    result = _sweep_into(tmp_path, "hydra.sweep.subdir=same")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: hydra.sweep.subdir: 'same' is invalid for a sweep of several jobs"
    )
    assert not (tmp_path / "same").exists()


def test_jobs_that_share_a_folder_stop_the_sweep_before_one_overwrites_another(
    tmp_path: Path,
) -> None:
    """A subdir named by a value the jobs share (not the swept one) gives two jobs one folder,
    which only the second job can see: it stops before writing its run over the first's."""
    result = _sweep_into(tmp_path, "hydra.sweep.subdir=${engine.kv_cache}")
    assert result.returncode == 2, result.stderr
    assert "error: hydra.sweep.subdir: " in result.stderr and "an earlier job" in result.stderr
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != ".hydra"]
    kept = yaml.safe_load((folder / "config.yaml").read_text())
    assert kept["engine"]["max_num_seqs"] == 1  # job 0's run, not written over


def test_a_sweep_named_by_its_overrides_resumes_into_its_own_job_folders(
    tmp_path: Path,
) -> None:
    """With hydra.sweep.subdir=${hydra.job.override_dirname}, `run.resume=true` entered the
    folder names: the resume ran every job again into new folders
    (`engine.max_num_seqs=1,...,run.resume=True,...`) and sweep.csv listed 4 jobs of 2."""
    argv = [
        sys.executable, "-m", "harness.cli", "run", "-m", *TINY, "engine.max_num_seqs=1,2",
        f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.override_dirname}",
    ]  # fmt: skip
    first = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    again = subprocess.run(
        [*argv, "run.resume=true", "run.progress=false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("skipped (already complete)") == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == jobs
    assert len(pd.read_csv(tmp_path / "sweep.csv")) == 2


def test_the_how_to_run_keys_are_the_run_section_s_flags() -> None:
    """config.yaml's exclude_keys (job folder names leave them out) is the one list, which
    harness.run_folder reads: each must be a flag of the run section, so that a misspelt one
    is refused here, not silently kept in job folder names and sweep.csv columns."""
    import configs
    from harness.run_folder import HOW_TO_RUN_KEYS
    from harness.running import config_schema  # noqa: F401  (the run section's schema)

    assert {"run.resume", "run.progress", "run.allow_failed_jobs"} == HOW_TO_RUN_KEYS
    for key in HOW_TO_RUN_KEYS:
        section, name = key.split(".")
        assert configs.compose([f"{key}=true"])[section][name] is True
