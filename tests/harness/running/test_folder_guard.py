"""Nothing a run made is written over: `inferlab run` into a folder that holds a run, or a
sweep into a sweep folder, is refused before Hydra writes anything (exit 2, naming
run.resume), unless `run.resume=true`; a run or sweep folder that is a file or cannot be made
is one line, exit 2; a sweep whose sweep.csv cannot be written exits 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.run_folder import runs_written_in
from harness.running.folder_guard import RunFolderGuard, folder_problem
from harness.running.sweep import SweepTable

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "model=tiny",
    "workload.num_requests=1",
    "workload.input_len=4",
    "workload.output_len=2",
    "run.warmup_requests=0",
    "run.progress=false",
    "run.monitor.enabled=false",
]


def inferlab_run(*overrides: str, sweep: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", *(["-m"] if sweep else []), *TINY, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_finished_run_and_a_finished_sweep_are_not_run_over(tmp_path: Path) -> None:
    run_dir, sweep_dir = tmp_path / "run", tmp_path / "sweep"
    first = inferlab_run(f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    before = contents(run_dir)

    again = inferlab_run(f"hydra.run.dir={run_dir}")  # replaced it without a word, exit 0
    assert again.returncode == 2
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"error: hydra.run.dir: {run_dir} already holds a run (complete): ")
    assert "run.resume=true" in line and "nothing was written" in line
    assert contents(run_dir) == before  # .hydra/ included: Hydra wrote nothing either

    resumed = inferlab_run(f"hydra.run.dir={run_dir}", "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr
    assert "skipped (already complete)" in resumed.stdout
    assert (run_dir / "summary.json").read_bytes() == before["summary.json"]

    sweep = ["engine.max_num_seqs=1,2", f"hydra.sweep.dir={sweep_dir}"]
    swept = inferlab_run(*sweep, sweep=True)
    assert swept.returncode == 0, swept.stderr
    before = contents(sweep_dir)
    rerun = inferlab_run(*sweep, sweep=True)  # re-ran and rewrote every finished job
    assert rerun.returncode == 2
    assert f"hydra.sweep.dir: {sweep_dir} already holds a sweep" in rerun.stderr
    assert "multirun.yaml" in rerun.stderr and "run.resume=true" in rerun.stderr
    assert contents(sweep_dir) == before


@pytest.mark.slow
def test_a_run_folder_that_is_a_file_or_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for folder, reason in (
        (a_file, "exists and is not a folder"),  # a FileExistsError traceback
        (a_file / "run", "cannot be written: Not a directory"),  # a NotADirectoryError one
    ):
        done = inferlab_run(f"hydra.run.dir={folder}")
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == f"error: hydra.run.dir: {folder} {reason}" + (
            "; allowed: a folder that holds no run" if folder == a_file else ""
        )
    assert a_file.read_text() == "mine"
    done = inferlab_run("engine.max_num_seqs=1,2", f"hydra.sweep.dir={a_file}", sweep=True)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: hydra.sweep.dir: {a_file} exists and is not a folder")


def test_what_counts_as_a_run_already_there(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    assert runs_written_in(folder) == [] and folder_problem(folder, "k", False, False) is None
    assert folder.is_dir()  # made, and found writable
    (folder / "my_notes.md").write_text("x")
    (folder / "export.json").write_text("{}")
    (folder / "data").mkdir()
    (folder / "data" / "config.yaml").write_text("mine: 1")  # not where a run writes
    assert runs_written_in(folder) == [] and folder_problem(folder, "k", False, False) is None
    (folder / "repeat-0").mkdir()
    (folder / "repeat-0" / "summary.json").write_text("{}")
    assert runs_written_in(folder) == ["repeat-0"]
    # a sweep writes job folders of any name: one that holds a run counts
    assert runs_written_in(folder, sweep=True) == ["data", "repeat-0"]
    (folder / "config.yaml").write_text("a: 1")  # a run would write its own config here
    problem = folder_problem(folder, "hydra.run.dir", sweep=False, resume=False)
    assert problem is not None and "config.yaml, repeat-0" in problem
    assert folder_problem(folder, "hydra.run.dir", sweep=False, resume=True) is None


def test_a_sweep_table_that_cannot_be_written_fails_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hydra turns a callback's exception into a warning: a sweep whose sweep.csv could not
    be written (a full disk) exited 0."""
    (tmp_path / "sweep.csv").mkdir()  # os.replace onto a folder: IsADirectoryError
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as stopped:
        SweepTable().on_multirun_end(config)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}: sweep.csv cannot be written: ")


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_empty_run_folder_is_refused_not_the_current_folder(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hydra.run.dir=$OUT` with OUT unset: Path("") is ".", and the run's config.yaml,
    summary.json and tables went into the current folder, among the user's own files."""
    monkeypatch.chdir(tmp_path)
    section = key.split(".")[1]
    config = OmegaConf.create({"hydra": {section: {"dir": ""}}, "run": {"resume": True}})
    guard = RunFolderGuard()
    start = guard.on_run_start if section == "run" else guard.on_multirun_start
    with pytest.raises(SystemExit) as exited:
        start(config)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {key}: '' is invalid; allowed: a folder's path (an empty one would put the "
        f"run's files in the current folder, {tmp_path})"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_that_is_a_dangling_link_is_named_as_one(tmp_path: Path) -> None:
    """Before: 'hydra.run.dir: ... cannot be written: File exists', for a link to nothing."""
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "gone")
    done = inferlab_run(f"hydra.run.dir={link}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"error: hydra.run.dir: {link} is a symbolic link to {tmp_path / 'gone'}, which is not "
        "there (missing, or a loop of links); allowed: a folder, or a link to one"
    )
    assert not (tmp_path / "gone").exists()
